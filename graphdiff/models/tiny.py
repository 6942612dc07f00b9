"""Seeded tiny random-weight HF checkpoints, so nothing ever needs a model hub.

The init is chosen so that next-token distributions are far from uniform (the
log-prob gap between engine and trainer is then clearly measurable): a larger
initializer range than HF's default and norm weights around 1 with real spread.
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphdiff.errors import GraphdiffError
from graphdiff.models.recipes import ARCHS, INITIALIZER_RANGE, ONE_PLUS_NORM, TINY_SHAPE

__all__ = ["ARCHS", "TINY_SHAPE", "make_tiny", "seeded_init", "tiny_path", "write_random_weights"]


def _per_layer(overrides: dict, layers: int) -> dict:
    """Lists with one entry per layer (layer_types, no_rope_layers) cycled to `layers` entries."""
    out = dict(overrides)
    for key, value in overrides.items():
        if isinstance(value, list) and value and (key == "layer_types" or key.endswith("_layers")) \
                and key != "mlp_only_layers":
            out[key] = [value[i % len(value)] for i in range(layers)]
    return out


def widened(overrides: dict, hidden: int | None = None, head_dim: int | None = None, vocab: int | None = None) -> dict:
    """The recipe at another shape: `hidden` wide in heads of `head_dim` (default 64; a third of them for K/V), the
    MLP 8/3 wider (multiple of 64; Falcon's 4 times, the width vLLM's Falcon assumes whatever `ffn_hidden_size`
    says), `vocab` tokens; only the fields the recipe sets change. A vocabulary alone leaves the heads as they are."""
    if vocab is not None and vocab < 64:
        raise GraphdiffError(f"--vocab {vocab}: give at least 64 tokens")
    if hidden is None and head_dim is None:
        return {**overrides, **({"vocab_size": vocab} if vocab is not None and "vocab_size" in overrides else {})}
    head_dim = head_dim or 64
    hidden = hidden if hidden is not None else int(overrides.get("hidden_size", overrides.get("n_embd", 256)))
    if head_dim < 16 or head_dim % 16:
        raise GraphdiffError(f"--head-dim {head_dim}: give a positive multiple of 16")
    if hidden < head_dim or hidden % head_dim or hidden % 64:
        raise GraphdiffError(f"--hidden {hidden}: give a positive multiple of 64 and of the head size {head_dim}")
    heads = hidden // head_dim
    sizes = dict(hidden_size=hidden, n_embd=hidden, d_model=hidden, intermediate_size=-(-hidden * 8 // 3 // 64) * 64,
                 num_attention_heads=heads, n_head=heads, num_key_value_heads=max(1, heads // 3),
                 num_kv_heads=max(1, heads // 3), ffn_hidden_size=4 * hidden, head_dim=head_dim)
    if vocab is not None:
        sizes["vocab_size"] = vocab
    return {**overrides, **{k: v for k, v in sizes.items() if k in overrides}}


def make_tiny(arch: str, out: Path, layers: int = 2, seed: int = 0, hidden: int | None = None,
              head_dim: int | None = None, vocab: int | None = None) -> Path:
    """Write config.json + model.safetensors for a tiny `arch` model into `out` (`hidden`, `head_dim`, `vocab`:
    another shape than the recipe's)."""
    import transformers

    if arch not in ARCHS:
        raise GraphdiffError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    if layers < 1:
        raise GraphdiffError(f"--layers {layers}: a model needs at least 1 decoder layer")
    config_cls, overrides = ARCHS[arch]
    if (hidden, head_dim, vocab) != (None, None, None):
        overrides = widened(overrides, hidden, head_dim, vocab)
    config = getattr(transformers, config_cls)(**_per_layer(overrides, layers), num_hidden_layers=layers)
    with torch.random.fork_rng(devices=[]):  # HF draws its init from the global generator: forked,
        torch.manual_seed(seed)  # so the caller's stream is untouched
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    seeded_init(model, seed, INITIALIZER_RANGE, one_plus=arch in ONE_PLUS_NORM)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def seeded_init(model: torch.nn.Module, seed: int, scale: float, one_plus: bool = False) -> None:
    """Weights ~ N(0, scale), norm weights ~ 1 + 0.5 N(0, 1) (`one_plus`: 0.5 N(0, 1), for norms that scale by
    1 + w), biases ~ 0.02 N(0, 1); seeded. A norm is any module whose class name says Norm (LayerNorm, RMSNorm,
    under any attribute name: GPT-2's ln_1, OPT's final_layer_norm)."""
    norms = {f"{m}.weight" if m else "weight" for m, mod in model.named_modules()
             if "Norm" in type(mod).__name__ and isinstance(getattr(mod, "weight", None), torch.nn.Parameter)}
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in norms or name.endswith("norm.weight"):
                p.copy_((0.0 if one_plus else 1.0) + 0.5 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # biases
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=gen))


def write_random_weights(model_dir: Path, seed: int = 0) -> Path:
    """Seeded random BF16 weights for a config-only checkpoint directory in the graphdiff cache (a bundled config,
    or the cache's copy of a weightless local directory: a user's directory is never written), so that the engine
    and the trainer run the very same weights without any download.

    Generated once per (config, seed) into the graphdiff cache and linked into `model_dir`:
    a full-width model is gigabytes even with two layers."""
    import hashlib
    import os
    import shutil
    import tempfile

    key = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]
    root = Path(os.environ.get("GRAPHDIFF_CACHE", Path.home() / ".cache" / "graphdiff")) / "weights"
    cached = root / f"{key}-s{seed}"
    if not cached.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root))
        shutil.copy(model_dir / "config.json", tmp / "config.json")
        _generate_weights(tmp, seed)
        if cached.exists():
            shutil.rmtree(tmp)
        else:
            tmp.rename(cached)
    for f in cached.iterdir():
        if f.name != "config.json" and not (model_dir / f.name).exists():
            (model_dir / f.name).symlink_to(f)
    return model_dir


def _generate_weights(model_dir: Path, seed: int) -> None:
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    seeded_init(model, seed, float(getattr(config, "initializer_range", 0.02) or 0.02))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(model_dir)
    (model_dir / "config.json").unlink()  # the caller's config stays authoritative


def tiny_path(arch: str, layers: int = 2, seed: int = 0) -> Path:
    """The bundled default model `tiny:ARCH`: generated once (seeded) into the user cache."""
    import hashlib
    import json
    import os
    import shutil
    import tempfile

    root = Path(os.environ.get("GRAPHDIFF_CACHE", Path.home() / ".cache" / "graphdiff")) / "tiny"
    recipe = json.dumps([TINY_SHAPE, ARCHS.get(arch)], sort_keys=True, default=str)
    path = root / f"{arch}-L{layers}-s{seed}-{hashlib.sha256(recipe.encode()).hexdigest()[:8]}"
    if not (path / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root))
        make_tiny(arch, tmp, layers=layers, seed=seed)
        if path.exists():  # a concurrent run won; keep its copy
            shutil.rmtree(tmp)
        else:
            tmp.rename(path)
    return path
