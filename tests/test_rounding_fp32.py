"""The trainer's FP32 re-run of a matmul with a large operand, upcast a block at a time."""

from __future__ import annotations

import torch

from graphdiff import rounding


def test_a_large_matmul_is_rerun_in_fp32_blockwise_with_the_same_result(monkeypatch) -> None:
    torch.manual_seed(0)
    a, b = torch.randn(5, 64).bfloat16(), torch.randn(64, 1000).bfloat16()
    whole = a.float() @ b.float()
    monkeypatch.setattr(rounding, "FP32_CHUNK", 64 * 96)  # 96 columns at a time: 11 blocks, the last one short
    got = rounding.mm_fp32_chunked(a, b)
    assert got.dtype == torch.float32 and got.shape == whole.shape
    assert torch.allclose(got, whole, rtol=1e-6, atol=1e-6)
