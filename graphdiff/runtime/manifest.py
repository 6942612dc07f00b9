"""The patch's files read and checked: the manifest (`load_manifest`), the model against it (`check_model`:
architecture, the scanned config, torch and transformers versions), the regions asked for, the generated module
beside it (`load_generated`, refused if changed since generation).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from graphdiff.errors import GraphdiffError
from graphdiff.records import (
    MANIFEST_VERSION,
    Manifest,
    cut_layers,
)


class PatchError(GraphdiffError):
    """The patch does not fit this model or environment (the message says what to do)."""


def load_manifest(path: str | Path) -> Manifest:
    """manifest.json (or its directory) read and validated; a PatchError naming the file and the fix."""
    from graphdiff.records import parse_versioned

    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json"
    if not path.is_file():
        raise PatchError(f"cannot read the manifest {path}: " + ("a directory" if path.is_dir() else "no such file"))
    try:
        return parse_versioned(Manifest, path, "patch manifest", MANIFEST_VERSION)
    except PatchError:
        raise
    except GraphdiffError as e:
        raise PatchError(str(e)) from None


# Fields that say how a run is set up, not what the model computes: a trainer may set them differently.
_RUN_FIELDS = {"transformers_version", "_name_or_path", "_commit_hash", "dtype", "torch_dtype", "use_cache",
               "architectures", "output_attentions", "output_hidden_states", "return_dict", "bos_token_id",
               "eos_token_id", "pad_token_id", "_attn_implementation_autoset"}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def scanned_config(config: Any) -> dict:
    """The fields of a transformers config that a patch depends on: those that differ from the class's
    defaults (as transformers normalizes them: `torch_dtype` -> `dtype`, `rope_theta` -> `rope_parameters`),
    without run settings. The scan records this; `apply` compares the model's values at these keys."""
    return _plain({k: v for k, v in config.to_diff_dict().items() if k not in _RUN_FIELDS})


def _base_version(v: str) -> str:
    return v.split("+")[0]


def check_model(model: torch.nn.Module, manifest: Manifest, path: Path, allow_version_mismatch: bool) -> None:
    config = getattr(model, "config", None)
    if config is None:
        raise PatchError("runtime.apply needs a transformers PreTrainedModel (no .config)")
    archs = list(getattr(config, "architectures", None) or []) + [type(model).__name__]
    if manifest.architecture not in archs:
        raise PatchError(f"the manifest is for {manifest.architecture}, the model is {archs[0]}: "
                         "scan this model and generate its own patch")
    # Field by field over what the scan recorded, so that a field a newer transformers adds with its
    # default, or a run setting (use_cache, dtype), does not refuse the patch.
    model_config = _plain(cut_layers(config.to_dict(), manifest.layers_scanned))
    for key, scanned in manifest.config.items():
        if model_config.get(key) != scanned:
            raise PatchError(f"the model's config has {key}={json.dumps(model_config.get(key))}, the scanned one "
                             f"{json.dumps(scanned)}: scan this model and generate its own patch")
    if not allow_version_mismatch:
        import transformers

        for name, installed in (("torch", torch.__version__), ("transformers", transformers.__version__)):
            scanned = manifest.versions.get(name)
            if scanned and _base_version(scanned) != _base_version(installed):
                raise PatchError(f"{name} {installed} is installed, the patch was scanned with {scanned}: HF's "
                                 "code may round elsewhere now; rescan, or pass allow_version_mismatch=True")


def load_generated(manifest: Manifest, path: Path) -> ModuleType:
    """The generated module beside the manifest at `path`, refused if changed since generation; one per
    content (sys.modules)."""
    file = path.parent / manifest.module_file
    try:
        source = file.read_bytes()
    except OSError as e:
        raise PatchError(f"cannot read the generated module {file}: {e.strerror}") from None
    digest = hashlib.sha256(source).hexdigest()
    if digest != manifest.module_sha256:
        raise PatchError(f"{file} was changed after generation (sha256 {digest[:12]}, manifest says "
                         f"{manifest.module_sha256[:12]}): regenerate it with `graphdiff patch`")
    name = f"graphdiff_patch_{digest[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise PatchError(f"{file} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module  # an import like any other, kept for the process: pickling looks functions up by module
    return module


def regions_to_apply(manifest: Manifest, path: Path, regions: Sequence[str] | None) -> list[str]:
    """The regions asked for (by default the shipped patch: generated regions the scan did not measure widening the
    gap); each must be in the manifest and generated."""
    generated = [r.name for r in manifest.regions if r.generated]
    if regions is None:
        regions = [r.name for r in manifest.regions if r.generated and r.enabled]
    unknown = [r for r in regions if r not in {m.name for m in manifest.regions}]
    if unknown:
        raise PatchError(f"no region {', '.join(unknown)} in {path}; regions: {', '.join(generated)}")
    failed = [f"{r.name} ({r.reason})" for r in manifest.regions if r.name in regions and not r.generated]
    if failed:
        raise PatchError(f"not generated, cannot apply: {'; '.join(failed)}")
    return list(regions)
