"""The order in which an engine kernel sums a row, read from its code, and that order in PyTorch.

FP32 addition is not associative, so a row sum computed in another order differs in its last bits, and a
value rounded to BF16 after it (a norm's output) flips where it sits near a tie: not a rounding location, but
the same kind of one-sided difference. Inductor's C++ kernels (`at::vec`) sum a row in `lanes` lane-wise
partial sums (`VectorizedN<float,N>` accumulators, one chunk of `lanes` elements after another; a masked tail
adds zeros), then combine the lanes by halving (`vec_reduce_all`: the two vectors of a VectorizedN, then the
shuffle tree i+8, i+4, i+2, i+1). ATen's `sum` and `mean` use their own (cascade) order. On the recorded
norm kernels of a CPU engine the emulation below equals the kernel's stored FP32 sums on every row (the scan's
replay evidence: `KernelEvidence.reduction_lanes`, `aten_order_bitexact`).

A generated patch carries the source of `ordered_sum` and `ordered_mean` (PATCH_PARTS), so the patch and the
scan's replay run one code.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from graphdiff.records import Node


def ordered_sum(x: torch.Tensor, dims: list[int], keepdim: bool, lanes: int) -> torch.Tensor:
    """Sum over the last dim as an engine kernel does: `lanes` partial sums over consecutive chunks (a short
    last chunk padded with zeros, which adds exactly), then the lanes halved pairwise down to one."""
    d = x.shape[-1]
    pad = -d % lanes
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    chunks = x.reshape(*x.shape[:-1], -1, lanes)
    acc = chunks[..., 0, :]
    for i in range(1, chunks.shape[-2]):
        acc = acc + chunks[..., i, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc if keepdim else acc[..., 0]


def ordered_mean(x: torch.Tensor, dims: list[int], keepdim: bool, lanes: int) -> torch.Tensor:
    """Mean over the last dim: the engine kernel's ordered sum, divided by the row length."""
    return ordered_sum(x, dims, keepdim, lanes) / x.shape[-1]


def ordered_layer_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                       bias: torch.Tensor | None, eps: float, lanes: int,
                       stored: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """`native_layer_norm` over the last dim as an Inductor kernel computes it in two passes of ordered row sums
    (the mean, then the squared deviations), `1 / std::sqrt(var + eps)`, then `(x - mean) * rstd * w + b`; returns
    (output, mean, rstd) as the ATen op does. The kernel's `1 / std::sqrt` is built with fast math (an approximate
    reciprocal square root refined), which eager `rsqrt` equals on every row; an exact `1 / sqrt` differs on ~15%.
    `stored`: the dtype the input is stored in. The kernel sums the mean in the loop that computes the input (a
    fused residual add: the FP32 sum the patch carries) and reads it back from that store in the later passes."""
    mean = ordered_sum(x, [-1], True, lanes) / x.shape[-1]
    if stored is not None:
        x = x.to(stored).to(x.dtype)
    centered = x - mean
    rstd = torch.rsqrt(ordered_sum(centered * centered, [-1], True, lanes) / x.shape[-1] + eps)
    out = centered * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, mean, rstd


