"""The registry of opaque engine ops (graphdiff.analysis.opaque.EXTERNS) against the installed engine's real kernels.

Marked `engine` (needs vLLM's compiled CPU ops, not a running engine): each real op (torch.ops._C.*, called the
way vLLM's CPU path calls it, custom ops enabled) on seeded BF16 inputs is compared bit for bit with candidate
torch references; the one the registry names must agree, a rounding-elsewhere candidate must not. `-s` prints
every candidate's bit-identical fraction.
"""

from __future__ import annotations

import math

import pytest
import torch

from graphdiff.analysis.opaque import extern_rule
from graphdiff.capture.cpu_kind import kernel_build, store_like, stores_truncate

pytestmark = [pytest.mark.engine, pytest.mark.kind]
vllm_ops = pytest.importorskip("vllm._custom_ops")  # loads the CPU extension: torch.ops._C.*
BUILD = kernel_build()  # which build of it: _C, or _C_AVX512 / _C_AVX2 on CPUs without AVX-512 BF16
BF16 = torch.bfloat16
F32 = torch.float32


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(BF16).contiguous(), b.to(BF16).contiguous()
    return float((a.view(torch.int16) == b.view(torch.int16)).float().mean())


def rb(values: torch.Tensor) -> torch.Tensor:
    """FP32 values stored in BF16 as the loaded ops build stores them (`_C`: nearest even; `_C_AVX512`, `_C_AVX2`,
    loaded on CPUs without AVX-512 BF16: truncated)."""
    return store_like(values, BUILD)


def seeded(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


# --- rms_norm ----------------------------------------------------------------------------------------

def _rms(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_candidates(x: torch.Tensor, w: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    x32 = x.float()
    n32 = x32 * _rms(x32, eps)
    return {
        # vLLM's IR native impl (vllm/ir/ops/layernorm.py:10) == HF Qwen/Llama RMSNorm: round before the weight
        "round_before_weight": (n32.to(BF16).float() * w.float()).to(BF16),
        # FP32 inside, one rounding at the output
        "fp32_inside": rb(n32 * w.float()),
    }


def run_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, eps)  # as vllm/kernels/vllm_c.py:43 calls it
    return out


# --- fused_add_rms_norm ------------------------------------------------------------------------------

def fused_add_candidates(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> dict[str, tuple]:
    s32 = x.float() + r.float()
    s16 = rb(s32)  # the residual the op writes
    out = {}
    for sname, s in (("norm_of_fp32_sum", s32), ("norm_of_bf16_sum", s16.float())):
        n32 = s * _rms(s, eps)
        out[f"{sname}+round_before_weight"] = ((n32.to(BF16).float() * w.float()).to(BF16), s16)
        out[f"{sname}+fp32_inside"] = (rb(n32 * w.float()), s16)
    # variance of the FP32 sum, applied to the BF16 sum the kernel stored into `residual` (read back)
    out["var_of_fp32_sum*bf16_sum+fp32_inside"] = (rb(s16.float() * _rms(s32, eps) * w.float()), s16)
    return out


def run_fused_add(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> tuple:
    x, r = x.clone(), r.clone()
    torch.ops._C.fused_add_rms_norm(x, r, w, eps)  # in place: x <- norm, r <- x + r (vllm_c.py:86)
    return x, r


# --- silu_and_mul ------------------------------------------------------------------------------------

def silu_candidates(x: torch.Tensor) -> dict[str, torch.Tensor]:
    d = x.shape[-1] // 2
    g, u = x[..., :d], x[..., d:]
    return {
        "fp32_inside": rb(torch.nn.functional.silu(g.float()) * u.float()),  # what Inductor's fusion does
        "round_silu": (torch.nn.functional.silu(g.float()).to(BF16).float() * u.float()).to(BF16),  # HF eager
        "sigmoid_bf16": ((g.float() * torch.sigmoid(g.float()).to(BF16).float()).to(BF16).float()
                         * u.float()).to(BF16),
    }


def run_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype)
    torch.ops._C.silu_and_mul(out, x)  # as SiluAndMul.forward_cuda (activation.py:146) calls it
    return out


# --- rotary_embedding --------------------------------------------------------------------------------

def cos_sin_cache(rot_dim: int, max_pos: int, base: float = 10000.0) -> torch.Tensor:
    """As RotaryEmbedding._compute_cos_sin_cache: FP32 [max_pos, rot_dim] = cat(cos, sin)."""
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=F32) / rot_dim))
    freqs = torch.einsum("i,j->ij", torch.arange(max_pos, dtype=F32), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def rope_candidates(pos: torch.Tensor, q: torch.Tensor, head: int, cache: torch.Tensor, neox: bool) -> dict:
    T = q.shape[0]
    x = q.view(T, -1, head)
    cs = cache.index_select(0, pos)
    cos, sin = cs.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]

    def join(o1: torch.Tensor, o2: torch.Tensor) -> torch.Tensor:
        o = torch.cat((o1, o2), -1) if neox else torch.stack((o1, o2), -1).flatten(-2)
        return o.reshape(q.shape)

    c32, s32, a, b = cos.float(), sin.float(), x1.float(), x2.float()
    # the interleaved (GPT-J) path stores to nearest even in every build; the NeoX path as the build stores
    store = rb if neox else (lambda t: t.to(BF16))
    r = lambda t: t.to(BF16).float()  # noqa: E731
    return {
        # vLLM native forward_static under Inductor (one fused kernel): FP32 inside, one rounding
        "fp32_inside": join(store(a * c32 - b * s32), store(b * c32 + a * s32)),
        # eager BF16 (vLLM forward_static in eager, HF apply_rotary_pos_emb): every product and the sum rounded
        "round_products": join(r(r(a * c32) - r(b * s32)).to(BF16), r(r(b * c32) + r(a * s32)).to(BF16)),
        # one fused multiply-add per output in FP32 (x1*cos + (-x2)*sin with fma)
        "fma": join(store(torch.addcmul(a * c32, -b, s32)), store(torch.addcmul(b * c32, a, s32))),
    }


