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


# what a generated patch carries (their source), and the names its code calls them by
PATCH_PARTS = (ordered_sum, ordered_mean)
SUM_FN, MEAN_FN = ordered_sum.__name__, ordered_mean.__name__

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
    if 'extern "C"' not in code:
        return 0
    lanes: set[int] = set()
    for m in _ACC.finditer(code):
        if not _is_sum(code, m.group(2)):
            continue
        step = _STEP.search(code, m.end())
        if step is None:
            return 0
        lanes.add(int(step.group(1)))
    if len(lanes) != 1:
        return 0
    (n,) = lanes
    return n if n & (n - 1) == 0 else 0  # the halving tree needs a power of two


def is_row_reduction(node: Node, nodes: dict[str, Node]) -> bool:
    """`aten.sum.dim_IntList` / `aten.mean.dim` over its input's last dim only (what the emulation covers)."""
    args = node.call[0]
    if not node.target.endswith((".sum.dim_IntList", ".mean.dim")) or len(args) < 2 or not node.inputs:
        return False
    source = nodes.get(node.inputs[0])
    ndim = len(source.shape) if source is not None and source.shape else None
    dims = args[1]
    return ndim is not None and isinstance(dims, list) and len(dims) == 1 and dims[0] in (-1, ndim - 1)
