"""Model directory checks shared by both capture sides (one clear error per bad input), and the
offline resolution of a model spec (local dir, `tiny:`, HF id) to a checkpoint directory."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from graphdiff.errors import GraphdiffError
from graphdiff.records import cut_layers


def read_config(model_dir: Path) -> dict:
    """config.json of a local HF checkpoint, or a GraphdiffError saying what is wrong."""
    if not model_dir.exists():
        raise GraphdiffError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise GraphdiffError(f"{model_dir} is not a directory (expected an HF checkpoint directory)")
    cfg = model_dir / "config.json"
    if not cfg.exists():
        raise GraphdiffError(f"{model_dir} has no config.json; is it an HF checkpoint?")
    try:
        config = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GraphdiffError(f"{cfg} is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(config, dict) or not config.get("architectures"):
        raise GraphdiffError(f"{cfg} names no architectures; cannot tell which model class to build")
    return config


def has_weights(model_dir: Path) -> bool:
    return any(model_dir.glob("*.safetensors")) or any(model_dir.glob("*.bin"))


def safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file, checked against the file's size (a truncated or damaged file is one
    GraphdiffError naming it, before any engine reads it)."""
    fix = "re-download it, or regenerate it (`graphdiff make-tiny`)"
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            raw = fh.read(n) if 0 <= n <= size - 8 else b""
    except OSError as e:
        raise GraphdiffError(f"cannot read {path}: {e.strerror}") from None
    if not raw:
        raise GraphdiffError(f"{path} is truncated or not a safetensors file ({size} bytes, no complete header): {fix}")
    try:
        header = json.loads(raw)
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise GraphdiffError(f"{path} has a damaged safetensors header: {fix}") from None
    if 8 + n + end > size:
        raise GraphdiffError(f"{path} is truncated ({size} bytes; its header says {8 + n + end}): {fix}")
    return raw


def model_fingerprint(model_dir: Path) -> str:
    """What identifies a checkpoint, cheaply: sha256 (16 hex digits) of config.json (as parsed, keys sorted) and,
    per weights file, its name, size and safetensors header (tensor names, dtypes, shapes, offsets; a .bin file: name
    and size). Weights rewritten with the same layout and size keep the fingerprint."""
    import hashlib

    h = hashlib.sha256(json.dumps(read_config(model_dir), sort_keys=True).encode())
    for f in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        h.update(f"\0{f.name}\0{f.stat().st_size}\0".encode())
        if f.suffix == ".safetensors":
            h.update(safetensors_header(f))
    return h.hexdigest()[:16]


def architecture(config: dict) -> str:
    return str(config["architectures"][0])


def check_decoder_lm(config: dict, where: object) -> None:
    """graphdiff scans decoder-only causal LMs: refuse anything transformers does not build as one."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = architecture(config)
    if arch not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise GraphdiffError(f"{where} is a {arch} ({config.get('model_type', '?')}): graphdiff scans decoder-only "
                             "causal language models (an architecture transformers builds with AutoModelForCausalLM, "
                             "such as Qwen3ForCausalLM), and this is not one")


# --- Resolving a model spec to a checkpoint directory, never touching the network ---------------------------

CONFIGS_PACKAGE = "graphdiff.models.configs"


@dataclass
class ResolvedModel:
    spec: str
    path: Path
    config: dict
    has_weights: bool
    origin: str  # "local", "hf-cache", "bundled" or "tiny"


def bundled_ids() -> list[str]:
    """HF ids whose published config.json ships inside graphdiff (files named `<org>--<name>.json`)."""
    names = (f.name for f in resources.files(CONFIGS_PACKAGE).iterdir() if f.name.endswith(".json"))
    return sorted(name.removesuffix(".json").replace("--", "/", 1) for name in names)


def bundled_config(model_id: str) -> dict | None:
    f = resources.files(CONFIGS_PACKAGE) / (model_id.replace("/", "--") + ".json")
    return json.loads(f.read_text()) if f.is_file() else None


def _hub_cache() -> Path:
    """The HF hub cache directory, by huggingface_hub's own precedence (read here so that nothing from the
    hub client, which can download, is imported)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def find_in_hf_cache(model_id: str) -> Path | None:
    """The local HF cache snapshot of `model_id` that has a config.json; the one refs/main names first."""
    repo = _hub_cache() / ("models--" + model_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if (snapshot / "config.json").is_file():
            return snapshot
    # No usable refs/main (a pinned revision was downloaded): take the newest snapshot with a config.
    snapshots = [s for s in (repo / "snapshots").glob("*") if (s / "config.json").is_file()]
    return max(snapshots, key=lambda s: (s / "config.json").stat().st_mtime, default=None)


def _with_layers(config: dict, layers: int) -> dict:
    """`config` cut to its first `layers` decoder layers, per-layer fields included so it stays valid."""
    old = int(config.get("num_hidden_layers", 0))
    if not 1 <= layers <= old:
        raise GraphdiffError(f"cannot keep {layers} layers of a model with {old}; choose 1 to {old}")
    return cut_layers(config, layers)


def _materialize(model_id: str, config: dict, work_dir: Path | None, link_from: Path | None = None) -> Path:
    """Write `config` as a checkpoint directory; with `link_from`, symlink that snapshot's other files."""
    text = json.dumps(config, indent=2) + "\n"
    if work_dir is None:  # one stable directory per config: engine samples cached for it stay valid
        import hashlib

        key = hashlib.sha256(text.encode()).hexdigest()[:12]
        work_dir = Path(os.environ.get("GRAPHDIFF_CACHE", Path.home() / ".cache" / "graphdiff")) / "configs" / key
    out = Path(work_dir) / model_id.replace("/", "--")
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "config.json").is_file() or (out / "config.json").read_text() != text:
        (out / "config.json").write_text(text)
    for f in link_from.iterdir() if link_from else ():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    return out