def run_rotary(pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head: int, cache: torch.Tensor, neox: bool):
    q, k = q.clone(), k.clone()
    torch.ops._C.rotary_embedding(pos, q, k, head, cache, neox)  # in place (_custom_ops.py:221)
    return q, k


# --- the claim each test checks: the registry entry's candidate, and one that rounds elsewhere ----------------
REGISTRY = {
    "_C.rms_norm": {"equals": "fp32_inside", "not": "round_before_weight"},
    "_C.fused_add_rms_norm": {"equals": "var_of_fp32_sum*bf16_sum+fp32_inside", "residual": "bf16(x + r)",
                              "not": "norm_of_fp32_sum+round_before_weight"},
    "_C.gelu_and_mul": {"equals": "fp32_inside", "not": "round_gelu"},
    "_C.gelu_tanh_and_mul": {"equals": "fp32_inside", "not": "round_gelu"},
    "_C.silu_and_mul": {"equals": "fp32_inside", "not": "round_silu"},
    "_C.rotary_embedding": {"equals": "fp32_inside", "not": "round_products", "cache_dtype": "query dtype (bf16)"},
}


def test_every_claim_here_is_the_registrys():
    """The registry says FP32 inside (one rounding per output) exactly for the ops whose claim here is fp32_inside."""
    for op, claim in REGISTRY.items():
        rule = extern_rule(f"torch.ops.{op}.default")
        assert rule is not None, op
        assert rule.fp32_inside == (claim["equals"] == "fp32_inside"), op


@pytest.mark.parametrize("m", [1, 7, 64, 513])
def test_onednn_mm_equals_f_linear(m: int) -> None:
    """vLLM CPU's oneDNN GEMM (the extern every projection runs) rounds once, like F.linear, at any batch size."""
    if not getattr(vllm_ops, "_supports_onednn", False):
        pytest.skip("this vLLM CPU build has no oneDNN matmul")
    w, x = seeded(384, 256, seed=11, scale=0.08), seeded(m, 256, seed=12)
    try:
        handle = vllm_ops.create_onednn_mm(w.t(), 32)
        real = vllm_ops.onednn_mm(handle, x, None)
    except RuntimeError as e:  # oneDNN has no BF16 matmul for this CPU (and shape): the engine cannot run it either
        if "could not create a primitive descriptor" not in str(e):
            raise
        pytest.skip(f"oneDNN on this CPU ({BUILD}) has no BF16 matmul for {m} rows")
    # oneDNN capped below AVX-512 BF16 blocks the sum otherwise than ATen: a last-bit order flip in 10^5 outputs
    assert bits_equal(torch.nn.functional.linear(x, w), real) >= 0.9999
    assert bits_equal(store_like(x.float() @ w.float().t(), "_C_AVX512"), real) < 0.9  # it rounds, never truncates
    assert extern_rule("torch.ops._C.onednn_mm.default").fp32_inside


