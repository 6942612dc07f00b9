"""The engine's own attention op in the patched trainer (kl's attention-order diagnostic), against the real op.

Marked `engine`: it calls vLLM's CPU attention kernel (no engine start)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from graphdiff.capture.cpu_kind import store_like
from graphdiff.records import EngineSample

pytestmark = [pytest.mark.engine, pytest.mark.kind]


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


def _equals_vec(out: torch.Tensor, fp32: torch.Tensor) -> bool:
    """Does the vec kernel's output equal `fp32` (sdpa on FP32-upcast inputs) stored as this build stores? Bit for
    bit on `_C` and `_C_AVX512` (16-lane vectors, the order of torch's FP32 sdpa below one 128-key block); on
    `_C_AVX2` its 8-lane vectors sum in another order: equal on >= 99.9% of outputs, the rest 1 ulp apart."""
    want = store_like(fp32, _build())
    if _build() != "_C_AVX2":
        return torch.equal(out, want)
    ulps = (out.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    return bool((ulps == 0).float().mean() >= 0.999 and ulps.max() <= 1)


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
        assert _equals_vec(out, ref.transpose(1, 2))  # truncated on the _C_AVX512 / _C_AVX2 builds
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 60:], v2[:, :, 60:] = 0, 0
    later, _ = engine_attention_fn()(_Layer(), q, k2, v2, None, scaling=0.125)
    assert torch.equal(later[:, :60], out[:, :60]) and not torch.equal(later, out)


def test_the_patched_trainer_with_the_engine_op_runs_in_a_child(tiny_models, tmp_path):
    """In a child process (the trainer's never imports vLLM): below 128 keys the vec kernel and the patch's FP32
    attention agree, so the diagnostic's log-probs equal the patched trainer's own, bit for bit. The amx kernel
    rounds the probabilities, which the patch's attention does not, and `_C_AVX2`'s vec kernel sums in another
    order (`_equals_vec`): close, not equal."""
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
    if _isa() == "amx" or _build() == "_C_AVX2":
        diff = torch.cat([a - b for a, b in zip(got, own)]).abs()
        assert float(diff.max()) < 0.05, float(diff.max())
        assert _isa() != "amx" or float(diff.max()) > 0  # amx's BF16 probabilities always show
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


def test_the_engine_op_splice_takes_the_bf16_gradient_the_portable_one_takes():
    """`runtime.apply(attention_gradient="bf16")`: the exact splice's forward is still the engine's op; its gradient
    is the portable splice's "bf16" one (the BF16 flash backward at FP32 attention's statistics), not FP32's."""
    pytest.importorskip("vllm._custom_ops")
    from graphdiff.codegen.attention_splice import attention_engine_op, attention_fp32_inputs

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 150, 64, generator=gen).to(torch.bfloat16).requires_grad_() for h in (4, 2, 2))
    grad = torch.randn(1, 150, 4, 64, generator=gen).to(torch.bfloat16)
    layer = _Layer()
    exact32, _ = attention_engine_op(layer, q, k, v, None, scaling=0.125)
    fp32 = torch.autograd.grad(exact32, (q, k, v), grad)
    layer._graphdiff_attention_gradient = "bf16"
    exact16, _ = attention_engine_op(layer, q, k, v, None, scaling=0.125)
    assert torch.equal(exact16, exact32)
    got = torch.autograd.grad(exact16, (q, k, v), grad)
    want = torch.autograd.grad(attention_fp32_inputs(layer, q, k, v, None, scaling=0.125)[0], (q, k, v), grad)
    for g, w, f in zip(got, want, fp32):
        assert torch.equal(g, w) and not torch.equal(g, f)


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


class _GemmaLayer(_Layer):
    """A Gemma 2 layer: the scale from query_pre_attn_scalar, a logit softcap, a sliding window."""
    scaling = 96 ** -0.5
    sliding_window = 40


