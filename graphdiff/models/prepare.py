"""A model spec made ready for both sides: resolved offline to a checkpoint directory, seeded weights where it has
none (in the graphdiff cache), its weights files' headers read; and the checkpoint a recorded scan ran, again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphdiff.errors import GraphdiffError
from graphdiff.records import Progress, ScanResult

DEFAULT_LAYERS = 2  # decoder layers are identical: two show everything, including layer-to-layer flow


def prepare_model(spec: str, layers: int | None, work_dir: Path | None, progress: Progress,
                  random_weights: bool = False) -> tuple[Any, list[str]]:
    """Resolve a model spec to a checkpoint dir both sides can load (seeded weights, in the graphdiff cache, if it
    has none), its weights files' headers read (a truncated file is refused here, before any engine starts)."""
    from graphdiff.models.resolve import resolve_model, safetensors_header
    from graphdiff.models.tiny import write_random_weights

    resolved = resolve_model(spec, work_dir=work_dir, layers=layers if layers is not None else DEFAULT_LAYERS,
                             random_weights=random_weights)
    total = int(resolved.config.get("num_hidden_layers", 0))
    notes = []
    if resolved.origin == "bundled" or resolved.origin == "hf-cache":
        notes.append(f"config from {resolved.origin}; decoder layers are identical, so {total} layer(s) are "
                     "scanned and regions are collapsed across them")
    if not resolved.has_weights:
        progress("writing seeded random weights (same on both sides; no download)")
        write_random_weights(resolved.path)
        notes.append("weights: seeded random (graphdiff.models.tiny.write_random_weights), identical on both sides")
    for f in sorted(resolved.path.glob("*.safetensors")):
        safetensors_header(f)
    return resolved, notes


def scanned_model(scan: ScanResult, progress: Progress) -> Path:
    """The checkpoint a scan ran, resolved again as the scan resolved it; refused when it is not the same model
    any more (the scan's recorded fingerprint)."""
    from graphdiff.models.resolve import model_fingerprint

    path = prepare_model(scan.model, scan.layers_scanned, None, progress, random_weights=True)[0].path
    if scan.fingerprint and model_fingerprint(path) != scan.fingerprint:
        raise GraphdiffError(f"{scan.model} is not the checkpoint the scan ran (fingerprint {model_fingerprint(path)}, "
                             f"the scan's {scan.fingerprint}): rescan with `{scan.reproduce}`")
    return path
