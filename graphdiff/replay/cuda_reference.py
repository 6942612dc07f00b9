"""What vLLM's CUDA kernels compute, in torch on any device: one reference per CUDA registry entry.

Each function is written from the kernel's source and rounds where that kernel rounds (`bf16` marks each
rounding). BF16 arithmetic on `c10::BFloat16` / `__nv_bfloat16` (`a * b`, `a + b`, `__hmul2`, `__hadd2`) is the
exact FP32 result rounded once to nearest even, which is what `bf16(a.float() op b.float())` computes. The kernels'
FP32 reductions (cub block sums, MMA accumulators) add in another order, and their `expf` / `rsqrtf` may differ from
torch's by an ulp: equal placement of the roundings, not bit-exact FP32 internals.
"""

from __future__ import annotations

import math

import torch

BF16 = torch.bfloat16


def bf16(x: torch.Tensor) -> torch.Tensor:
    """FP32 values rounded to BF16 (nearest even), kept in FP32."""
    return x.float().to(BF16).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM csrc/layernorm_kernels.cu `rms_norm_kernel`: FP32 variance, `(scalar_t)(x * s_variance)` stored in BF16
    before the BF16 weight multiply, which rounds again."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (bf16(x32 * rstd) * weight.float()).to(BF16)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM csrc/layernorm_kernels.cu `fused_add_rms_norm_kernel` (the `_f16Vec` width-8 path and the generic one):
    the residual added in BF16 (`__hadd2`), the variance of that rounded sum, then as `rms_norm`. Returns (out, the
    new residual)."""
    s = (x.float() + residual.float()).to(BF16)
    return rms_norm(s, weight, eps), s


def _act_and_mul(x: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """`act_and_mul_kernel`: the activation stored in BF16 (`(T)(...)`), then the BF16 product `ACT_FN(x) * y`."""
    d = x.shape[-1] // 2
    return (bf16(act) * x[..., d:].float()).to(BF16)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """vLLM csrc/activation_kernels.cu `silu_kernel`: `x / (1 + expf(-x))` in FP32, rounded, times the up half."""
    g = x[..., : x.shape[-1] // 2].float()
    return _act_and_mul(x, g / (1.0 + torch.exp(-g)))


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """vLLM csrc/activation_kernels.cu `gelu_kernel`: `f * 0.5 * (1 + erf(f * M_SQRT1_2))`, rounded, times up."""
    g = x[..., : x.shape[-1] // 2].float()
    return _act_and_mul(x, g * 0.5 * (1.0 + torch.erf(g * math.sqrt(0.5))))


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """vLLM csrc/activation_kernels.cu `gelu_tanh_kernel`: `0.5 * f * (1 + tanhf(BETA * (f + KAPPA * f^3)))`,
    rounded, times up."""
    g = x[..., : x.shape[-1] // 2].float()
    inner = (math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5) * (g + 0.044715 * (g * g * g))
    return _act_and_mul(x, 0.5 * g * (1.0 + torch.tanh(inner)))


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor,
                     is_neox: bool, fp32_math: bool = False) -> torch.Tensor:
    """vLLM csrc/pos_encoding_kernels.cu on `x` [tokens, heads * head_size] (the query or the key), returned.

    `fp32_math=False`: the kernel that computes in `scalar_t` (vLLM's `apply_rotary_embedding` with `scalar_t cos,
    sin`): the cache in the activation dtype, `x * cos - y * sin` in BF16, each product and the sum rounded.
    `fp32_math=True`: the later kernel (`cos_f`, `x_f`, `static_cast<scalar_t>(x_f * cos_f - y_f * sin_f)`): FP32
    from the cache's values, rounded once."""
    t = x.shape[0]
    h = x.reshape(t, -1, head_size).float()
    cache = cos_sin_cache.index_select(0, positions.reshape(-1)).to(x.dtype).float()
    rot = cache.shape[-1]
    cos, sin = cache[:, None, : rot // 2], cache[:, None, rot // 2:]
    a, b = (h[..., : rot // 2], h[..., rot // 2: rot]) if is_neox else (h[..., 0:rot:2], h[..., 1:rot:2])
    if fp32_math:
        o1, o2 = bf16(a * cos - b * sin), bf16(b * cos + a * sin)
    else:
        o1, o2 = bf16(bf16(a * cos) - bf16(b * sin)), bf16(bf16(b * cos) + bf16(a * sin))
    out = h.clone()
    if is_neox:
        out[..., : rot // 2], out[..., rot // 2: rot] = o1, o2
    else:
        out[..., 0:rot:2], out[..., 1:rot:2] = o1, o2
    return out.to(x.dtype).reshape(x.shape)


def attention_p_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True,
                     block_n: int | None = None, rowsum_of_rounded: bool = False) -> torch.Tensor:
    """Flash attention as FlashAttention, FlashInfer and vLLM's Triton attention compute it: q [heads, T, D], k/v
    [heads, S, D] (KV heads already repeated for GQA). Scores and the online softmax in FP32 over blocks of `block_n`
    keys (None: one block); each block's probabilities exp(s - running max) cast to BF16 for the P@V MMA, FP32
    accumulation rescaled as the max moves; the output divided by the row sum at the end, rounded once. The row sum
    adds the FP32 probabilities (FlashAttention, Triton), or the rounded ones (`rowsum_of_rounded`: FlashInfer sums
    its BF16 P fragments with an MMA)."""
    s = q.float() @ k.float().transpose(-1, -2) * scale
    n_q, n_k = s.shape[-2], s.shape[-1]
    if causal:  # query i sees the keys up to its own position, the queries being the last T of S
        keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    step = block_n or n_k
    m = torch.full(s.shape[:-1], float("-inf"))
    row = torch.zeros(s.shape[:-1])
    acc = torch.zeros(*s.shape[:-1], v.shape[-1])
    for start in range(0, n_k, step):
        block = s[..., start:start + step]
        m_new = torch.maximum(m, block.amax(-1))
        alpha = torch.exp(m - m_new).nan_to_num(0.0)  # a row with no key seen yet has nothing to rescale
        p = torch.exp(block - m_new[..., None]).nan_to_num(0.0)
        p16 = bf16(p)
        row = row * alpha + (p16 if rowsum_of_rounded else p).sum(-1)
        acc = acc * alpha[..., None] + p16 @ v[..., start:start + step, :].float()
        m = m_new
    return (acc / row[..., None]).to(v.dtype)


def cublas_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """cuBLAS BF16 GEMM (`F.linear`) with `allow_bf16_reduced_precision_reduction` off: FP32 accumulation, the bias
    added in FP32 (cuBLASLt epilogue), the result rounded once. With the flag on (torch's default) cuBLAS may split K
    and round partial sums to BF16: no reference."""
    out = x.float() @ weight.float().t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def custom_allreduce(partials: list[torch.Tensor]) -> torch.Tensor:
    """vLLM csrc/custom_all_reduce.cuh `packed_reduce`: each rank's BF16 partial upcast and summed in FP32 in rank
    order, rounded once."""
    total = partials[0].float()
    for p in partials[1:]:
        total = total + p.float()
    return total.to(partials[0].dtype)


def nccl_allreduce(partials: list[torch.Tensor], order: list[int] | None = None) -> torch.Tensor:
    """NCCL's BF16 sum (`FuncSum` on `__nv_bfloat16`): each step of the ring adds one rank's partial in BF16, rounding
    every addition; `order` is the ranks in the order the ring adds them (per chunk in a real ring; rank order if
    None). For two ranks this is bf16(a + b), as `custom_allreduce`."""
    ranks = order if order is not None else list(range(len(partials)))
    total = partials[ranks[0]].float()
    for r in ranks[1:]:
        total = bf16(total + partials[r].float())
    return total.to(partials[0].dtype)


def flashinfer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True,
                         block_n: int | None = None) -> torch.Tensor:
    """FlashInfer's prefill attention (`attention_p_bf16` whose row sum adds the BF16 P it multiplies V by)."""
    return attention_p_bf16(q, k, v, scale, causal, block_n, rowsum_of_rounded=True)