# "org/name" exactly; anything else (absolute, relative with ./ or deeper) is a local path.
HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _is_hf_id(spec: str) -> bool:
    return HF_ID.fullmatch(spec) is not None and not Path(spec).exists()


def resolve_model(spec: str, work_dir: Path | None = None, layers: int | None = None,
                  random_weights: bool = False) -> ResolvedModel:
    """A local checkpoint dir, `tiny:ARCH[:LAYERS]`, or an HF id (local HF cache, else a bundled config).

    `layers` cuts an HF id's model to its first decoder layers (a config-only copy, or the cached
    snapshot's files linked beside the cut config); a local directory is always used as is, and never written:
    one without weights is refused unless `random_weights`, and then a copy in the graphdiff cache gets them.
    """
    if spec.startswith("tiny:"):
        return _resolve_tiny(spec, layers)
    if not _is_hf_id(spec):
        return _resolve_local(spec, work_dir, random_weights)
    snapshot = find_in_hf_cache(spec)
    if snapshot is not None:
        config = read_config(snapshot)
        check_decoder_lm(config, spec)
        if layers is not None:
            snapshot = _materialize(spec, _with_layers(config, layers), work_dir, link_from=snapshot)
            config = read_config(snapshot)
        return ResolvedModel(spec, snapshot, config, has_weights(snapshot), "hf-cache")
    bundled = bundled_config(spec)
    if bundled is None:
        raise GraphdiffError(
            f"unknown model {spec!r}: no local directory, no snapshot in the HF cache ({_hub_cache()}) and no "
            "bundled config; pass a local checkpoint directory or a bundled id (`graphdiff configs` lists them)"
        )
    config = _with_layers(bundled, layers) if layers is not None else bundled
    path = _materialize(spec, config, work_dir)
    return ResolvedModel(spec, path, config, False, "bundled")


def _resolve_local(spec: str, work_dir: Path | None, random_weights: bool) -> ResolvedModel:
    path = Path(spec).expanduser()
    config = read_config(path)
    check_decoder_lm(config, path)
    if has_weights(path):
        return ResolvedModel(spec, path, config, True, "local")
    if not random_weights:
        raise GraphdiffError(f"{path} has no weights (*.safetensors or *.bin): pass --random-weights to run it on "
                             "seeded random weights (made in the graphdiff cache; this directory is not written)")
    copy = _materialize(path.resolve().name or "model", config, work_dir, link_from=path)
    return ResolvedModel(spec, copy, config, has_weights(copy), "local")


def _resolve_tiny(spec: str, layers: int | None) -> ResolvedModel:
    from graphdiff.models.tiny import tiny_path

    arch, _, n = spec.removeprefix("tiny:").partition(":")
    if n and not n.isdigit():
        raise GraphdiffError(f"bad tiny model {spec!r}; expected tiny:ARCH or tiny:ARCH:LAYERS")
    count = int(n) if n else (layers if layers is not None else 2)
    if count < 1:
        raise GraphdiffError(f"{spec}: a model needs at least 1 layer (got {count})")
    path = tiny_path(arch, count)
    return ResolvedModel(spec, path, read_config(path), has_weights(path), "tiny")