def _engine_prefill(q, k, v, scale: float, window: int | None, softcap: float | None):  # noqa: ANN001, ANN202
    """The engine's op as vLLM's CPU backend calls it in one prefill step: every batch row a request of its own in
    one flat batch, the layer's `sliding_window` and `logits_soft_cap` passed as the backend passes them (None -> -1,
    None -> 0), the scheduler given the window its KV-cache group shares."""
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    batch, heads, seq, dim = q.shape
    isa = _get_attn_isa(torch.bfloat16, 128, dim, "auto")
    blocks = -(-seq // 128)
    starts = torch.arange(batch + 1, dtype=torch.int32) * seq
    lengths = torch.full((batch,), seq, dtype=torch.int32)
    window = -1 if window is None else window
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=heads, num_kv_heads=k.shape[1], head_dim=dim, seq_lens=lengths,
        dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=window, isa=isa,
        enable_kv_split=True)
    cache = torch.zeros(batch * blocks, k.shape[1], 256, dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.chunk(2, dim=2)
    flat = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim).contiguous() for t in (q, k, v)]
    slots = (torch.arange(batch)[:, None] * blocks * 128 + torch.arange(seq)[None]).flatten()
    ops.cpu_attn_reshape_and_cache(flat[1], flat[2], key_cache, value_cache, slots, isa)
    out = torch.zeros(batch * seq, heads, dim, dtype=torch.bfloat16)
    ops.cpu_attention_with_kv_cache(
        query=flat[0], key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
        seq_lens=lengths, scale=scale, causal=True, alibi_slopes=None, sliding_window=window,
        block_table=torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks),
        softcap=0 if softcap is None else softcap, scheduler_metadata=meta, s_aux=None)
    return out.view(batch, seq, heads, dim)


def _hf_window_mask(seq: int, window: int | None) -> torch.Tensor:
    """HF's causal mask with its sliding-window overlay (`kv > q - window`), as an additive FP32 mask."""
    q, kv = torch.arange(seq)[:, None], torch.arange(seq)[None]
    allowed = (kv <= q) & ((kv > q - window) if window else True)
    return torch.zeros(seq, seq).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def test_the_engine_op_takes_the_window_as_hf_does():
    """vLLM's CPU op given the config's window W lets a query see itself and the W - 1 keys before it: on 100
    keys the vec kernel equals sdpa on FP32-upcast inputs under HF's sliding-window mask, rounded once."""
    if _isa() != "vec":
        pytest.skip("the vec kernel's FP32 probabilities; amx rounds them")
    from graphdiff.codegen.attention_splice import vllm_cpu_attention

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 100, 64, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
    mask = _hf_window_mask(100, 16)
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                         v.float().repeat_interleave(2, 1), attn_mask=mask, scale=0.125)
    out = vllm_cpu_attention(q, k, v, 0.125, sliding_window=16)
    assert _equals_vec(out, ref.transpose(1, 2))
    assert not torch.equal(out, vllm_cpu_attention(q, k, v, 0.125, sliding_window=17))


@pytest.mark.parametrize("window,softcap", [(40, None), (None, 50.0), (40, 50.0), (400, 50.0)])
def test_the_engine_op_splice_takes_sliding_windows_and_softcap(window, softcap):
    """Gemma 2's layers (`sliding_window` and `softcap` as its attention passes them): the splice's forward is the
    engine's op bit for bit, each batch row a request of one prefill; its gradient is FP32 eager attention's with
    the same window and softcap (HF's own eager attention on FP32 inputs), not the BF16 one's."""
    pytest.importorskip("vllm._custom_ops")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from graphdiff.codegen.attention_splice import attention_engine_op

    layer, scale = _GemmaLayer(), _GemmaLayer.scaling
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, h, 150, 64, generator=gen).mul(s).to(torch.bfloat16).requires_grad_()
               for h, s in ((4, 12.0), (2, 1.0), (2, 1.0)))  # scores up to ~50: the softcap bends them
    kwargs = dict(scaling=scale, sliding_window=window, softcap=softcap, dropout=0.0)
    mask = _hf_window_mask(150, window)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # taken by the engine's op, no FP32 fallback
        out, _ = attention_engine_op(layer, q, k, v, mask.expand(2, 1, 150, 150) == 0, **kwargs)
    assert torch.equal(out, _engine_prefill(*(t.detach() for t in (q, k, v)), scale, window, softcap))
    plain, _ = attention_engine_op(_Layer(), *(t.detach() for t in (q, k, v)), None, scaling=scale)
    assert not torch.equal(out, plain)  # the window and the softcap change the engine's output
    grad = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    if softcap:
        ref, _ = eager_attention_forward(layer, q32, k32, v32, mask, scaling=scale, softcap=softcap)
    else:
        ref, _ = sdpa_attention_forward(layer, q32, k32, v32, mask == 0, scaling=scale)
    want = torch.autograd.grad(ref, (q32, k32, v32), grad.float())
    bf16, _ = eager_attention_forward(layer, q, k, v, mask.to(torch.bfloat16), scaling=scale, softcap=softcap)
    low = torch.autograd.grad(bf16, (q, k, v), grad)
    for g, w, b in zip(got, want, low):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w.to(torch.bfloat16))
        assert not torch.equal(b, g)


