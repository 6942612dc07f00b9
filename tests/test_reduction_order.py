"""The engine kernels' row-sum order: read from recorded Inductor C++ code, emulated in PyTorch."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from graphdiff.replay.sum_order import cpp_sum_lanes, ordered_mean, ordered_sum

FIXTURE = Path(__file__).parent.parent / "fixtures" / "scans" / "tiny-qwen3" / "engine" / "capture.json"


def _sequential(x: torch.Tensor, lanes: int) -> torch.Tensor:
    """The order spelled out element by element: lane l sums x[l], x[l + lanes], ... one add at a time (FP32),
    then lanes are halved pairwise."""
    rows = []
    for row in x:
        acc = [torch.tensor(0.0) for _ in range(lanes)]
        for i, v in enumerate(row):
            acc[i % lanes] = acc[i % lanes] + v
        while len(acc) > 1:
            half = len(acc) // 2
            acc = [acc[i] + acc[i + half] for i in range(half)]
        rows.append(acc[0])
    return torch.stack(rows)


def test_ordered_sum_is_lanewise_chunks_then_a_halving_tree():
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ordered_sum(x, [-1], False, 32), _sequential(x, 32))
    assert ordered_sum(x, [-1], True, 16).shape == (6, 1)
    # a short last chunk adds zeros, exactly (Inductor's masked tail)
    y = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ordered_sum(y, [-1], False, 32), _sequential(y, 32))
    assert torch.equal(ordered_mean(y, [-1], True, 32), ordered_sum(y, [-1], True, 32) / 40)


def test_the_order_matters_in_the_last_bits():
    x = torch.randn(4096, 384, generator=torch.Generator().manual_seed(2)).pow(2)
    ours, aten = ordered_sum(x, [-1], False, 32), x.sum(-1)
    assert not torch.equal(ours, aten)  # ATen's cascade order differs on some rows ...
    assert torch.allclose(ours, aten, rtol=1e-6)  # ... in the last bits only


def test_lanes_are_read_from_the_recorded_kernels():
    """The recorded engine (tiny Qwen3, AVX512): norm kernels accumulate VectorizedN<float,2> (32 lanes), one of
    them Vectorized<float> (16 lanes), the SiLU kernel has no sum, externs have no code."""
    kernels = {k["id"]: k for g in json.loads(FIXTURE.read_text())["graphs"] for k in g["kernels"]}
    lanes = {kid: cpp_sum_lanes(k.get("code") or "") for kid, k in kernels.items()}
    norm = next(kid for kid in lanes if "rsqrt_0:" in kid)
    assert lanes[norm] == 32
    assert 16 in lanes.values()
    assert all(v == 0 for kid, v in lanes.items() if "silu" in kid or kernels[kid]["kind"] == "extern")


def test_a_scalar_tail_or_a_non_sum_accumulator_is_not_read_as_the_lane_order():
    code = next(k["code"] for g in json.loads(FIXTURE.read_text())["graphs"] for k in g["kernels"]
                if "rsqrt_0:" in k["id"])
    assert cpp_sum_lanes(code) == 32
    tail = code.replace("out_ptr0[static_cast<int64_t>(x0)] = static_cast<float>(tmp_acc0);",
                        "for(int64_t x1=256L; x1<260L; x1+=1L) { tmp_acc0 = tmp_acc0 + in_ptr2[x1]; }\n"
                        "out_ptr0[static_cast<int64_t>(x0)] = static_cast<float>(tmp_acc0);", 1)
    assert tail != code and cpp_sum_lanes(tail) == 0
    maximum = code.replace("tmp_acc0_vec = tmp_acc0_vec + tmp7;",
                           "tmp_acc0_vec = at::vec::maximum(tmp_acc0_vec, tmp7);")
    assert maximum != code and cpp_sum_lanes(maximum) == 0
    assert cpp_sum_lanes("def triton_kernel(): pass") == 0
