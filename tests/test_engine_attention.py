"""The engine's own attention op in the patched trainer (kl's attention-order diagnostic), against the real op.

Marked `engine`: it calls vLLM's CPU attention kernel (no engine start)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from graphdiff.capture.cpu_kind import store_like
from graphdiff.records import EngineSample

pytestmark = pytest.mark.engine


class _Layer(torch.nn.Module):
    is_causal = True
    sliding_window = None
    scaling = 0.125
    num_key_value_groups = 2  # 4 query heads over 2 key/value heads


def _isa() -> str:
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(torch.bfloat16, 128, 64, "auto")


def _build() -> str:
    """The vLLM CPU ops build this process loaded (its attention op stores BF16 as the build does)."""
    pytest.importorskip("vllm._custom_ops")
    from graphdiff.capture.cpu_kind import kernel_build

    return kernel_build()


def _scan_with_this_engine_attention(tmp_path) -> Path:  # noqa: ANN001
    """The recorded tiny Qwen3 scan, its engine attention as this machine's (the op the tests run here)."""
    from tests.conftest import FIXTURES

    scan_dir = tmp_path / "scan"
    shutil.copytree(FIXTURES / "scans" / "tiny-qwen3", scan_dir)
    scan = json.loads((scan_dir / "scan.json").read_text())
    scan["engine_attention"] = {"backend": "CPU_ATTN", "isa": _isa(), "build": _build()}
    (scan_dir / "scan.json").write_text(json.dumps(scan))
    return scan_dir


def test_the_engine_op_computes_as_the_registry_says():
    """On BF16 q/k/v of 100 keys (fewer than one 128-key block) the vec kernel equals sdpa on the FP32-upcast
    inputs rounded once, and the amx kernel (CPUs with AMX tiles) the same with the unnormalized probabilities
    rounded to BF16 before P@V: what the registry says each computes; a later key never changes an earlier query."""
    from graphdiff.measure.engine_attention import engine_attention_fn
    from tests.test_opaque_engine import unnormalized_p_in_bf16

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 100, 64, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
    out, _ = engine_attention_fn()(_Layer(), q, k, v, None, scaling=0.125)
    assert out.shape == (1, 100, 4, 64) and out.dtype == torch.bfloat16
    if _isa() == "amx":
        ref = unnormalized_p_in_bf16(*(t[0].transpose(0, 1) for t in (q, k, v)), 0.125)
        assert (out[0] == ref).float().mean() >= 0.999
    else:
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                             v.float().repeat_interleave(2, 1), is_causal=True, scale=0.125)
        assert torch.equal(out, store_like(ref.transpose(1, 2), _build()))  # truncated on _C_AVX512 builds
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 60:], v2[:, :, 60:] = 0, 0
    later, _ = engine_attention_fn()(_Layer(), q, k2, v2, None, scaling=0.125)
    assert torch.equal(later[:, :60], out[:, :60]) and not torch.equal(later, out)


def test_the_patched_trainer_with_the_engine_op_runs_in_a_child(tiny_models, tmp_path):
    """In a child process (the trainer's never imports vLLM): below 128 keys the vec kernel and the patch's FP32
    attention agree, so the diagnostic's log-probs equal the patched trainer's own, bit for bit. The amx kernel
    rounds the probabilities, which the patch's attention does not: close, not equal."""
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.codegen import generate
    from graphdiff.measure.engine_attention import patched_logprobs
    from graphdiff.measure.kl import manifest_regions
    from graphdiff.measure.logprobs import train_logprobs, trainer

    scan_dir = _scan_with_this_engine_attention(tmp_path)
    generate(scan_dir, tmp_path / "patch")
    manifest = tmp_path / "patch" / "manifest.json"
    regions = manifest_regions(manifest)
    gen = torch.Generator().manual_seed(1)
    samples = [EngineSample(prompt=torch.randint(3, 2000, (8,), generator=gen).tolist(),
                            tokens=torch.randint(3, 2000, (n,), generator=gen).tolist(), logprobs=[0.0] * n)
               for n in (20, 40)]
    got = patched_logprobs(tiny_models["qwen3"], manifest, regions, samples)
    with trainer(load_hf_model(tiny_models["qwen3"]), "eager", manifest, regions) as model:
        own = train_logprobs(model, samples)
    assert [len(x) for x in got] == [20, 40]
    if _isa() == "amx":
        diff = torch.cat([a - b for a, b in zip(got, own)]).abs()
        assert 0 < float(diff.max()) < 0.05, float(diff.max())
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, own))


