"""The carry splice's hooks (the residual stream in FP32): the layer's incoming activation upcast, or rounded for its
own ops and FP32 for the named children, its rounded residual sums, held copies and scaled child outputs.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from graphdiff.records import (
    CarrySplice,
    layer_of,
)
from graphdiff.runtime.manifest import PatchError
from graphdiff.runtime.state import State


def _child(mod: torch.nn.Module, child: str, splice: CarrySplice) -> torch.nn.Module:
    try:
        return mod.get_submodule(child)
    except AttributeError:
        raise PatchError(f"{type(mod).__name__} has no child module {child!r} (carry splice {splice.key})") from None


def round_sums(gen: ModuleType, splice: CarrySplice, name: str, mod: torch.nn.Module, state: State) -> None:
    """The hooks that round the layer's own residual sums of the named children's outputs where the engine stores
    them in BF16 (`rounded_sums` for this layer), or have its later adds read them rounded (`stored_sums`)."""
    children = [(c, stored) for stored, sums in ((False, splice.rounded_sums), (True, splice.stored_sums))
                for c, layers in sums.items() if layer_of(name) in layers]
    if not children:
        return
    for child, stored in children:
        hook = functools.partial(gen.carry_sum_output, mod, stored)
        state.undo.append(_child(mod, child, splice).register_forward_hook(hook).remove)
    state.undo.append(mod.register_forward_pre_hook(gen.carry_round_sums).remove)
    state.undo.append(mod.register_forward_hook(gen.carry_sums_done, always_call=True).remove)


def carry_hooks(gen: ModuleType, splice: CarrySplice, mod: torch.nn.Module, state: State) -> None:
    """The carry hooks on one module: its incoming activation in FP32 (carry_fp32); or rounded for the module's
    own ops and FP32 for the named children (carry_fp32_rounded: a piecewise engine's BF16 graph boundary)."""
    for child in splice.fp32_outputs:  # a scaled or summed child output, computed in FP32
        state.undo.append(_child(mod, child, splice).register_forward_hook(gen.carry_fp32_output).remove)
    _scaled(gen, splice, mod, state)
    if splice.torch_fn == "carry_scaled":  # the module's own ops only scale a child's output: its input stays
        return
    if splice.torch_fn != "carry_fp32_rounded":
        state.undo.append(mod.register_forward_pre_hook(gen.carry_fp32, with_kwargs=True).remove)
        _held(gen, splice, mod, state)
        return
    for child in splice.fp32_children:
        sub = _child(mod, child, splice)
        state.undo.append(sub.register_forward_pre_hook(functools.partial(gen.carry_fp32_child, mod)).remove)
    state.undo.append(mod.register_forward_pre_hook(gen.carry_fp32_rounded, with_kwargs=True).remove)
    state.undo.append(mod.register_forward_hook(gen.carry_done).remove)
    state.undo.append(lambda: mod.__dict__.pop("_graphdiff_carry", None))


def _held(gen: ModuleType, splice: CarrySplice, mod: torch.nn.Module, state: State) -> None:
    """The hooks that hand the named children the stored BF16 copy of the module's FP32 incoming activation
    (`rounded_children`)."""
    if not splice.rounded_children:
        return
    for child in splice.rounded_children:
        hook = functools.partial(gen.carry_rounded_child, mod)
        state.undo.append(_child(mod, child, splice).register_forward_pre_hook(hook, with_kwargs=True).remove)
    state.undo.append(mod.register_forward_pre_hook(gen.carry_hold, with_kwargs=True).remove)
    state.undo.append(mod.register_forward_hook(gen.carry_release, always_call=True).remove)
    state.undo.append(lambda: mod.__dict__.pop("_graphdiff_held", None))


def _scaled(gen: ModuleType, splice: CarrySplice, mod: torch.nn.Module, state: State) -> None:
    """The hooks that hand a child's output, scaled by the module's own code, to the children reading it in FP32
    (`fp32_scaled`: the scaled embedding into the first decoder layer)."""
    if not splice.fp32_scaled:
        return
    for source, readers in splice.fp32_scaled.items():
        hook = functools.partial(gen.carry_scaled_source, mod)
        state.undo.append(_child(mod, source, splice).register_forward_hook(hook).remove)
        for reader in readers:  # before the reader's own carry hook, which copies its input
            hook = functools.partial(gen.carry_scaled_reader, mod)
            state.undo.append(_child(mod, reader, splice).register_forward_pre_hook(hook, with_kwargs=True,
                                                                                    prepend=True).remove)
    state.undo.append(mod.register_forward_pre_hook(gen.carry_scaled_start).remove)
    state.undo.append(mod.register_forward_hook(gen.carry_scaled_done, always_call=True).remove)
    state.undo.append(lambda: gen._scaled_end(mod))
