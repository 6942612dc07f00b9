"""What a carry splice runs in the trainer: hooks on a layer that hold its incoming activation as the engine does.

`carry_fp32` (every patch carries it) keeps the residual stream FP32 across layers, `carry_fp32_output` a child's
output FP32 where the layer scales, sums or gates it before its own add; `carry_fp32_rounded`,
`carry_fp32_child` and `carry_done` (ROUNDED_PARTS, carried where a region needs them) hold it as a piecewise
engine does at a graph boundary; `carry_hold`, `carry_rounded_child` and `carry_release` (HELD_PARTS) hand children
the stored BF16 copy of an activation the module's own code reads in FP32; `RoundedSums` and its hooks (SUM_PARTS)
round the layer's own residual sums where the engine stores them in BF16; `ScaledOutputs` and its hooks
(SCALED_PARTS) hand a child's output, scaled by the module's own code, to the child modules that read it in FP32 (a
scaled embedding into the first layer). The generated module carries their source (prelude.source); the runtime
registers them by these names.
"""

from __future__ import annotations

import torch


def carry_fp32(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the incoming activation in FP32, so eager type promotion keeps the residual sum
    in FP32 across layers (the engine re-sums it in FP32 inside its norm kernels)."""
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        return (args[0].float(), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"].float()}
    return args, kwargs


def carry_fp32_output(module: torch.nn.Module, args: tuple, output: object) -> object:
    """Forward hook: the module's output (a tensor, or a tuple's first) in FP32, so its parent's own code scales (or
    gates) it and adds it in FP32, as the engine's fused kernel does."""
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        return output.float()
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (output[0].float(), *output[1:])
    return output


