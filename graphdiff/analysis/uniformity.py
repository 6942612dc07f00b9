"""How non-uniformly FP32 values sit between their two neighbouring BF16 numbers.

Rounding to BF16 is unbiased on average only if values are spread evenly between the
representable numbers. A value's position is its place in that gap, 0..1:

    pos = (|x| - lo) / (hi - lo),  lo = |x| rounded toward zero to BF16,  hi = the next BF16 above lo

Magnitudes, because rounding is symmetric in sign: -x rounds to -(round(x)). A value that is
exactly a BF16 number has pos = 0 (lo = |x|). Round-to-nearest-even sends pos < 0.5 down and
pos > 0.5 up (in magnitude); pos = 0.5 is a tie. BF16 is FP32 with the low 16 mantissa bits
dropped, so within one binade (and across into the next: hi - lo is still one BF16 step) the
position is exactly those 16 bits / 65536 — computed from the bits, with no floating-point error.

Statistic (paper): the empirical characteristic function of the positions,
c_k = mean(exp(2πi k pos)), k = 1..16, and the RMS of |c_k|. Uniform positions give
E|c_k|² = 1/n, so the statistic of n uniform positions is about 1/sqrt(n); all positions equal
give |c_k| = 1 for every k, so 1. Positions spread evenly over m points j/m give |c_k| = 1 when
m divides k and 0 otherwise: sqrt(floor(16/m) / 16).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import torch

KMAX = 16
_LOW_BITS = 1 << 16  # FP32 mantissa bits that BF16 drops
_CHUNK = 1 << 18


def positions(x: torch.Tensor) -> torch.Tensor:
    """Each finite FP32 value's position between its neighbouring BF16 numbers, in [0, 1) (float64)."""
    if x.dtype != torch.float32:
        raise TypeError(f"positions are defined for FP32 values, got {x.dtype}")
    x = x.detach().flatten()
    x = x[torch.isfinite(x)]
    low = x.view(torch.int32) & (_LOW_BITS - 1)  # the sign bit is not among them: magnitude for free
    return low.to(torch.float64) / _LOW_BITS


def fourier_coefficients(pos: torch.Tensor, kmax: int = KMAX) -> torch.Tensor:
    """c_k = mean(exp(2πi k pos)) for k = 1..kmax (complex128)."""
    if pos.numel() == 0:
        raise ValueError("no positions")
    k = torch.arange(1, kmax + 1, dtype=torch.float64)
    pos = pos.to(torch.float64).flatten()
    re, im = torch.zeros(kmax, dtype=torch.float64), torch.zeros(kmax, dtype=torch.float64)
    for chunk in pos.split(_CHUNK):  # bounded memory for activations with millions of values
        phase = 2 * math.pi * torch.outer(k, chunk)
        re += torch.cos(phase).sum(1)
        im += torch.sin(phase).sum(1)
    return torch.complex(re, im) / pos.numel()


def nonuniformity_of_positions(pos: torch.Tensor, kmax: int = KMAX) -> float:
    """RMS over k = 1..kmax of |c_k|: 0 for perfectly spread positions, 1 when all are equal."""
    c = fourier_coefficients(pos, kmax)
    return float(c.abs().pow(2).mean().sqrt())


@dataclass
class Uniformity:
    value: float  # the statistic
    n: int  # finite values measured
    exact_fraction: float  # values that already were BF16 numbers (pos = 0, no rounding error)
    uniform_level: float  # 1/sqrt(n): what uniform positions of this count give, the noise floor


def nonuniformity(x: torch.Tensor, kmax: int = KMAX, drop_exact: bool = False) -> Uniformity:
    """The statistic for FP32 values `x` that are about to be rounded to BF16.

    `drop_exact` leaves out values that are BF16 numbers already (they are not rounded at all;
    a tensor that was upcast from BF16 is all exact and would read as fully clustered).
    """
    pos = positions(x)
    exact = float((pos == 0).double().mean()) if pos.numel() else 0.0
    if drop_exact:
        pos = pos[pos != 0]
    if pos.numel() == 0:
        raise ValueError("no finite (non-exact) values to measure")
    return Uniformity(nonuniformity_of_positions(pos, kmax), pos.numel(), exact, 1 / math.sqrt(pos.numel()))


def histogram(pos: torch.Tensor, bins: int = 32) -> list[int]:
    """Counts of positions in `bins` equal bins over [0, 1), for plots."""
    idx = (pos.to(torch.float64) * bins).floor().clamp(0, bins - 1).long()
    return torch.bincount(idx, minlength=bins).tolist()


def median_over_layers(per_layer: Iterable[float]) -> float:
    """The paper's summary: one statistic per layer (same site), the median across layers."""
    values = list(per_layer)
    if not values:
        raise ValueError("no layers")
    return float(statistics.median(values))
