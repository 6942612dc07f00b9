"""The registry of opaque ops keyed by (op, device, build): CUDA references against step-by-step BF16 arithmetic on
the CPU, each differing from the CPU entry of the same name; lookups never cross devices; a capture with no device
recorded looks up the CPU entries as before. The tests against the real CUDA ops skip without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from graphdiff.analysis.opaque import EXTERNS, RULES, attention_rule, engine_rule, extern_rule, unregistered_why
from graphdiff.capture.cpu_kind import stores_truncate
from graphdiff.records import MATMUL_REDUCED_FACT
from graphdiff.replay import cuda_reference as cuda

BF16 = torch.bfloat16
CUDA_ENGINE = {"backend": "FLASH_ATTN", "device": "cuda", "build": "_C", MATMUL_REDUCED_FACT: "false"}
OLD_CPU_ENGINE = {"backend": "CPU_ATTN", "impl": "CPUAttentionBackendImpl", "isa": "vec"}  # no device recorded
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def seeded(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def r(x: torch.Tensor | float) -> torch.Tensor:
    """One rounding to BF16, kept in FP32."""
    return torch.as_tensor(x, dtype=torch.float32).to(BF16).float()


# --- the CUDA references, step by step, and not the CPU entry's computation -----------------------------------

def test_cuda_rms_norm_rounds_x_times_rstd_before_the_weight() -> None:
    x, w = torch.tensor([[1.0, 4.0]], dtype=BF16), torch.tensor([1.375, 1.375], dtype=BF16)
    # mean square 8.5, rstd = 0.342997; x * rstd = [0.342997, 1.371989] -> BF16 [0.34375, 1.375];
    # times 1.375: [0.47265625, 1.890625], exact in BF16
    assert cuda.rms_norm(x, w, 0.0).float().tolist() == [[0.47265625, 1.890625]]
    # the CPU entry (FP32 inside): 0.342997 * 1.375 = 0.471621 -> 0.470703125; 1.886485 -> 1.8828125
    cpu = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)) * w.float()).to(BF16)
    assert cpu.float().tolist() == [[0.470703125, 1.8828125]]


def test_cuda_fused_add_rms_norm_takes_the_variance_of_the_rounded_sum() -> None:
    x, res, w, eps = seeded(8, 256, seed=1), seeded(8, 256, seed=2, scale=4.0), seeded(256, seed=3), 1e-6
    out, new_res = cuda.fused_add_rms_norm(x, res, w, eps)
    s = r(x.float() + res.float())  # __hadd2: the BF16 sum, written back as the residual
    n = r(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))  # `temp *= s_variance`, stored in BF16
    assert torch.equal(new_res.float(), s)
    assert torch.equal(out.float(), r(n * w.float()))  # `temp *= weight`: the BF16 product
    s32 = x.float() + res.float()  # the CPU entry: the FP32 sum's variance applied to the BF16 sum, FP32 inside
    cpu = (s * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(BF16)
    assert (cpu != out).any()


@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"])
def test_cuda_act_and_mul_rounds_the_activation_before_the_product(name: str) -> None:
    x = seeded(16, 512, seed=4, scale=2.0)
    g, u = x[:, :256].float(), x[:, 256:].float()
    act = {"silu_and_mul": g / (1.0 + torch.exp(-g)),
           "gelu_and_mul": g * 0.5 * (1.0 + torch.erf(g * (1.0 / math.sqrt(2.0)))),
           "gelu_tanh_and_mul": 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))}[name]
    out = getattr(cuda, name)(x)
    assert torch.equal(out.float(), r(r(act) * u))
    assert (out != (act * u).to(BF16)).any()  # the CPU entry: FP32 inside, rounded once


def test_cuda_silu_and_mul_by_hand() -> None:
    # silu(-2) = -2 / (1 + e^2) = -0.238406 -> BF16 -0.23828125 (ulp 2^-10); times 5 = -1.19140625, a tie between
    # -1.1875 and -1.1953125 (ulp 2^-7): even, -1.1875. FP32 inside: -1.192029 -> -1.1953125
    x = torch.tensor([[-2.0, 5.0]], dtype=BF16)
    assert cuda.silu_and_mul(x).item() == -1.1875
    assert (torch.nn.functional.silu(x[:, :1].float()) * 5.0).to(BF16).item() == -1.1953125


@pytest.mark.parametrize("neox", [True, False])
def test_cuda_rotary_computes_in_the_activation_dtype(neox: bool) -> None:
    t, heads, head, rot = 5, 2, 8, 8
    q = seeded(t, heads * head, seed=5)
    pos = torch.tensor([0, 3, 17, 100, 511])
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.arange(512, dtype=torch.float32)[:, None] * inv[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), -1)
    out = cuda.rotary_embedding(pos, q, head, cache, neox).float().view(t, heads, head)
    qf = q.float().view(t, heads, head)
    c16 = cache.to(BF16).float()  # forward_cuda casts the cache to the query dtype
    for ti in range(t):
        for h in range(heads):
            for i in range(rot // 2):
                xi, yi = (i, i + rot // 2) if neox else (2 * i, 2 * i + 1)
                c, s = c16[pos[ti], i], c16[pos[ti], rot // 2 + i]
                x, y = qf[ti, h, xi], qf[ti, h, yi]
                assert out[ti, h, xi] == r(r(x * c) - r(y * s)) and out[ti, h, yi] == r(r(y * c) + r(x * s))
    fp32 = cuda.rotary_embedding(pos, q, head, cache, neox, fp32_math=True)  # as the CPU entry: one rounding
    assert (fp32.float().view(t, heads, head) != out).any()


def test_cuda_attention_rounds_p_before_pv_by_hand() -> None:
    # one query, two keys, head size 1, scale 1: s = [0, ln 3]; P = exp(s - max) = [1/3, 1] -> BF16 [0.333984375, 1]
    q = torch.ones(1, 1, 1, dtype=BF16)
    k = torch.tensor([[[0.0], [1.0]]], dtype=BF16)
    v = torch.tensor([[[1.0], [0.0]]], dtype=BF16)
    scale = math.log(3.0) / float(torch.tensor(1.0, dtype=BF16))
    p = torch.exp(torch.tensor([0.0, scale]) - scale)
    fa = cuda.attention_p_bf16(q, k, v, scale, causal=False)
    assert fa.item() == r(r(p[0]) * 1.0 / p.sum()).item()  # P rounded, the row sum of the FP32 P
    fi = cuda.flashinfer_attention(q, k, v, scale, causal=False)
    assert fi.item() == r(r(p[0]) / (r(p[0]) + r(p[1]))).item()  # the row sum of the rounded P


def test_cuda_attention_differs_from_the_cpu_vec_kernel() -> None:
    q, k, v = seeded(2, 16, 64, seed=6), seeded(2, 16, 64, seed=7), seeded(2, 16, 64, seed=8)
    scale = 64 ** -0.5
    fa = cuda.attention_p_bf16(q, k, v, scale)
    # CPU_ATTN vec: P in FP32, sdpa on FP32-upcast inputs rounded once
    vec = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                           scale=scale).to(BF16)
    assert (fa != vec).any() and (fa.float() - vec.float()).abs().max() < 0.05
    assert torch.equal(cuda.attention_p_bf16(q, k, v, scale, block_n=16), fa)  # one block: the same computation


def test_cuda_gemm_and_allreduce() -> None:
    x, w, b = seeded(7, 64, seed=9), seeded(32, 64, seed=10), seeded(32, seed=11)
    assert torch.equal(cuda.cublas_gemm(x, w, b), (x.float() @ w.float().t() + b.float()).to(BF16))
    a = [torch.tensor([1.0], dtype=BF16), torch.tensor([2.0 ** -8], dtype=BF16), torch.tensor([2.0 ** -8], dtype=BF16)]
    assert cuda.custom_allreduce(a).item() == 1.0 + 2.0 ** -7  # FP32 sum, rounded once
    assert cuda.nccl_allreduce(a).item() == 1.0  # 1 + 2^-8 ties to even, twice
    two = [seeded(64, seed=12), seeded(64, seed=13)]
    assert torch.equal(cuda.custom_allreduce(two), cuda.nccl_allreduce(two))


# --- the registry's key ----------------------------------------------------------------------------------

def test_every_entry_names_its_device_and_library() -> None:
    for rule in (*EXTERNS, *RULES):
        devices = getattr(rule, "devices", None) or (rule.device,)  # type: ignore[union-attr]
        assert set(devices) <= {"cpu", "cuda"} and devices and rule.library, rule
    for rule in EXTERNS:
        if rule.devices == ("cuda",):
            assert rule.reference is not None, rule.op
    assert all(rule.reference is not None for rule in RULES if rule.device == "cuda")


def test_a_cpu_entry_never_decides_a_cuda_op_nor_the_reverse() -> None:
    for rule in EXTERNS:
        name = f"torch.ops.{rule.op}.default"
        on_cuda = extern_rule(name, "_C", "cuda", CUDA_ENGINE)
        on_cpu = extern_rule(name, "", "cpu")
        assert on_cuda is None or "cuda" in on_cuda.devices, rule.op
        assert on_cpu is None or "cpu" in on_cpu.devices, rule.op
    rms_cpu, rms_cuda = extern_rule("torch.ops._C.rms_norm.default"), engine_rule("_C.rms_norm", CUDA_ENGINE)
    assert rms_cpu is not None and rms_cuda is not None and rms_cpu is not rms_cuda
    assert rms_cpu.fp32_inside and not rms_cuda.fp32_inside


def test_a_cuda_op_with_no_cuda_entry_is_unregistered_and_named() -> None:
    for op in ("torch.ops._C.cpu_fused_moe.default", "torch.ops._C.onednn_mm.default",
               "torch.ops._C.shm_allreduce.default"):
        assert engine_rule(op, CUDA_ENGINE) is None
        assert unregistered_why(op, CUDA_ENGINE) == "no cuda entry (described for cpu only)"
    assert engine_rule("torch.ops.vllm.all_reduce.default", {"device": "cpu"}) is None
    assert engine_rule("torch.ops.vllm.all_reduce.default", CUDA_ENGINE) is not None


def test_cublas_is_described_only_with_reduced_precision_reduction_off() -> None:
    assert engine_rule("extern_kernels.mm", CUDA_ENGINE) is not None
    on = {**CUDA_ENGINE, MATMUL_REDUCED_FACT: "true"}
    unknown = {k: v for k, v in CUDA_ENGINE.items() if k != MATMUL_REDUCED_FACT}
    assert engine_rule("extern_kernels.mm", on) is None and engine_rule("extern_kernels.mm", unknown) is None
    assert "=true" in unregistered_why("extern_kernels.mm", on)
    assert "=nothing" in unregistered_why("extern_kernels.mm", unknown)


def test_attention_rules_are_keyed_by_device() -> None:
    for backend in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        rule = attention_rule({"backend": backend, "device": "cuda"})
        assert rule is not None and not rule.probabilities_fp32 and rule.reference is not None
        assert attention_rule({"backend": backend}) is None  # no device recorded: a CPU capture
    assert attention_rule({"backend": "CPU_ATTN", "isa": "vec", "device": "cuda"}) is None


def test_a_capture_with_no_device_looks_up_the_cpu_entries_as_before() -> None:
    assert attention_rule(OLD_CPU_ENGINE) is attention_rule({**OLD_CPU_ENGINE, "device": "cpu"}) is RULES[0]
    for rule in EXTERNS:
        if "cpu" not in rule.devices:
            continue
        name = f"torch.ops.{rule.op}.default"
        assert engine_rule(name, OLD_CPU_ENGINE) is extern_rule(name) is extern_rule(name, "", "cpu")
        for build in ("_C", "_C_AVX512", "_C_AVX2"):
            old = {**OLD_CPU_ENGINE, "build": build}
            assert engine_rule(name, old) is engine_rule(name, {**old, "device": "cpu"}) is extern_rule(name, build)
    # the `_C` claims that assume rounding to nearest hold on `_C` only, as before the key had a device
    assert extern_rule("torch.ops._C.rms_norm.default", "_C_AVX512") is None
    assert extern_rule("torch.ops._C.shm_allreduce.default", "_C_AVX512") is not None


def test_the_engine_facts_name_the_device() -> None:
    from graphdiff.engines.vllm.start import kernel_facts

    facts = kernel_facts("cuda")
    assert "cpu" not in facts and facts[MATMUL_REDUCED_FACT] in ("true", "false")
    assert MATMUL_REDUCED_FACT not in kernel_facts("cpu")
    assert not stores_truncate("_C_AVX512", "cuda") and stores_truncate("_C_AVX512")


# --- against the real CUDA ops (vLLM's CUDA build) -------------------------------------------------------

def _same(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu().to(BF16).view(torch.int16) == b.cpu().to(BF16).view(torch.int16)).float().mean())


@gpu
def test_real_cuda_norm_and_activation_ops_match_their_references() -> None:
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C on a CUDA build)

    x, res, w = seeded(64, 1024, seed=21), seeded(64, 1024, seed=22, scale=4.0), seeded(1024, seed=23)
    out = torch.empty_like(x.cuda())
    torch.ops._C.rms_norm(out, x.cuda(), w.cuda(), 1e-6)
    assert _same(out, cuda.rms_norm(x, w, 1e-6)) >= 0.999
    xi, ri = x.cuda().clone(), res.cuda().clone()
    torch.ops._C.fused_add_rms_norm(xi, ri, w.cuda(), 1e-6)
    ref, ref_res = cuda.fused_add_rms_norm(x, res, w, 1e-6)
    assert _same(ri, ref_res) == 1.0 and _same(xi, ref) >= 0.999
    gu = seeded(64, 2048, seed=24, scale=2.0)
    for name in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"):
        o = torch.empty(64, 1024, dtype=BF16, device="cuda")
        getattr(torch.ops._C, name)(o, gu.cuda())
        assert _same(o, getattr(cuda, name)(gu)) >= 0.999, name


@gpu
def test_real_cuda_rotary_matches_one_of_its_references() -> None:
    import vllm._custom_ops as ops

    t, heads, head = 32, 4, 64
    q, k = seeded(t, heads * head, seed=25), seeded(t, heads * head, seed=26)
    pos = torch.arange(t) * 7
    inv = 1.0 / (10000.0 ** (torch.arange(0, head, 2, dtype=torch.float32) / head))
    freqs = torch.arange(512, dtype=torch.float32)[:, None] * inv[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), -1).to(BF16)
    qc, kc = q.cuda().clone(), k.cuda().clone()
    ops.rotary_embedding(pos.cuda(), qc, kc, head, cache.cuda(), True)
    same = max(_same(qc, cuda.rotary_embedding(pos, q, head, cache, True, fp32_math=m)) for m in (False, True))
    assert same >= 0.999


@gpu
def test_real_flash_attention_rounds_p() -> None:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    q, k, v = seeded(256, 4, 64, seed=27), seeded(256, 4, 64, seed=28), seeded(256, 4, 64, seed=29)
    cu = torch.tensor([0, 256], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q.cuda(), k.cuda(), v.cuda(), max_seqlen_q=256, cu_seqlens_q=cu, max_seqlen_k=256,
                                 cu_seqlens_k=cu, softmax_scale=0.125, causal=True)
    ref = cuda.attention_p_bf16(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0.125, block_n=128)
    vec = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                                           v.transpose(0, 1).float(), is_causal=True, scale=0.125)
    got = out.transpose(0, 1)
    assert _same(got, ref) > _same(got, vec.to(BF16))