def carry_fp32_rounded(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the incoming activation as a piecewise engine holds it. The engine stores the residual
    stream in bfloat16 where it is live across a graph split (attention), so the module's own ops (the residual
    add) read it rounded (held in FP32: the sum stays FP32, as in the engine's kernel); the child modules named in
    the manifest read the FP32 value (the norm, inside the graph that computed it: carry_fp32_child)."""
    x = args[0] if args else kwargs.get("hidden_states")
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        return args, kwargs
    full = x.float()
    rounded = full.to(torch.bfloat16).float()
    module.__dict__["_graphdiff_carry"] = (rounded, full)
    return ((rounded, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": rounded})


def carry_fp32_child(parent: torch.nn.Module, child: torch.nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook of a child module that reads the parent's incoming activation in FP32: the unrounded value
    in place of the rounded one the parent's code passes it."""
    state = parent.__dict__.get("_graphdiff_carry")
    if state is not None and args and args[0] is state[0]:
        return (state[1], *args[1:])
    return None


def carry_done(module: torch.nn.Module, args: tuple, output: object) -> None:
    """Forward hook: drop the parent's references to its input."""
    module.__dict__.pop("_graphdiff_carry", None)


ROUNDED_PARTS = (carry_fp32_rounded, carry_fp32_child, carry_done)


def carry_hold(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook, after carry_fp32: keep the incoming FP32 activation for the children that read its stored
    copy (carry_rounded_child)."""
    module.__dict__["_graphdiff_held"] = args[0] if args else kwargs.get("hidden_states")


def carry_rounded_child(parent: torch.nn.Module, child: torch.nn.Module, args: tuple, kwargs: dict
                        ) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a child module that reads the parent's incoming activation as the engine's stored BF16
    copy while the parent's own code reads it in FP32 (OLMo 2's attention projections beside its residual add)."""
    held = parent.__dict__.get("_graphdiff_held")
    if not isinstance(held, torch.Tensor):
        return None
    if args and args[0] is held:
        return (held.to(torch.bfloat16), *args[1:]), kwargs
    named = next((k for k, v in kwargs.items() if v is held), None)
    return (args, {**kwargs, named: held.to(torch.bfloat16)}) if named is not None else None


def carry_release(module: torch.nn.Module, args: tuple, output: object) -> None:
    """Forward hook: drop the parent's reference to its input."""
    module.__dict__.pop("_graphdiff_held", None)


HELD_PARTS = (carry_hold, carry_rounded_child, carry_release)


class RoundedSums(torch.overrides.TorchFunctionMode):
    """Active while a carried layer runs, for the residual adds of its own code, named by the child output they sum.
    An add reading one of `outputs` (child outputs the patch may hold in FP32, a post-norm's) returns its sum in
    bfloat16, as the engine stores it; eager type promotion would keep it FP32 into the next add and the next layer.
    An add reading one of `stored_from` keeps its sum, but later adds read that sum rounded: the engine's norm
    beside it read the FP32 sum in the kernel computing it, the kernels after it load the BF16 copy it stored. A named
    output scaled by a constant (`hidden_states * residual_multiplier`) is named with it, and a view of a stored sum
    is that sum (OPT's `residual = hidden_states.reshape(-1, hidden)` before its second add)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []
        self.stored_from: list[torch.Tensor] = []
        self.stored: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if func in (torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul):
            out = func(*args, **(kwargs or {}))  # a named child's output scaled by a constant: its sum is the same add
            if sum(isinstance(a, torch.Tensor) for a in args) == 1:
                for named in (self.outputs, self.stored_from):
                    if any(a is o for a in args for o in named):
                        named.append(out)
            return out
        if func in (torch.Tensor.reshape, torch.Tensor.view, torch.reshape) and args:
            out = func(*args, **(kwargs or {}))
            if any(args[0] is s for s in self.stored):
                self.stored.append(out)
            return out
        if func not in (torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.add):
            return func(*args, **(kwargs or {}))
        args = tuple(a.to(torch.bfloat16).to(a.dtype) if any(a is s for s in self.stored) else a for a in args)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and any(a is o for a in args for o in self.outputs):
            return out.to(torch.bfloat16)
        if isinstance(out, torch.Tensor) and any(a is o for a in args for o in self.stored_from):
            self.stored.append(out)
        return out


def carry_round_sums(module: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook of the layer: its residual sums of the named children's outputs are rounded while it runs."""
    mode = RoundedSums()
    module.__dict__["_graphdiff_sums"] = mode
    mode.__enter__()


def carry_sum_output(parent: torch.nn.Module, stored: bool, child: torch.nn.Module, args: tuple,
                     output: object) -> None:
    """Forward hook of a named child: its output is one the parent's residual add sums, rounded by the engine
    (or, `stored`, kept for the norm and read rounded by the later adds)."""
    mode = parent.__dict__.get("_graphdiff_sums")
    value = output[0] if isinstance(output, tuple) and output else output
    if mode is not None and isinstance(value, torch.Tensor):
        (mode.stored_from if stored else mode.outputs).append(value)


def carry_sums_done(module: torch.nn.Module, args: tuple, output: object) -> None:
    """Forward hook of the layer (also when its forward raises): leave the mode, drop the references."""
    mode = module.__dict__.pop("_graphdiff_sums", None)
    if mode is not None:
        mode.__exit__(None, None, None)


SUM_PARTS = (RoundedSums, carry_round_sums, carry_sum_output, carry_sums_done)


class ScaledOutputs(torch.overrides.TorchFunctionMode):
    """Active from a named child's output to the first child module that reads the module's own constant scale of it
    (`inputs_embeds * embedding_multiplier`, read by the first decoder layer): the scale is computed as the trainer
    does, the value every other reader gets (a rotary embedding reading its dtype), and once more in FP32, the value
    the engine's kernel hands on unrounded (`scaled`: rounded, full)."""

    def __init__(self, source: torch.Tensor) -> None:
        super().__init__()
        self.source = source
        self.scaled: tuple[torch.Tensor, torch.Tensor] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        if (self.scaled is None and isinstance(out, torch.Tensor)
                and func in (torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul)
                and any(a is self.source for a in args)):
            full = func(*(a.float() if a is self.source else a for a in args), **(kwargs or {}))
            self.scaled = (out, full)
        return out


def carry_scaled_start(parent: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook of the parent: its forward runs (the child called elsewhere, `get_input_embeddings()(ids)`,
    is left alone)."""
    parent.__dict__["_graphdiff_scaling"] = True


def carry_scaled_source(parent: torch.nn.Module, child: torch.nn.Module, args: tuple, output: object) -> None:
    """Forward hook of the child whose output the parent scales: watch the parent's code for that scale."""
    if (parent.__dict__.pop("_graphdiff_scaling", False) and isinstance(output, torch.Tensor)
            and output.is_floating_point() and "_graphdiff_scaled" not in parent.__dict__):
        mode = ScaledOutputs(output)
        parent.__dict__["_graphdiff_scaled"] = mode
        mode.__enter__()


def _scaled_end(parent: torch.nn.Module) -> ScaledOutputs | None:
    parent.__dict__.pop("_graphdiff_scaling", None)
    mode = parent.__dict__.pop("_graphdiff_scaled", None)
    if mode is not None:
        mode.__exit__(None, None, None)
    return mode


def carry_scaled_reader(parent: torch.nn.Module, child: torch.nn.Module, args: tuple, kwargs: dict
                        ) -> tuple[tuple, dict]:
    """Forward pre-hook of a child module reading the scaled output: the FP32 product in place of the rounded one."""
    mode = _scaled_end(parent)
    if mode is None or mode.scaled is None:
        return args, kwargs
    rounded, full = mode.scaled
    if args and args[0] is rounded:
        return (full, *args[1:]), kwargs
    if kwargs.get("hidden_states") is rounded:
        return args, {**kwargs, "hidden_states": full}
    return args, kwargs


def carry_scaled_done(parent: torch.nn.Module, args: tuple, output: object) -> None:
    """Forward hook of the parent (also when its forward raises): leave the mode if no reader did."""
    _scaled_end(parent)


SCALED_PARTS = (ScaledOutputs, carry_scaled_start, carry_scaled_source, _scaled_end, carry_scaled_reader,
                carry_scaled_done)
