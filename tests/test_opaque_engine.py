"""The registry of opaque engine kernels (graphdiff.analysis.opaque) against the installed engine's real kernel.

Marked `engine` (needs vLLM's compiled CPU ops, not a running engine): vLLM's CPU attention op on seeded
q/k/v is compared with torch's sdpa on FP32-upcast inputs rounded once (what the generated attention
function does) and with torch's sdpa on BF16 inputs (what HF's trainer does).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphdiff.analysis.opaque import attention_rule, truncates_output
from graphdiff.capture.cpu_kind import KERNEL_BUILD, kernel_build, store_like

pytestmark = [pytest.mark.engine, pytest.mark.kind]


def vllm_cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, isa: str) -> torch.Tensor:
    """vLLM's CPU attention op, prefill of one causal sequence: q [S, H, D], k/v [S, KH, D] (BF16)."""
    import vllm._custom_ops as ops

    s, h, d = q.shape
    kh, block = k.shape[1], 128
    blocks = (s + block - 1) // block + 1
    cache = torch.zeros(blocks, kh, block * 2, d, dtype=torch.bfloat16)
    k_cache, v_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), k_cache, v_cache, torch.arange(s), isa)
    starts, lens = torch.tensor([0, s], dtype=torch.int32), torch.tensor([s], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=h, num_kv_heads=kh, head_dim=d, seq_lens=lens,
                                               dtype=torch.bfloat16, query_start_loc=starts, causal=True,
                                               sliding_window_size=-1, isa=isa, enable_kv_split=True)
    out = torch.zeros(s, h, d, dtype=torch.bfloat16)
    ops.cpu_attention_with_kv_cache(query=q.contiguous(), key_cache=k_cache, value_cache=v_cache, output=out,
                                    query_start_loc=starts, seq_lens=lens, scale=scale, causal=True,
                                    alibi_slopes=None, sliding_window=-1,
                                    block_table=torch.arange(blocks, dtype=torch.int32)[None], softcap=0.0,
                                    scheduler_metadata=meta, s_aux=None)
    return out


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """[S, KH, D] -> [1, H, S, D], key/value heads repeated as HF's sdpa path does."""
    return t.repeat_interleave(h // t.shape[1], 1).transpose(0, 1)[None].contiguous()


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, build: str = "_C") -> torch.Tensor:
    """torch's sdpa as HF calls it, causal ([S, H, D] in and out), stored in BF16 as the ops `build` stores."""
    h = q.shape[1]
    out = F.scaled_dot_product_attention(_heads(q, h), _heads(k, h), _heads(v, h), is_causal=True, scale=scale)
    return store_like(out[0].transpose(0, 1), build)


def unnormalized_p_in_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores and softmax in FP32, exp(s - max) rounded to BF16 before P@V (FP32 sum), divided by the FP32 row sum."""
    h, s = q.shape[1], q.shape[0]
    scores = (_heads(q, h).float() @ _heads(k, h).float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    p = (scores - scores.amax(-1, keepdim=True)).exp()
    out = (p.to(torch.bfloat16).float() @ _heads(v, h).float()) / p.sum(-1, keepdim=True)
    return out[0].transpose(0, 1).to(torch.bfloat16)


def _engine_case(want_isa: str, d: int = 64) -> tuple:
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.bfloat16, 128, d, "auto")
    if isa != want_isa:
        pytest.skip(f"this CPU runs vLLM's {isa} attention kernel, not {want_isa}")
    if isa == "amx":
        torch.cpu._init_amx()  # as vLLM's worker does; without it the AMX kernel dies of SIGILL
    s, h, kh = 96, 4, 2
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, n, d, generator=gen).mul(2).to(torch.bfloat16) for n in (h, kh, kh))
    scale = d ** -0.5
    return attention_rule({"backend": "CPU_ATTN", "isa": isa}), q, k, v, scale, vllm_cpu_attention(q, k, v, scale, isa)


def test_cpu_attention_vec_keeps_probabilities_fp32_as_the_registry_says() -> None:
    """P kept FP32; the output stored as the loaded ops build stores BF16 (truncated on `_C_AVX512`, CPUs without
    AVX-512 BF16: the capture records the build and the patch's attention truncates there too)."""
    rule, q, k, v, scale, engine = _engine_case("vec")
    build = kernel_build()
    fp32_inputs = (sdpa(q.float(), k.float(), v.float(), scale, build) == engine).float().mean().item()
    bf16_inputs = (sdpa(q, k, v, scale) == engine).float().mean().item()
    info = {"backend": "CPU_ATTN", "isa": "vec", "build": build}
    assert truncates_output(info) == (build == KERNEL_BUILD["avx512"] or build == KERNEL_BUILD["avx2"])
    if truncates_output(info):  # rounding to nearest instead would be visibly different
        nearest = (sdpa(q.float(), k.float(), v.float(), scale) == engine).float().mean().item()
        assert nearest < 0.9, nearest
    assert rule is not None and rule.probabilities_fp32
    assert fp32_inputs >= 0.998, fp32_inputs  # the last bits of exp and summation order may differ rarely
    assert bf16_inputs < fp32_inputs - 0.05, (bf16_inputs, fp32_inputs)  # P rounded to BF16: visibly different


@pytest.mark.parametrize("d", [64, 128])
def test_cpu_attention_amx_rounds_probabilities_as_the_registry_says(d: int) -> None:
    """vLLM's AMX kernel rounds the unnormalized probabilities to BF16 for its tile P@V: no FP32-P site."""
    rule, q, k, v, scale, engine = _engine_case("amx", d)
    model = (unnormalized_p_in_bf16(q, k, v, scale) == engine).float().mean().item()
    fp32_inputs = (sdpa(q.float(), k.float(), v.float(), scale) == engine).float().mean().item()
    assert rule is not None and not rule.probabilities_fp32
    assert model >= 0.999, model
    assert fp32_inputs < model - 0.05, (fp32_inputs, model)  # P kept FP32 would be visibly different
