"""A capture's real kernel buffers (in memory, and DIR/buffers.pt), and progress messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:  # the kernel buffer records hold tensors; the data model itself needs no torch
    import torch


class WeightRef(TypedDict):
    """A large recorded kernel input, in buffers.pt, that the checkpoint holds under `weight` (resolved on load)."""

    weight: str
    shape: list[int]
    dtype: str  # "torch.bfloat16"


class _ExternCall(TypedDict):
    buffer: str  # the all-reduce's buffer in its graph
    partial: torch.Tensor  # the BF16 partial product it reduced (this rank's)
    reduced: torch.Tensor  # its output


class ExternRecord(_ExternCall, total=False):
    """A tensor-parallel all-reduce's recorded call (engines.vllm.tp_worker.extern_records)."""

    matmul: str  # kernel id of the matmul that wrote the partial
    matmul_input: torch.Tensor  # that matmul's input


# "in" is a keyword: the functional form. Written by capture.inductor_hooks.BufferRecorder, read by the replay.
_KernelCall = TypedDict("_KernelCall", {
    "in": "dict[str, torch.Tensor]",  # buffer -> the value it held before the call (loaded weights included)
    "out": "dict[str, torch.Tensor]",  # buffer -> the value the call stored
    "scalars": "dict[str, object]",  # non-tensor arguments (symbol values, sizes) by name
})


class KernelRecord(_KernelCall, total=False):
    """One kernel call's real buffers in a recorded forward."""

    extern: ExternRecord  # tensor-parallel capture: an all-reduce's call
    launch: dict[str, int]  # a Triton call's block sizes (XBLOCK, R0_BLOCK), where the recording knows them


Buffers = dict[str, dict[str, KernelRecord]]  # shape label -> kernel id -> that forward's record of the call
Progress = Callable[[str], None]  # a long step's one-line messages ("engine: compiling ...")