def ordered_op(name: str, args: tuple | list, lanes: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A row sum, mean or layer norm (an `is_row_op` node's op and arguments) in an engine kernel's order."""
    if name == "native_layer_norm":
        x, shape, weight, bias, eps = args[:5]
        return ordered_layer_norm(x, shape, weight, bias, eps, lanes)
    fn = ordered_mean if name == "mean" else ordered_sum
    return fn(args[0], args[1], bool(args[2]) if len(args) > 2 else False, lanes)


# what a generated patch carries (their source), and the names its code calls them by
PATCH_PARTS = (ordered_sum, ordered_mean, ordered_layer_norm)
SUM_FN, MEAN_FN, LAYER_NORM_FN = ordered_sum.__name__, ordered_mean.__name__, ordered_layer_norm.__name__

# An accumulator of a vectorized sum: `at::vec::VectorizedN<float,2> tmp_acc0_vec = ...(0);` (or Vectorized<float>)
_ACC = re.compile(r"at::vec::Vectorized(?:N<float,\s*(\d+)>|<float>)\s+(tmp_acc\d+)_vec\s*=")
_STEP = re.compile(r"for\s*\([^;]*;[^;]*;\s*\w+\s*\+=\s*static_cast<int64_t>\((\d+)L?\)\)")


def _is_sum(code: str, acc: str) -> bool:
    """The accumulator adds (a plain or masked-tail sum), and no scalar loop adds into its scalar twin: a scalar
    tail would sum in another order."""
    vec = re.escape(acc + "_vec")
    adds = re.search(rf"{vec}\s*=\s*(?:{vec}\s*\+|sum_masked_reduce\(\s*{vec})", code)
    scalar_tail = re.search(rf"\b{re.escape(acc)}\s*=\s*{re.escape(acc)}\s*\+(?!\s*at::vec::vec_reduce_all)", code)
    return adds is not None and scalar_tail is None and "vec_reduce_all" in code


def cpp_sum_lanes(code: str) -> int:
    """The lane count of the row sums an Inductor C++ kernel computes (0: none, or not one recognized form).

    The lanes are the step of the loop the accumulator is declared before (elements per vectorized iteration);
    every sum accumulator of the kernel must agree."""
    lanes = set(cpp_sum_lanes_each(code))
    return next(iter(lanes)) if len(lanes) == 1 else 0


def cpp_sum_lanes_each(code: str) -> list[int]:
    """The lanes of each sum accumulator of an Inductor C++ kernel, in code order (a kernel holding two norms may
    sum one in 32 lanes, the next in 16); other accumulators (a max, a sum with a scalar tail) are not listed, and
    [] where a sum's loop step is not found."""
    if 'extern "C"' not in code:
        return []
    lanes: list[int] = []
    for m in _ACC.finditer(code):
        if not _is_sum(code, m.group(2)):
            continue
        step = _STEP.search(code, m.end())
        if step is None:
            return []
        n = int(step.group(1))
        if n & (n - 1):  # the halving tree needs a power of two
            return []
        lanes.append(n)
    return lanes


_TRITON_R0_BLOCK = re.compile(r"^\s*R0_BLOCK\s*:\s*tl\.constexpr\s*=\s*(\d+)\s*$", re.M)


def triton_sum_lanes(code: str) -> int:
    """The block an Inductor Triton persistent reduction sums a row over (its `R0_BLOCK`, the whole row padded
    with zeros to a power of two), summed as a halving tree: `ordered_sum` with that many lanes (0: not a Triton
    kernel, no `tl.sum`, or a looped reduction, whose R0_BLOCK is chosen at launch).

    The halving tree is the order of a warp's butterfly shuffle with one element of the row per thread (and the
    order `replay.triton_kernels` runs `tl.sum` in); a GPU thread holding several elements adds them first."""
    if "@triton.jit" not in code or "tl.sum(" not in code:
        return 0
    blocks = {int(m.group(1)) for m in _TRITON_R0_BLOCK.finditer(code)}
    n = next(iter(blocks)) if len(blocks) == 1 else 0
    return n if n and not n & (n - 1) else 0


_BF16_OUT = re.compile(r"at::BFloat16\*\s+((?:in_)?out_ptr\d+)")


def cpp_rereads_store(code: str) -> bool:
    """Does an Inductor C++ row kernel store a BF16 buffer and read it back in a later loop (a fused residual add
    stored as the layer's output, its norm's later passes reading the stored copy, its first pass the FP32 sum)?"""
    for m in _BF16_OUT.finditer(code):
        ptr = re.escape(m.group(1))
        store = re.search(rf"\.store\({ptr}\b", code)
        if store is not None and re.search(rf"loadu\({ptr}\b", code[store.end():]):
            return True
    return False


def is_row_reduction(node: Node, nodes: dict[str, Node]) -> bool:
    """`aten.sum.dim_IntList` / `aten.mean.dim` over its input's last dim only (what the emulation covers)."""
    args = node.call[0]
    if not node.target.endswith((".sum.dim_IntList", ".mean.dim")) or len(args) < 2 or not node.inputs:
        return False
    source = nodes.get(node.inputs[0])
    ndim = len(source.shape) if source is not None and source.shape else None
    dims = args[1]
    return ndim is not None and isinstance(dims, list) and len(dims) == 1 and dims[0] in (-1, ndim - 1)


def is_row_norm(node: Node) -> bool:
    """`aten.native_layer_norm` over the last dim only (what `ordered_layer_norm` computes)."""
    args = node.call[0]
    return node.target.endswith(".native_layer_norm.default") and len(args) >= 5 \
        and isinstance(args[1], list) and len(args[1]) == 1


def is_row_op(node: Node, nodes: dict[str, Node]) -> bool:
    """A node an engine kernel computes with ordered row sums: a row sum/mean, or a layer norm over the last dim."""
    return is_row_reduction(node, nodes) or is_row_norm(node)