def test_the_engine_op_splice_runs_the_engine_forward_and_fp32_attention_backward():
    """`patch --attention engine`: the forward is the engine's op bit for bit; the gradient is FP32 attention's."""
    pytest.importorskip("vllm._custom_ops")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from graphdiff.codegen.attention_splice import attention_engine_op
    from graphdiff.measure.engine_attention import engine_attention_fn

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 150, 64, generator=gen).to(torch.bfloat16).requires_grad_() for h in (4, 2, 2))
    out, _ = attention_engine_op(_Layer(), q, k, v, None, scaling=0.125)
    for b in range(2):  # each batch row is one sequence of the engine's
        row, _ = engine_attention_fn()(_Layer(), *(t[b:b + 1].detach() for t in (q, k, v)), None, scaling=0.125)
        assert torch.equal(out[b:b + 1], row)
    grad = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, _ = sdpa_attention_forward(_Layer(), q32, k32, v32, None, scaling=0.125)  # HF's attention in FP32
    want = torch.autograd.grad(ref, (q32, k32, v32), grad.float())
    bf16 = torch.autograd.grad(sdpa_attention_forward(_Layer(), q, k, v, None, scaling=0.125)[0], (q, k, v), grad)
    for g, w, b in zip(got, want, bf16):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w.to(torch.bfloat16))
        assert not torch.equal(b, g)  # the BF16 attention's gradient is another one
    with pytest.warns(UserWarning, match="padding mask"):  # rows the op cannot take run FP32 attention instead
        padded = torch.ones(2, 1, 150, 150, dtype=torch.bool).tril()
        padded[1, :, :, :10] = False
        attention_engine_op(_Layer(), q.detach(), k.detach(), v.detach(), padded, scaling=0.125)


def test_a_patch_with_the_engine_op_attention_equals_the_diagnostic(tiny_models, tmp_path):
    """The patched trainer with `--attention engine` computes, in this process, what kl's engine-attention
    diagnostic computes in its child: the same log-probs bit for bit."""
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.codegen import generate
    from graphdiff.measure.engine_attention import patched_logprobs
    from graphdiff.measure.kl import manifest_regions
    from graphdiff.measure.logprobs import train_logprobs, trainer

    scan_dir = _scan_with_this_engine_attention(tmp_path)
    fp32, engine = tmp_path / "fp32", tmp_path / "engine"
    generate(scan_dir, fp32)
    manifest = generate(scan_dir, engine, attention="engine")
    splice = next(s for s in manifest.splices if s.target == "attention")
    assert splice.torch_fn == "attention_engine_op" and splice.imports == ["vllm._custom_ops"]
    gen = torch.Generator().manual_seed(4)
    samples = [EngineSample(prompt=torch.randint(3, 2000, (8,), generator=gen).tolist(),
                            tokens=torch.randint(3, 2000, (300,), generator=gen).tolist(), logprobs=[0.0] * 300)]
    diagnostic = patched_logprobs(tiny_models["qwen3"], fp32 / "manifest.json",
                                  manifest_regions(fp32 / "manifest.json"), samples)
    with trainer(load_hf_model(tiny_models["qwen3"]), "eager", engine / "manifest.json",
                 manifest_regions(engine / "manifest.json")) as model:
        own = train_logprobs(model, samples)
    assert torch.equal(own[0], diagnostic[0])