@pytest.mark.parametrize("m", [1, 16, 513, 2048])
@pytest.mark.parametrize("n", [8, 384])
def test_weight_packed_linear_equals_f_linear(m: int, n: int) -> None:
    """vLLM CPU's small-weight AMX GEMM (with an FP32 bias, as vLLM converts it) rounds once, like F.linear."""
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("weight_packed_linear runs only on CPUs with AMX tiles")
    torch.cpu._init_amx()
    w, x, b = seeded(n, 384, seed=13, scale=0.05), seeded(m, 384, seed=14), seeded(n, 1, seed=15, scale=0.1)[:, 0]
    packed = torch.ops._C.convert_weight_packed(w)
    for bias in (None, b):
        real = vllm_ops.weight_packed_linear_cpu(x, packed, n, None if bias is None else bias.float())
        want = torch.nn.functional.linear(x, w, bias)
        twice = (torch.nn.functional.linear(x, w).float() + b.float()).to(torch.bfloat16)  # rounded before the bias
        assert bits_equal(want, real) >= 0.999  # the rest: AMX's summation order
        if bias is not None:
            assert bits_equal(twice, real) < 0.95
    assert extern_rule("torch.ops._C.weight_packed_linear.default").fp32_inside


SHAPES = [(7, 256), (33, 4096), (5, 1000)]


# FP32 reductions (the variance) accumulate in the kernel's own order: a few last-bit flips in a large row
# are accumulation order, not a rounding location. The claimed candidate must reach EXACT, the refuted one
# must stay below REFUTED.
# A truncating build (`_C_AVX512`) flips at every BF16 boundary rather than at ties: order flips show a little more.
EXACT, REFUTED = (0.9998 if stores_truncate(BUILD) else 0.9999), 0.99


def _report(name: str, scores: dict[str, float]) -> None:
    print(f"\n{name}: " + ", ".join(f"{k} {v:.2%}" for k, v in scores.items()))


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape: tuple[int, int]) -> None:
    x, w = seeded(*shape, seed=1), seeded(shape[-1], seed=2, scale=0.5) + 1
    real = run_rms_norm(x, w, 1e-6)
    scores = {k: bits_equal(v, real) for k, v in rms_candidates(x, w, 1e-6).items()}
    _report(f"rms_norm {shape}", scores)
    claim = REGISTRY["_C.rms_norm"]
    assert scores[claim["equals"]] >= EXACT
    assert scores[claim["not"]] < REFUTED


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(shape: tuple[int, int]) -> None:
    x, r = seeded(*shape, seed=3), seeded(*shape, seed=4, scale=4.0)
    w = seeded(shape[-1], seed=5, scale=0.5) + 1
    out, res = run_fused_add(x, r, w, 1e-6)
    cands = fused_add_candidates(x, r, w, 1e-6)
    scores = {k: bits_equal(v[0], out) for k, v in cands.items()}
    res_score = bits_equal(next(iter(cands.values()))[1], res)
    _report(f"fused_add_rms_norm {shape} (residual written = bf16(x+r): {res_score:.2%}, dtype {res.dtype})", scores)
    assert res.dtype == BF16 and res_score == 1.0
    claim = REGISTRY["_C.fused_add_rms_norm"]
    assert scores[claim["equals"]] >= EXACT
    assert max(v for k, v in scores.items() if k != claim["equals"]) < scores[claim["equals"]] - 0.005


@pytest.mark.parametrize("shape", [(7, 512), (33, 2 * 11008), (5, 2000)])
def test_silu_and_mul(shape: tuple[int, int]) -> None:
    x = seeded(*shape, seed=6, scale=3.0)
    real = run_silu_and_mul(x)
    scores = {k: bits_equal(v, real) for k, v in silu_candidates(x).items()}
    _report(f"silu_and_mul {shape}", scores)
    claim = REGISTRY["_C.silu_and_mul"]
    assert scores[claim["equals"]] == 1.0
    assert scores[claim["not"]] < 1.0


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("cache_dtype", [BF16, F32])
@pytest.mark.parametrize("T,hq,hk,head", [(9, 4, 2, 64), (40, 8, 2, 128)])
def test_rotary_embedding(neox: bool, cache_dtype: torch.dtype, T: int, hq: int, hk: int, head: int) -> None:
    cache = cos_sin_cache(head, 4096).to(cache_dtype)
    pos = torch.arange(T, dtype=torch.int64) * 37 % 4096
    q, k = seeded(T, hq * head, seed=7, scale=2.0), seeded(T, hk * head, seed=8, scale=2.0)
    if cache_dtype != q.dtype:
        # the CPU kernel takes the cache in the query dtype only; vLLM casts it first
        # (RotaryEmbedding._match_cos_sin_cache_dtype, rotary_embedding/base.py:105): cos/sin are BF16 values
        with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
            run_rotary(pos, q, k, head, cache, neox)
        return
    rq, rk = run_rotary(pos, q, k, head, cache, neox)
    cq, ck = rope_candidates(pos, q, head, cache, neox), rope_candidates(pos, k, head, cache, neox)
    scores = {n: (bits_equal(cq[n], rq) * rq.numel() + bits_equal(ck[n], rk) * rk.numel()) / (rq.numel() + rk.numel())
              for n in cq}
    _report(f"rotary_embedding neox={neox} cache={cache_dtype} T={T} heads={hq}/{hk}x{head}", scores)
    claim = REGISTRY["_C.rotary_embedding"]
    assert scores[claim["equals"]] == 1.0 or scores["fma"] == 1.0
    assert scores[claim["not"]] < 1.0


