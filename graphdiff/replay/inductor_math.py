"""Transcendental ops the way Inductor's C++ kernels compute them, for replaying those kernels.

ATen's eager FP32 tanh/exp/log/sin/cos/erf/sqrt/expm1 on the CPU and Inductor's C++ codegen
(`at::vec::Vectorized<float>::tanh()`, SLEEF) differ in the last bit on 0.3-60% of elements; a 1-ulp difference
of tanh near -1 becomes a BF16 flip after 0.5*x*(1+tanh), so GELU-tanh kernels replayed with eager ops agree on
99.93-99.96% only. Replaying a C++ kernel, these ops run as a one-op function compiled by Inductor itself
(one compile per op per process, dynamic shapes, flattened input: the vectorized path with a masked tail, as in
the engine's kernels). Other ops agree bit for bit with eager (rsqrt, reciprocal, pow, sigmoid).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

INDUCTOR_MATH = frozenset({"tanh", "exp", "log", "sin", "cos", "erf", "sqrt", "expm1"})


@functools.cache
def _compiled(op: str) -> Callable[[torch.Tensor], torch.Tensor]:
    fn = getattr(torch, op)
    return torch.compile(lambda t: fn(t), backend="inductor", dynamic=True, fullgraph=True)


def inductor_unary(op: str, x: torch.Tensor) -> torch.Tensor:
    """`op(x)` as an Inductor C++ kernel computes it (FP32 in, FP32 out)."""
    flat = x.contiguous().reshape(-1)
    if flat.numel() < 2:  # dynamic=True specializes 0/1-element inputs; pad to keep the vector path
        return _compiled(op)(torch.cat([flat, flat.new_zeros(2 - flat.numel())]))[: x.numel()].reshape(x.shape)
    return _compiled(op)(flat).reshape(x.shape)
