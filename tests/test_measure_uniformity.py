"""Rounding positions between BF16 neighbours and the Fourier non-uniformity statistic."""

from __future__ import annotations

import math

import pytest
import torch

from graphdiff.analysis.uniformity import (
    fourier_coefficients,
    histogram,
    median_over_layers,
    nonuniformity,
    nonuniformity_of_positions,
    positions,
)


def _truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    return (x.view(torch.int32) & ~0xFFFF).view(torch.float32)


def test_positions_of_known_values():
    step = 2.0**-7  # BF16 spacing in [1, 2)
    x = torch.tensor([1.0, 1 + step / 2, 1 + step / 4, -(1 + step / 4), 0.0, 3.009, 2 - 2.0**-23], dtype=torch.float32)
    pos = positions(x)
    assert pos[:5].tolist() == [0.0, 0.5, 0.25, 0.25, 0.0]  # exact values and zero sit at 0; sign is ignored
    lo, hi = 3.0, 3.015625  # the paper's example: 3.009 lies between these BF16 numbers ([2,4): step 2^-6)
    x32 = torch.tensor(3.009, dtype=torch.float32).item()  # the FP32 value nearest 3.009
    assert pos[5].item() == (x32 - lo) / (hi - lo)  # exact: both sides are dyadic rationals
    assert pos[6].item() == 65535 / 65536  # the last FP32 value below 2: its upper neighbour is 2, next binade


def test_positions_predict_round_to_nearest_even():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 6, 100_000)
    pos = positions(x)
    lo = _truncate_to_bf16(x.abs())
    hi = (lo.view(torch.int32) + 0x10000).view(torch.float32)
    rounded = x.abs().bfloat16().float()
    assert torch.equal(rounded[pos < 0.5], lo[pos < 0.5])
    assert torch.equal(rounded[pos > 0.5], hi[pos > 0.5])
    assert torch.allclose(((x.abs().double() - lo.double()) / (hi.double() - lo.double())), pos)


def test_positions_skip_non_finite_and_reject_other_dtypes():
    assert positions(torch.tensor([1.0, float("inf"), float("nan")])).tolist() == [0.0]
    with pytest.raises(TypeError):
        positions(torch.ones(3, dtype=torch.bfloat16))


@pytest.mark.parametrize("value", [0.0, 0.5, 0.123])
def test_all_positions_equal_give_one(value):
    pos = torch.full((1000,), value, dtype=torch.float64)
    c = fourier_coefficients(pos)
    assert torch.allclose(c.abs(), torch.ones(16, dtype=torch.float64))
    if value == 0.5:  # c_k = exp(i pi k) = (-1)^k
        assert torch.allclose(c.real, torch.tensor([(-1.0) ** k for k in range(1, 17)], dtype=torch.float64))
    assert nonuniformity_of_positions(pos) == pytest.approx(1.0)


@pytest.mark.parametrize("m", [2, 3, 4, 5, 16, 17])
def test_positions_on_an_m_point_lattice(m):
    # |c_k| = 1 when m divides k, else 0: the statistic is sqrt(floor(16/m) / 16).
    pos = torch.arange(m, dtype=torch.float64).repeat(50) / m
    expected = math.sqrt((16 // m) / 16)
    assert nonuniformity_of_positions(pos) == pytest.approx(expected, abs=1e-12)


def test_uniform_positions_scale_like_one_over_sqrt_n():
    gen = torch.Generator().manual_seed(1)
    stats = {}
    for n in (1_000, 10_000, 100_000):
        u = nonuniformity(torch.randn(n, generator=gen))
        assert u.n == n and u.uniform_level == pytest.approx(1 / math.sqrt(n))
        assert 0.6 < u.value * math.sqrt(n) < 1.5
        stats[n] = u.value
    assert 5.0 < stats[1_000] / stats[100_000] < 20.0  # sqrt(100) = 10


def test_sums_of_bf16_numbers_cluster():
    # A residual-stream-like sum of two BF16 numbers has few significant bits below BF16's last one.
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(50_000, generator=gen).bfloat16().float()
    b = (0.1 * torch.randn(50_000, generator=gen)).bfloat16().float()
    clustered = nonuniformity(a + b)
    assert clustered.value > 20 * clustered.uniform_level
    silu = nonuniformity(torch.nn.functional.silu(torch.randn(50_000, generator=gen)))
    assert silu.value < 3 * silu.uniform_level  # an FP32 SiLU of FP32 inputs: positions spread evenly


def test_exact_values_can_be_left_out():
    x = torch.cat([torch.randn(1000).bfloat16().float(), torch.randn(3000)])
    with_exact = nonuniformity(x)
    without = nonuniformity(x, drop_exact=True)
    assert with_exact.exact_fraction == pytest.approx(0.25, abs=0.01)
    assert without.n < x.numel() and without.value < with_exact.value
    with pytest.raises(ValueError):
        nonuniformity(torch.ones(10), drop_exact=True)


def test_histogram_and_median():
    pos = torch.tensor([0.0, 0.49, 0.5, 0.99], dtype=torch.float64)
    assert histogram(pos, bins=2) == [2, 2]
    assert median_over_layers([0.3, 0.01, 0.2]) == 0.2
    with pytest.raises(ValueError):
        median_over_layers([])
