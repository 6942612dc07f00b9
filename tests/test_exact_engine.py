"""`--exact` against the real engine (vLLM CPU): a mixture-of-experts patch whose experts run the engine's own
fused-MoE op forward (and the same computation's gradient backward) gives the engine's log-probs bit for bit (its
prefill scoring, or its decode where the engine's own scorings differ: its gap to the decode is at most the engine's
floor), and chooses no other expert than the engine on any token.

One engine start: the scan's capture samples 4 seeded prompts x 160 tokens and records its expert choices."""

from __future__ import annotations

import pytest
import torch

from graphdiff.analysis import moe_engine
from graphdiff.artifacts import ScanDir
from graphdiff.capture.hf import load_hf_model
from graphdiff.capture.shapes import prefill
from graphdiff.codegen import generate
from graphdiff.engines.samples import random_prompts
from graphdiff.engines.vllm.session import sample_engine
from graphdiff.measure.kl import _logprobs_and_routing
from graphdiff.measure.logprobs import trainer
from graphdiff.models.tiny import make_tiny
from graphdiff.pipeline import scan
from graphdiff.records import SampleAsk

pytestmark = pytest.mark.engine
SAMPLE = SampleAsk(count=4, prompt_tokens=16, max_tokens=160)


def _assert_at_engine_floor(samples: list, patched: list, plain: list) -> None:
    """The patched trainer is at the engine on every token: its log-prob is the engine's prefill scoring of the same
    sequence (one forward over the sequence: the trainer's own task) or, where the engine's own scorings differ
    (batch variance: its one-row decode, or a prefill batched with other sequences, summed in another order), its
    decode; so its gap to the engine's decode is at most the engine's own floor, token by token. The unpatched
    trainer departs. Holds on every CPU kind, whatever the floor."""
    tokens = prefill_equal = at_engine = differ_plain = 0
    for s, mine, unpatched in zip(samples, patched, plain):
        engine, prefill_lp, mine = torch.tensor(s.logprobs), torch.tensor(s.prefill_logprobs), mine.float()
        tokens += len(engine)
        prefill_equal += int((mine == prefill_lp).sum())
        at_engine += int(((mine == prefill_lp) | (mine == engine)).sum())
        differ_plain += int(((unpatched.float() != prefill_lp) & (unpatched.float() != engine)).sum())
    assert tokens == SAMPLE.count * SAMPLE.max_tokens and differ_plain > 0  # the unpatched trainer departs
    assert at_engine == tokens, f"{tokens - at_engine} of {tokens} tokens equal neither the engine's prefill nor " \
                                f"its decode ({prefill_equal} equal its prefill)"


# the fused-MoE op stores by build (the `_C_AVX512` and `_C_AVX2` experts leave no site), and the `_C_AVX2` build's
# ATen GEMMs fold GLM-4-MoE's shared expert into an addmm: .ci/run runs the GLM-4-MoE case as each kind
@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("glm4_moe", marks=pytest.mark.kind)])
def test_exact_moe_gives_the_engines_logprobs_and_expert_choices(tmp_path, arch):
    """Qwen3-MoE (softmax top-k router) and GLM-4-MoE (a dense first layer, sigmoid router with a correction bias,
    a shared expert, whose down projection the `_C_AVX2` build adds to the experts' sum in one addmm)."""
    from graphdiff.capture.cpu_kind import cpu_kind

    if arch == "glm4_moe" and cpu_kind() == "amx":
        pytest.skip("GLM-4-MoE's --exact is not at the engine on AMX CPUs yet (issue 47: vLLM runs its shared "
                    "expert's small GEMMs as weight_packed_linear there)")
    model = make_tiny(arch, tmp_path / "model", layers=2)
    d = ScanDir(tmp_path / "scan")
    outcome = scan(str(model), shapes=[prefill(16)], out=d, sample=SAMPLE)
    d.save_scan(outcome.result)
    d.save_train(outcome.train.capture)
    assert outcome.result.engine_experts["op"] == "_C.cpu_fused_moe", outcome.result.engine_experts
    folded = arch == "glm4_moe" and outcome.result.engine_attention.get("build") == "_C_AVX2"
    assert ("addmm_combine" in outcome.result.engine_experts) == folded, outcome.result.engine_experts
    made = generate(d.root, d.patch_dir, exact=True)
    experts = next(s for s in made.splices if s.target == "experts")
    attention = next(s for s in made.splices if s.target == "attention")
    assert experts.torch_fn == moe_engine.ENGINE_EXPERTS_FN and experts.imports == ["vllm._custom_ops"]
    assert attention.torch_fn == "attention_engine_op" and not experts.problems
    regions = [r.name for r in made.regions if r.generated]
    assert len(regions) == len(made.regions), [r.reason for r in made.regions]

    prompts = random_prompts(outcome.config, SAMPLE.count, SAMPLE.prompt_tokens, SAMPLE.seed)
    samples = sample_engine(model, prompts, ["compiled"], max_tokens=SAMPLE.max_tokens, out_dir=d.root
                            )["compiled"].samples  # cached by the scan's engine: no second start
    assert all(s.routing for s in samples)
    base = load_hf_model(model)
    found = {}
    for label, enabled in (("unpatched", None), ("patched", regions)):
        with trainer(base, "eager", d.patch_dir / "manifest.json" if enabled else None, enabled) as patched:
            found[label] = _logprobs_and_routing(patched, samples, label)
    (lp_plain, flips_plain), (lp, flips) = found["unpatched"], found["patched"]
    _assert_at_engine_floor(samples, lp, lp_plain)
    assert sum(a.differing for a in flips) == 0 < sum(a.differing for a in flips_plain), (flips, flips_plain)


