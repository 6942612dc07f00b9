"""What autograd keeps of a patched model: an FP32 output of a splice that a later op saves is stored as a recipe
(`Recompute`) and recomputed in the backward (`saved_fp32_recomputed`); `keeps_intermediates` probes whether a
splice's PyTorch path keeps activation-sized tensors of its own (then it runs under checkpointing).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch


def keeps_intermediates(ref: Callable, inputs: list[torch.Tensor], align: frozenset[str], lanes: int) -> bool:
    """Does `ref`, run with autograd, save for its backward a tensor of its own (not an input) at least half as large
    as its largest input (an activation, not a cos/sin table or a per-row statistic)? Found by running it once on its
    inputs detached (needing grad where they do), the saved tensors watched and let go."""
    probe = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]
    own = {t.untyped_storage().data_ptr() for t in probe if isinstance(t, torch.Tensor)}
    largest = max((t.numel() for t in probe if isinstance(t, torch.Tensor)), default=0)
    kept = []

    def pack(t: torch.Tensor) -> None:
        if t.untyped_storage().data_ptr() not in own and 2 * t.numel() >= largest:
            kept.append(t.shape)

    def unpack(_: Any) -> torch.Tensor:
        raise AssertionError("the probe runs no backward")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        ref(*probe, align=align, lanes=lanes)
    return bool(kept)


class Recompute:
    """How an FP32 output of a splice is recomputed when a later op saves it for the backward (instead of keeping
    the FP32 activation): from the splice's inputs, which its own backward keeps anyway."""

    def __init__(self, compute: Callable, inputs: list[torch.Tensor], align: frozenset[str], index: int,
                 lanes: int = 0) -> None:
        self.compute, self.inputs, self.align, self.index, self.lanes = compute, inputs, align, index, lanes
        self.versions = [t._version if isinstance(t, torch.Tensor) else None for t in inputs]

    def __call__(self) -> torch.Tensor:
        if any(isinstance(t, torch.Tensor) and t._version != v for t, v in zip(self.inputs, self.versions)):
            raise RuntimeError("graphdiff: an input of a patched module was modified in place after the forward; "
                               "its FP32 output cannot be recomputed for the backward")
        with torch.no_grad():
            return self.compute(self.inputs, self.align, self.lanes)[self.index]


def _outer_saved_tensors_hooks() -> tuple[Callable | None, Callable | None]:
    """The saved-tensor hooks active now (torch's private accessor; none where it is missing)."""
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    except (AttributeError, TypeError):
        top = None
    return top if top else (None, None)


def _warn_compiled() -> None:
    """Once per process (the default warning filter shows a warning once per place)."""
    warnings.warn("graphdiff: a patched model under torch.compile runs its splices eagerly (the forward's values are "
                  "the eager patch's, bit for bit), but Inductor differentiates the model's other ops in its own order:"
                  " the gradients differ from the eager patched model's", stacklevel=2)


def saved_fp32_recomputed(model: torch.nn.Module) -> Callable[[], None]:
    """While `model` runs forward, a saved tensor that is a splice's FP32 output is stored as its recipe
    (`Recompute`); any other goes to the saved-tensor hooks that were active (e.g. CPU offloading), if any."""
    stack: list[Any] = []

    def enter(module: torch.nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            _warn_compiled()
        outer_pack, outer_unpack = _outer_saved_tensors_hooks()

        def pack(t: torch.Tensor) -> Any:
            recipe = getattr(t, "_graphdiff_recompute", None)
            if recipe is not None:
                return recipe
            return outer_pack(t) if outer_pack else t

        def unpack(x: Any) -> torch.Tensor:
            if isinstance(x, Recompute):
                return x()
            return outer_unpack(x) if outer_unpack else x

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        ctx.__enter__()
        stack.append(ctx)

    def leave(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if stack:
            stack.pop().__exit__(None, None, None)

    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]

    def undo() -> None:
        for h in hooks:
            h.remove()

    return undo
