"""apply / remove / active_regions: a patch installed on a model in place, and taken off again.

    from graphdiff import runtime
    runtime.apply(model, "patches/manifest.json")             # before FSDP/DDP wrapping
    runtime.apply(model, "patches/manifest.json", regions=["model.layers.*.self_attn"])  # ablation
    runtime.apply(model, "patches/manifest.json", attention_gradient="bf16")  # HF's BF16 attention backward
    runtime.remove(model)

How the generated code is spliced in (no per-model code; everything comes from the manifest):
- module splices: each module matching the splice's path pattern and class gets an instance `forward` that
  calls the generated function (FP32 inside; an output stays FP32 only where the engine keeps it so);
- function splices: the module-level function (e.g. `apply_rotary_pos_emb` in the modeling module, looked up
  by the caller at call time) is replaced by a dispatcher; while a patched model's calling module runs
  (forward hooks set a context variable), it runs that model's replacement, elsewhere the original, so
  other models in the process are not affected; arguments are bound by name as the manifest says;
- carry splices (residual stream): a forward pre-hook upcasts the layer's incoming activation to FP32, and
  eager type promotion keeps the residual sums in FP32, as the engine does; for a piecewise engine, which stores
  the residual in BF16 where it crosses a graph split (attention), the layer's own residual add gets it rounded
  (held in FP32) and the child modules the manifest names (`fp32_children`, the input norm) the FP32 value;
- attention splice (an engine whose attention keeps the softmax probabilities FP32, graphdiff.analysis.opaque): the
  generated attention function is registered with transformers' AttentionInterface and set as the model's
  attention implementation (HF's sdpa on FP32-upcast q/k/v, output rounded once); an attention module whose own
  code calls torch's sdpa (FalconAttention) gets that call dispatched to the same function while it runs, as a
  function splice's (`torch.nn.functional.scaled_dot_product_attention`, or a name its module bound it to);
- linear splices (a tensor-parallel engine's row-parallel matmuls, `allreduce` regions): the nn.Linear's forward
  computes the partial products over the manifest's `shards` parts of its input dimension, each rounded to the
  weight dtype, summed in FP32 and rounded once (the generated `linear_split_k`), as the engine's ranks and its
  all-reduce do;
- every nn.Linear (and transformers' Conv1D) rounds a floating input to its weight dtype: the engine stores every
  matmul input in low precision, and an FP32 value the patch produced must be rounded exactly there; a Conv1D
  multiplies by its weight as the engine holds it (transposed, `[out, in]`: ATen's own BF16 GEMM, on a CPU without
  oneDNN's BF16 matmul, sums the two layouts in other orders); every nn.LayerNorm
  normalizes an FP32 input in FP32 (weights upcast), as the engine's kernel normalizes the FP32 residual sum.
Memory: a splice keeps only its inputs for the backward (the Triton backward kernel recomputes the forward; the
PyTorch path runs under non-reentrant checkpointing where its autograd would keep an activation-sized tensor of its
own, and plainly, once, where it keeps only small ones: RoPE's tables), and an FP32 output that a later eager op
saves (SiLU's output for the gate product, the q/k norm for RoPE) is saved as a recipe and recomputed in the
backward, so the patch adds no FP32 activations to what autograd keeps.
Under torch.compile the splices run eagerly (`eager`): the compiled forward keeps the patched values bit for bit;
the first compiled forward warns that Inductor's gradients of the model's other ops differ.
Splices of regions not in `regions` are installed too, rounding where HF eager rounds (bit-identical to
unpatched HF), so that a value another region made FP32 is still handled; only their sites stay rounded.

Imports neither vLLM nor the scanner: only torch, pydantic (the manifest model) and the generated module.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from graphdiff.records import Manifest
from graphdiff.runtime.layers import splice_targets
from graphdiff.runtime.manifest import PatchError, check_model, load_generated, load_manifest, regions_to_apply
from graphdiff.runtime.memory import saved_fp32_recomputed
from graphdiff.runtime.state import ATTENTION_GRADIENTS, ATTR, Patching, State
from graphdiff.runtime.targets import (
    PATCH,
    addmm_folds,
    conv1d_as_linear,
    is_conv1d,
    layer_norm_takes_fp32,
    round_linear_input,
)


def apply(model: torch.nn.Module, manifest_path: str | Path, regions: Sequence[str] | None = None, *,
          allow_version_mismatch: bool = False, attention_gradient: str = "fp32") -> torch.nn.Module:
    """Patch `model` in place (and return it). Re-applying replaces the previous patch (idempotent).

    `attention_gradient`: the attention splice's backward where torch's CPU flash kernel runs it: "fp32", FP32
    attention's exact gradient; "bf16", the BF16 flash kernel HF's unpatched trainer runs, at the patched forward's
    output and log-sum-exp (HF's gradient precision, for less step time). The forward is the same either way.
    A patch refused midway (a splice the model cannot take) leaves the model unpatched."""
    if attention_gradient not in ATTENTION_GRADIENTS:
        raise PatchError(f"attention_gradient={attention_gradient!r}: give one of {', '.join(ATTENTION_GRADIENTS)}")
    path = Path(manifest_path)
    path = path / "manifest.json" if path.is_dir() else path
    manifest = load_manifest(path)
    check_model(model, manifest, path, allow_version_mismatch)
    chosen = regions_to_apply(manifest, path, regions)
    gen = load_generated(manifest, path)
    remove(model)
    p = Patching(gen, frozenset(chosen), model, State(path, chosen), attention_gradient)
    setattr(model, ATTR, p.state)
    try:
        _install(p, manifest)
    except BaseException:  # a splice refused midway: the model is left unpatched, not half patched
        remove(model)
        raise
    return model


def _install(p: Patching, manifest: Manifest) -> None:
    model = p.model
    named = list(model.named_modules())
    for splice in manifest.splices:
        if not splice.problems:
            PATCH[splice.target](p, splice, splice_targets(splice, named, manifest, model, p.align))
    addmm_folds(p, named)
    for _, mod in named:
        if isinstance(mod, torch.nn.Linear) or is_conv1d(mod):
            p.state.undo.append(mod.register_forward_pre_hook(round_linear_input).remove)
            if is_conv1d(mod) and "forward" not in mod.__dict__:
                p.state.undo.append(conv1d_as_linear(mod))
        elif isinstance(mod, torch.nn.LayerNorm):
            p.state.undo.append(layer_norm_takes_fp32(mod))
    p.state.undo.append(saved_fp32_recomputed(model))


def remove(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `apply` (a no-op on an unpatched model)."""
    state: State | None = model.__dict__.pop(ATTR, None)
    if state is not None:
        for undo in reversed(state.undo):
            undo()
    return model


def active_regions(model: torch.nn.Module) -> list[str] | None:
    """The regions `model` is patched with (None: not patched)."""
    state = model.__dict__.get(ATTR)
    return list(state.regions) if state is not None else None