def test_the_engine_experts_op_packs_new_weights_and_takes_the_exact_gradient():
    pytest.importorskip("vllm")
    torch.manual_seed(0)
    experts, hidden, inter, tokens, k = 4, 64, 32, 40, 2

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter((torch.randn(experts, 2 * inter, hidden) / 8).bfloat16())
            self.down_proj = torch.nn.Parameter((torch.randn(experts, hidden, inter) / 8).bfloat16())
            self.act_fn = torch.nn.SiLU()

    module, x = Experts(), torch.randn(tokens, hidden).bfloat16().requires_grad_()
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k), -1).requires_grad_()
    moe_engine.MOE_PADDED_INTERMEDIATE = inter  # what the generated module sets from the scan
    try:
        out = moe_engine.moe_experts_engine_op(module, x, ids, weights)
        like = moe_engine.moe_experts_like_engine(module, x, ids, weights)
        assert out.dtype == torch.bfloat16 and (out.float() - like.float()).abs().max() <= 0.02 * like.abs().max()
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, [x, weights, module.gate_up_proj, module.down_proj], grad)
        want = torch.autograd.grad(like, [x, weights, module.gate_up_proj, module.down_proj], grad)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with torch.no_grad():  # an optimizer step: the packed weights follow
            module.gate_up_proj.mul_(2)
        again = moe_engine.moe_experts_engine_op(module, x, ids, weights)
        assert not torch.equal(again, out)
        module.__dict__.pop("_graphdiff_packed_experts")
        assert torch.equal(moe_engine.moe_experts_engine_op(module, x, ids, weights), again)
        moe_engine.MOE_OUTPUT_SCALE = 2.5  # the engine scales the sum; the router handed these weights scaled
        assert torch.equal(moe_engine.moe_experts_engine_op(module, x, ids, weights), again)
        unscaled = weights.detach().clone()
        unscaled.__dict__["_graphdiff_unscaled"] = True  # as the router splice hands them
        got = moe_engine.moe_experts_engine_op(module, x, ids, unscaled)
        assert got.dtype == torch.float32 and torch.equal(got, again.float() * 2.5)
    finally:
        moe_engine.MOE_PADDED_INTERMEDIATE, moe_engine.MOE_OUTPUT_SCALE = 0, 1.0


def test_the_engine_router_gemm_runs_the_modules_routing_with_the_linears_gradient():
    pytest.importorskip("vllm")
    torch.manual_seed(0)
    hidden, experts, tokens = 64, 8, 40

    class Router(torch.nn.Module):  # a router whose own forward computes FP32 logits with F.linear, as GLM-4-MoE's
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter((torch.randn(experts, hidden) / 8).bfloat16())

        def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = torch.nn.functional.linear(hidden_states.float(), self.weight.float())
            return logits, logits.sigmoid().topk(2, dim=-1).indices

    module, x = Router(), torch.randn(tokens, hidden).requires_grad_()
    logits, ids = moe_engine.moe_router_engine_gemm(module, x)
    want, want_ids = Router.forward(module, x)
    assert logits.dtype == torch.float32 and torch.allclose(logits, want, rtol=1e-5, atol=1e-5)
    assert "_graphdiff_engine_gemm" in module.__dict__  # the engine's op ran, not F.linear
    grad = torch.randn_like(logits)
    got = torch.autograd.grad(logits, [x, module.weight], grad)
    expect = torch.autograd.grad(want, [x, module.weight], grad)
    assert all(torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-4) for a, b in zip(got, expect))
    with torch.no_grad():  # an optimizer step: the engine's GEMM is made again from the new weight
        module.weight.mul_(2)
    again, _ = moe_engine.moe_router_engine_gemm(module, x)
    assert torch.allclose(again, 2 * logits, rtol=1e-5, atol=1e-5)