def gelu_candidates(x: torch.Tensor, approximate: str) -> dict[str, torch.Tensor]:
    d = x.shape[-1] // 2
    g, u = x[..., :d].float(), x[..., d:].float()
    if approximate == "none":  # the kernel's formula; torch's FP32 F.gelu differs in the last ulp (97% equal)
        act = g * 0.5 * (1 + torch.erf(g * math.sqrt(0.5)))
    else:
        act = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g * g * g)))
    return {"fp32_inside": rb(act * u), "round_gelu": (act.to(BF16).float() * u).to(BF16),
            "torch_gelu_fp32": (torch.nn.functional.gelu(g, approximate=approximate) * u).to(BF16)}


@pytest.mark.parametrize("op,approximate", [("gelu_and_mul", "none"), ("gelu_tanh_and_mul", "tanh")])
def test_gelu_and_mul(op: str, approximate: str) -> None:
    x = seeded(17, 2 * 1000, seed=9, scale=3.0)
    out = torch.empty(17, 1000, dtype=BF16)
    getattr(torch.ops._C, op)(out, x)
    # Where 1 + erf(g / sqrt 2) cancels (g < -4: GELU below 3e-4) the kernel's vectorized erf (AVX-512 here) and
    # torch's differ in the tail; the rounding claim is judged on the rest (every element on an AVX2 build).
    body = x[:, :1000] > -4
    scores = {k: bits_equal(v[body], out[body]) for k, v in gelu_candidates(x, approximate).items()}
    _report(op, scores)
    claim = REGISTRY[f"_C.{op}"]
    # the kernel's vectorized tanh differs from torch's FP32 tanh in the last ulp on a few elements (99.98%)
    assert scores[claim["equals"]] >= (EXACT if op == "gelu_and_mul" else 0.999)
    assert scores[claim["not"]] < REFUTED


# --- cpu_fused_moe -----------------------------------------------------------------------------------

def _hf_like_experts(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts: every GEMM, the activation, each weighted output and each partial sum in BF16."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate_up = x[t:t + 1] @ w13[e].t()
            act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out[t:t + 1] += (act @ w2[e].t()) * weights[t, slot].to(BF16)
    return out


@pytest.mark.parametrize("tokens,experts,top_k", [(16, 4, 2), (33, 8, 2), (5, 8, 4)])
def test_cpu_fused_moe(tokens: int, experts: int, top_k: int) -> None:
    """vLLM CPU's fused MoE (`vec` ISA, the weights prepacked as its loader does) equals graphdiff.analysis.moe's engine
    computation, the source the patch carries, bit for bit; transformers' all-BF16 experts do not."""
    from graphdiff.analysis.moe_engine import moe_experts_like_engine

    hidden, inter = 64, 96  # multiples of the kernel's 32-wide output alignment
    w13 = seeded(experts, 2 * inter, hidden, seed=21, scale=hidden ** -0.5)
    w2 = seeded(experts, hidden, inter, seed=22, scale=inter ** -0.5)
    x = seeded(tokens, hidden, seed=23)
    values, ids = torch.topk(torch.randn(tokens, experts, generator=torch.Generator().manual_seed(24)), top_k)
    weights = torch.softmax(values, -1).float().contiguous()
    packed13, packed2 = torch.empty_like(w13), torch.empty_like(w2)
    torch.ops._C.prepack_moe_weight(w13, packed13, "vec")
    torch.ops._C.prepack_moe_weight(w2, packed2, "vec")
    real = torch.empty(tokens, hidden, dtype=BF16)
    torch.ops._C.cpu_fused_moe(real, x, packed13, packed2, None, None, weights, ids.to(torch.int32).contiguous(),
                               False, "silu", "vec")

    class Experts:
        gate_up_proj, down_proj, act_fn = w13, w2, torch.nn.functional.silu

    engine = bits_equal(moe_experts_like_engine(Experts, x, ids, weights), real)
    hf = bits_equal(_hf_like_experts(w13, w2, x, ids, weights), real)
    _report(f"cpu_fused_moe {tokens}x{experts} top-{top_k}", {"graphdiff.analysis.moe": engine, "all BF16 (HF)": hf})
    if stores_truncate(BUILD):  # it truncates its stores; analysis.moe rounds to nearest: the registry must refuse
        assert engine < 0.99 and extern_rule("torch.ops._C.cpu_fused_moe.default", BUILD) is None
        return
    assert engine == 1.0
    assert hf < 0.99
    assert not extern_rule("torch.ops._C.cpu_fused_moe.default").fp32_inside  # rounds the down GEMM's input