def test_the_engine_op_splice_reads_the_window_the_layer_passes():
    """Exaone 4 keeps the config's window on every layer and passes `sliding_window=None` on its full ones: the
    splice takes the call's window; a padding mask still runs FP32 attention, with a warning."""
    pytest.importorskip("vllm._custom_ops")
    from graphdiff.codegen.attention_splice import attention_engine_op

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 150, 64, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full, _ = attention_engine_op(_GemmaLayer(), q, k, v, None, scaling=0.125, sliding_window=None)
        windowed, _ = attention_engine_op(_GemmaLayer(), q, k, v, None, scaling=0.125)  # no kwarg: the module's
    assert torch.equal(full, _engine_prefill(q, k, v, 0.125, None, None))
    assert torch.equal(windowed, _engine_prefill(q, k, v, 0.125, 40, None))
    padded = _hf_window_mask(150, 40) == 0
    padded[..., :3] = False
    with pytest.warns(UserWarning, match="padding mask"):
        attention_engine_op(_GemmaLayer(), q, k, v, padded, scaling=0.125, sliding_window=40)


def test_a_registered_attention_gets_the_sliding_window_mask():
    """transformers passes no mask to an attention function its mask registry has no entry for: the patch's
    attention gets sdpa's mask (the sliding window of Gemma 2's sliding layers, none on its full ones), and the
    engine-op splice takes both layers without falling back."""
    pytest.importorskip("vllm._custom_ops")
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from graphdiff.codegen.attention_splice import attention_engine_op
    from graphdiff.runtime.attention import use_attention

    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=16,
                          layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).to(torch.bfloat16).eval()
    seen: list = []

    def recording(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN202
        seen.append((attention_mask, kwargs.get("sliding_window"), kwargs.get("softcap")))
        return attention_engine_op(module, query, key, value, attention_mask, **kwargs)

    ids = torch.randint(0, 128, (1, 40))
    undo = use_attention(model, "graphdiff_test_window", recording)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(ids)
    finally:
        undo()
    (sliding, window, softcap), (full, no_window, _) = seen
    assert window == 16 and no_window is None and softcap == 50.0 and full is None
    assert torch.equal(sliding[0, 0], _hf_window_mask(40, 16)[0, 0] == 0)


def test_the_fp32_splice_takes_a_softcap_as_this_builds_op_computes_it(monkeypatch: pytest.MonkeyPatch):
    """The FP32 splice (the portable patch's attention) on Gemma 2's softcap, with ENGINE_EXP as a patch sets it for
    this ops build (the polynomial exp on `_C` / `_C_AVX512`, the C library's on `_C_AVX2`) and its store: the
    engine's op on >= 99.95% of outputs (measured: 100% on `_C`, 99.99% `_C_AVX512`, 99.97% `_C_AVX2`, whose 8-lane
    vectors sum in another order); the other exp parts from it on > 0.1% (99.83%)."""
    if _isa() != "vec":
        pytest.skip("the vec kernel's FP32 probabilities; amx rounds them")
    from graphdiff.analysis.opaque import exp_polynomial, truncates_output
    from graphdiff.codegen import attention_splice

    info = {"backend": "CPU_ATTN", "build": _build()}
    splice = (attention_splice.attention_fp32_inputs_truncated if truncates_output(info)
              else attention_splice.attention_fp32_inputs)
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, h, 272, 64, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
    engine = attention_splice.vllm_cpu_attention(q, k, v, 0.125, 50.0)
    same = {}
    for polynomial in (True, False):
        monkeypatch.setattr(attention_splice, "ENGINE_EXP", polynomial)
        with torch.no_grad():
            out, _ = splice(_Layer(), q, k, v, None, scaling=0.125, softcap=50.0)
        same[polynomial] = float((out == engine).float().mean())
    assert same[exp_polynomial(info)] >= 0.9995 and same[not exp_polynomial(info)] < 0.999