def _onednn_bf16():  # noqa: ANN202 - vLLM's ops module
    """vLLM's ops, skipping where this CPU's oneDNN has no BF16 matmul (AVX2): vLLM CPU then runs its BF16 linears
    with torch's own linear (`dispatch_cpu_unquantized_gemm`'s fallback), and no splice calls its oneDNN GEMM."""
    ops = pytest.importorskip("vllm._custom_ops")
    try:
        ops.create_onednn_mm(torch.zeros(16, 16, dtype=torch.bfloat16).t(), 32)
    except RuntimeError as e:
        pytest.skip(f"this CPU's oneDNN has no BF16 matmul: {str(e)[:60]}")
    return ops


def test_a_one_output_linear_runs_as_the_engines_gemm_with_the_linears_gradient():
    """ATen computes a linear of one output as a matrix-vector product, which sums in another order than the
    engine's oneDNN GEMM on some rows; `linear_engine_op` is that GEMM, with the linear's gradient backward."""
    ops = _onednn_bf16()

    torch.manual_seed(0)
    gate = torch.nn.Linear(256, 1, bias=False).bfloat16()
    x = torch.randn(8192, 256).bfloat16().requires_grad_()
    got = moe_engine.linear_engine_op(gate, x)
    engine = ops.onednn_mm(ops.create_onednn_mm(gate.weight.detach().t(), 32), x.detach(), None)
    aten = torch.nn.functional.linear(x, gate.weight)
    assert torch.equal(got, engine) and not torch.equal(aten, engine)  # ATen's one-output path differs somewhere
    grad = torch.randn_like(got)
    mine = torch.autograd.grad(got, [x, gate.weight], grad)
    want = torch.autograd.grad(aten, [x, gate.weight], grad)
    assert all(torch.equal(a, b) for a, b in zip(mine, want))


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_exact_dense_tail_gives_the_engines_logprobs(tmp_path, arch):
    """GPT-2 and OPT (issue 35, the dense tail): with the embedding sum held FP32 into the first layer, the last
    layer's norm reading every pass from its stored input and the stored residual sums read through OPT's reshape,
    the `--exact` patch gives the engine's log-probs bit for bit (its prefill's, or its decode's where they differ);
    the unpatched trainer does not."""
    model = make_tiny(arch, tmp_path / "model", layers=3)
    d = ScanDir(tmp_path / "scan")
    outcome = scan(str(model), shapes=[prefill(16)], out=d, sample=SAMPLE)
    d.save_scan(outcome.result)
    d.save_train(outcome.train.capture)
    assert outcome.result.norm_reads_stored and outcome.result.norm_rereads  # the last layer's and the first's
    made = generate(d.root, d.patch_dir, exact=True)
    regions = [r.name for r in made.regions if r.generated]
    assert len(regions) == len(made.regions), [r.reason for r in made.regions]
    assert any(s.fp32_outputs for s in made.splices if s.target == "carry")  # the embedding sum
    prompts = random_prompts(outcome.config, SAMPLE.count, SAMPLE.prompt_tokens, SAMPLE.seed)
    samples = sample_engine(model, prompts, ["compiled"], max_tokens=SAMPLE.max_tokens, out_dir=d.root
                            )["compiled"].samples  # cached by the scan's engine: no second start
    base = load_hf_model(model)
    found = {}
    for label, enabled in (("unpatched", None), ("patched", regions)):
        with trainer(base, "eager", d.patch_dir / "manifest.json" if enabled else None, enabled) as patched:
            found[label] = _logprobs_and_routing(patched, samples, label)[0]
    _assert_at_engine_floor(samples, found["patched"], found["unpatched"])


def test_the_engines_gemm_with_its_bias_fused_is_atens_linear_and_conv1d():
    """vLLM CPU runs a linear with bias as its oneDNN matmul with the bias fused (`_C.onednn_mm(handle, x, bias)`);
    at the tiny GPT-2 and OPT shapes it equals `F.linear` and GPT-2's `Conv1D` (`addmm(bias, x, weight[in, out])`)
    bit for bit, and both round once (not the product, then the sum): no GEMM splice is needed for them."""
    ops = _onednn_bf16()
    torch.manual_seed(0)
    for m, k, n in ((16, 256, 768), (256, 256, 256), (256, 512, 256), (256, 256, 1024), (1, 256, 256)):
        x = torch.randn(m, k).bfloat16()
        w_in_out, bias = (torch.randn(k, n) * 0.08).bfloat16(), (torch.randn(n) * 0.08).bfloat16()
        weight = w_in_out.t().contiguous()
        engine = ops.onednn_mm(ops.create_onednn_mm(weight.t(), 32), x, bias)
        assert torch.equal(engine, torch.nn.functional.linear(x, weight, bias)), (m, k, n)
        assert torch.equal(engine, torch.addmm(bias, x, w_in_out)), (m, k, n)
        twice = (torch.nn.functional.linear(x, weight).float() + bias.float()).bfloat16()
        assert not torch.equal(engine, twice)
