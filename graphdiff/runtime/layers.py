"""Which modules a splice patches (`splice_targets`): its module pattern (`module_regex`) and class, and for a splice
serving a group of layers, the model's layers that run that group's rounding plan (`scanned_layer`, `_group_targets`).
"""

from __future__ import annotations

import re

import torch

from graphdiff.records import (
    Manifest,
    ManifestSplice,
    layer_of,
)
from graphdiff.runtime.manifest import PatchError
from graphdiff.runtime.state import Targets


def module_regex(module_pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(module_pattern).replace(r"\*", r"\d+") + "$")


def splice_targets(splice: ManifestSplice, named: Targets, manifest: Manifest, model: torch.nn.Module,
                    align: frozenset[str]) -> Targets:
    """The model's modules a splice patches: its module pattern and class, and its group of layers if it has one."""
    pattern = module_regex(splice.module)
    targets = [(n, m) for n, m in named if pattern.match(n) and type(m).__name__ == splice.module_class]
    if splice.layers:  # one group of layers sharing a rounding plan
        targets = _group_targets(targets, splice, manifest.layers_scanned, _layer_count(model, named),
                                 bool(align & set(splice.regions)))
    return targets


def _layer_count(model: torch.nn.Module, named: list[tuple[str, torch.nn.Module]]) -> int:
    config = getattr(model, "config", None)
    count = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers", None)
    return int(count) if count else len({ly for n, _ in named if (ly := layer_of(n)) is not None})


def scanned_layer(layer: int, total: int, scanned: int) -> int | None:
    """The scanned layer whose rounding plan layer `layer` of a `total`-layer model runs: the same one when the model
    has the scanned layer count; else the first for the first, the last for the last, the first middle one for a
    middle layer (None: the scan had no middle layer)."""
    if total == scanned or layer == 0:
        return layer
    if layer == total - 1:
        return scanned - 1
    return 1 if scanned >= 3 else None


def _group_targets(targets: list[tuple[str, torch.nn.Module]], splice: ManifestSplice, scanned: int, total: int,
                   aligned: bool) -> list[tuple[str, torch.nn.Module]]:
    """The modules of the splice's group of layers; refused where the model's layers cannot be told apart as the
    groups need (a model with other layers than the scan's, whose groups are not first / middle / last)."""
    middle = set(range(1, scanned - 1))
    alternating = total != scanned and bool(middle & set(splice.layers)) and not middle <= set(splice.layers)
    out, unknown = [], []
    for name, mod in targets:
        layer = layer_of(name)
        at = scanned_layer(layer, total, scanned) if layer is not None else None
        if at is None or alternating:
            unknown.append(name)
        elif at in splice.layers:
            out.append((name, mod))
    if unknown and aligned:
        raise PatchError(f"{splice.key}: the scan's {scanned} layers run different rounding plans by layer (this "
                         f"splice serves layers {', '.join(map(str, splice.layers))}) and cannot say which one layer "
                         f"{unknown[0]} of this {total}-layer model runs: rescan with --layers {total}, or leave "
                         f"out regions {', '.join(splice.regions)}")
    return out
