"""How a generated function is called: `chooser` (the Triton kernel or the PyTorch path: with its closed-form
gradient where the patch has one and GRAPHDIFF_CLOSED_FORM is not 0, else checkpointed where it keeps activations),
a module's forward (`module_forward`), a module-level function's replacement (`function_replacement`) and its
process-wide dispatcher (`_dispatcher`, `swap_in`, `_unpatch`: the originals in `_FUNCTIONS`, the replacement of the
patched module running now in `_CALLERS`), torch's sdpa called from a module's own code (`sdpa_calls`), and `eager` (a
splice left out of torch.compile's graphs).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

import torch
import torch.utils.checkpoint

from graphdiff.records import (
    CalledSplice,
    FunctionSplice,
    ModuleSplice,
)
from graphdiff.runtime.memory import Recompute, keeps_intermediates
from graphdiff.runtime.state import State

TORCH_SDPA = "torch.nn.functional.scaled_dot_product_attention"  # an attention splice's function where a module's


_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention  # own code calls torch's sdpa (FalconAttention)


_FUNCTIONS: dict[str, tuple[Any, int]] = {}  # dotted function -> (original, patched models using it)


# dotted function -> the replacement of the patched module running now (set by that module's forward hooks)
_CALLERS: ContextVar[dict[str, Callable] | None] = ContextVar("graphdiff_callers", default=None)


def eager(fn: Callable, wrapped: Callable | None = None) -> Callable:
    """`fn` run eagerly under `torch.compile` (Dynamo leaves it out of the graph it compiles): Inductor would fuse
    a splice's FP32 ops and sum its rows in its own order, so a compiled patched model would compute other values
    than the eager one; with the splices eager, the compiled model's forward computes the patched values bit for
    bit. `wrapped`: the function it stands in for (its `__wrapped__`). A plain function is wrapped once: what is
    registered under its name (transformers' attention registry) stays the same object across applies."""
    if wrapped is None and isinstance(fn, FunctionType):
        if "_graphdiff_eager" not in fn.__dict__:
            fn.__dict__["_graphdiff_eager"] = torch.compiler.disable(fn, recursive=True)
        return fn.__dict__["_graphdiff_eager"]
    out = torch.compiler.disable(fn, recursive=True)
    if wrapped is not None:
        out.__wrapped__ = wrapped
    return out


def _use_triton(tensors: Sequence[torch.Tensor]) -> bool:
    """Triton kernels on GPU tensors; on CPU only when asked (GRAPHDIFF_TRITON=1 with TRITON_INTERPRET=1)."""
    if os.environ.get("GRAPHDIFF_TRITON") == "0":
        return False
    return os.environ.get("GRAPHDIFF_TRITON") == "1" or any(t.is_cuda for t in tensors)


class _ClosedForm(torch.autograd.Function):
    """A generated function run without autograd, keeping only the inputs its closed-form gradient reads
    (`CalledSplice.torch_backward_reads`; the others as their shape and dtype); its gradient from that closed form:
    no second forward, no FP32 intermediates kept or rebuilt by autograd."""

    @staticmethod
    def forward(ctx: Any, ref: Callable, backward: Callable, reads: frozenset[int], align: frozenset[str], lanes: int,
                *inputs: torch.Tensor) -> Any:
        ctx.backward, ctx.align, ctx.lanes = backward, align, lanes
        ctx.save_for_backward(*(t if k in reads else None for k, t in enumerate(inputs)))
        ctx.shapes = [None if k in reads or not isinstance(t, torch.Tensor) else torch.empty_like(t, device="meta")
                      for k, t in enumerate(inputs)]
        outs = ref(*inputs, align=align, lanes=lanes)
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        inputs = [t if shape is None else shape for t, shape in zip(ctx.saved_tensors, ctx.shapes)]
        found = ctx.backward(*grads, *inputs, align=ctx.align, lanes=ctx.lanes, needs=tuple(ctx.needs_input_grad[5:]))
        return (None, None, None, None, None, *found)


def chooser(gen: ModuleType, splice: CalledSplice) -> Callable[..., tuple]:
    ref = getattr(gen, splice.torch_fn)
    kernel = getattr(gen, splice.triton_fn) if splice.triton_fn else None
    closed = getattr(gen, splice.torch_backward) if splice.torch_backward else None
    reads, gives = frozenset(splice.torch_backward_reads), frozenset(splice.torch_backward_grads)
    fixed = {k: getattr(torch, dtype) for k, dtype in splice.fixed_inputs.items()}

    keeps: dict[tuple, bool] = {}  # per align, lanes and inputs needing grad: does the function keep FP32 tensors?

    def compute(inputs: list[torch.Tensor], align: frozenset[str], lanes: int = 0) -> tuple:
        if kernel is not None and _use_triton(inputs):
            return kernel(*inputs, align=align, lanes=lanes)  # its backward kernel recomputes from the saved inputs
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            if closed is not None and os.environ.get("GRAPHDIFF_CLOSED_FORM") != "0" and all(
                    k in gives for k, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad):
                outs = _ClosedForm.apply(ref, closed, reads, align, lanes, *inputs)
                return outs if isinstance(outs, tuple) else (outs,)
            # the PyTorch path keeps only its inputs too: where its autograd would keep FP32 intermediates (a
            # norm's), they are recomputed in the backward (same ops, same values); where it keeps next to nothing
            # of its own (RoPE's products save the cos/sin tables), it runs plainly, with no second forward
            key = (align, lanes, *(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs))
            if key not in keeps:
                keeps[key] = keeps_intermediates(ref, inputs, align, lanes)
            if keeps[key]:
                return torch.utils.checkpoint.checkpoint(ref, *inputs, align=align, lanes=lanes, use_reentrant=False)
        return ref(*inputs, align=align, lanes=lanes)

    def run(inputs: list[torch.Tensor], align: frozenset[str], lanes: int = 0) -> tuple:
        if fixed:  # a table made from positions, in the dtype the trace recorded whatever dtype promoted its op
            inputs = [t.to(fixed[k]) if k in fixed and isinstance(t, torch.Tensor) else t for k, t in enumerate(inputs)]
        outs = compute(inputs, align, lanes)
        if torch.is_grad_enabled():
            for j, o in enumerate(outs):
                if isinstance(o, torch.Tensor) and o.dtype == torch.float32 and o.requires_grad:
                    o._graphdiff_recompute = Recompute(  # type: ignore[attr-defined]  # an attribute of ours
                        compute, inputs, align, j, lanes)
        return outs

    return run


def module_forward(mod: torch.nn.Module, splice: ModuleSplice, run: Callable, align: frozenset[str],
                    lanes: int = 0) -> Callable:
    sig = inspect.signature(mod.forward)
    first = next(iter(sig.parameters))
    width = max(splice.outputs, default=0) + 1

    def argument(source: str, args: tuple, kwargs: dict) -> Any:
        """An input's value: "arg:0" the forward's first argument, "arg:NAME" its argument NAME (a rotary
        embedding's `position_ids`), "param:NAME" a module attribute."""
        if source.startswith("param:"):
            return getattr(mod, source.removeprefix("param:"))
        if source == "arg:0":
            return args[0] if args else kwargs[first]
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments[source.removeprefix("arg:")]

    def forward(*args: Any, **kwargs: Any) -> Any:
        outs = run([argument(s, args, kwargs) for s in splice.inputs], align, lanes)
        if width == 1:
            return outs[0]
        result: list[Any] = [None] * width  # a forward returning a tuple (a rotary embedding's cos, sin)
        for value, position in zip(outs, splice.outputs):
            result[position] = value
        return tuple(result)

    return eager(forward)


def function_replacement(original: Callable, splice: FunctionSplice, run: Callable, align: frozenset[str]) -> Callable:
    sig = inspect.signature(original)
    names = [s.removeprefix("arg:") for s in splice.inputs]
    width = max(splice.outputs) + 1

    def replacement(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        outs = run([bound.arguments[n] for n in names], align)
        result: list[Any] = [None] * width
        for value, position in zip(outs, splice.outputs):
            result[position] = value
        return tuple(result) if width > 1 else result[0]

    replacement.__wrapped__ = original  # type: ignore[attr-defined]  # a function attribute, as functools sets it
    replacement.__name__ = getattr(original, "__name__", "replacement")
    return eager(replacement, original)


def _dispatcher(key: str, original: Callable) -> Callable:
    """Stands in for the module-level function: inside a patched model's calling module it runs that model's
    replacement; anywhere else (another model in the process, patched or not) what that model needs. A call the
    replacement itself makes (an FP32 attention that calls torch's sdpa) runs the original."""

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        callers = _CALLERS.get() or {}
        replacement = callers.get(key)
        if replacement is None:
            return original(*args, **kwargs)
        token = _CALLERS.set({k: v for k, v in callers.items() if k != key})
        try:
            return replacement(*args, **kwargs)
        finally:
            _CALLERS.reset(token)

    dispatch.__wrapped__ = original  # type: ignore[attr-defined]  # a function attribute, as functools sets it
    dispatch.__name__ = getattr(original, "__name__", "dispatch")
    return eager(dispatch, original)


def calls_replacement(mod: torch.nn.Module, key: str, replacement: Callable) -> Callable[[], None]:
    """While `mod` runs forward (recomputation under gradient checkpointing included), the dispatcher of `key`
    calls `replacement`; returns the undo."""
    tokens: list[Token] = []

    def enter(module: torch.nn.Module, args: tuple) -> None:
        tokens.append(_CALLERS.set({**(_CALLERS.get() or {}), key: replacement}))

    def leave(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if tokens:
            _CALLERS.reset(tokens.pop())

    hooks = [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave, always_call=True)]
    def undo() -> None:
        for h in hooks:
            h.remove()

    return undo


def sdpa_calls(modules: Sequence[torch.nn.Module], replacement: Callable[[torch.nn.Module], Callable]
               ) -> Callable[[], None]:
    """While each of `modules` runs forward, the torch sdpa calls its own code makes (through
    `torch.nn.functional`, or a name its module bound it to) run `replacement(module)`; returns the undo."""
    state = State(Path(), [])
    owners = {torch.nn.functional.__name__: "scaled_dot_product_attention"}
    for mod in modules:  # a module that bound sdpa to a name of its own (`from torch.nn.functional import ...`)
        found = vars(sys.modules.get(type(mod).__module__) or ModuleType("none"))
        owners.update({type(mod).__module__: k for k, v in found.items() if v is _TORCH_SDPA})
    for owner, name in owners.items():
        swap_in(importlib.import_module(owner), name, TORCH_SDPA, state)
    for mod in modules:
        state.undo.append(calls_replacement(mod, TORCH_SDPA, replacement(mod)))

    def undo() -> None:
        for step in reversed(state.undo):
            step()

    return undo


def swap_in(owner: ModuleType, fn_name: str, key: str, state: State) -> Callable:
    """`owner.fn_name` replaced by the dispatcher of `key` (one per binding and process; the replacement is per
    model), undone when its last patched model is; returns the original."""
    binding = f"{owner.__name__}.{fn_name}"
    if binding not in _FUNCTIONS:
        _FUNCTIONS[binding] = (getattr(owner, fn_name), 0)
        setattr(owner, fn_name, _dispatcher(key, _FUNCTIONS[binding][0]))
    original, users = _FUNCTIONS[binding]
    _FUNCTIONS[binding] = (original, users + 1)
    state.undo.append(functools.partial(_unpatch, binding, owner, fn_name))
    return original


def _unpatch(key: str, owner: ModuleType, fn_name: str) -> None:
    original, users = _FUNCTIONS[key]
    if users <= 1:
        setattr(owner, fn_name, original)
        del _FUNCTIONS[key]
    else:
        _FUNCTIONS[key] = (original, users - 1)
