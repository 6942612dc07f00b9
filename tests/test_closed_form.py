"""A splice's closed-form gradient (an RMS norm's, a one-op activation's): recognised in the graph, checked against
autograd, run by the runtime with the forward's values unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.codegen import closed_form, generate
from graphdiff.codegen.generate import MODULE_FILE

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "scans"
IDS = torch.randint(0, 2000, (2, 48), generator=torch.Generator().manual_seed(3))
NORMS = ["model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.layers.*.self_attn.q_norm",
         "model.layers.*.self_attn.k_norm", "model.norm"]
ROPE = "transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb"


@pytest.fixture(scope="module")
def patches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny Qwen3 fixture's patch, and the same patch with its closed forms left out (autograd differentiates)."""
    closed = tmp_path_factory.mktemp("closed")
    generate(FIXTURES / "tiny-qwen3", closed)
    autograd = tmp_path_factory.mktemp("autograd")
    shutil.copytree(closed, autograd, dirs_exist_ok=True)
    manifest = json.loads((autograd / "manifest.json").read_text())
    for splice in manifest["splices"]:
        splice["torch_backward"] = ""
    (autograd / "manifest.json").write_text(json.dumps(manifest))
    return closed, autograd


def test_the_norms_and_the_activation_get_a_closed_form(patches: tuple[Path, Path]) -> None:
    splices = json.loads((patches[0] / "manifest.json").read_text())["splices"]
    closed = {s["key"] for s in splices if s.get("torch_backward")}
    assert closed == {*NORMS, "model.layers.*.mlp.act_fn", ROPE}
    source = (patches[0] / MODULE_FILE).read_text()
    # carried as source: the runtime imports nothing of the scanner
    assert all(f"def {part.__name__}(" in source for part in closed_form.PARTS)


def test_which_splices_get_one(tmp_path: Path) -> None:
    """OLMo2's norm scales the FP32 normalized value and casts the product: recognised. Gemma's scales by
    (1 + weight): not the form the closed gradient is for. Both models' activation (SiLU, GELU) and Gemma's rotary
    embedding: recognised."""
    olmo2 = generate(FIXTURES / "tiny-olmo2-3", tmp_path / "olmo2").splices
    assert {s.key for s in olmo2 if getattr(s, "torch_backward", "")} == {
        "model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm", "model.layers.*.post_attention_layernorm",
        "model.layers.*.post_feedforward_layernorm", "model.norm", "model.layers.*.mlp.act_fn"}
    gemma = generate(FIXTURES / "tiny-gemma-3", tmp_path / "gemma").splices
    assert any(s.key == "model.norm" for s in gemma)
    assert {s.key for s in gemma if getattr(s, "torch_backward", "")} == {
        "model.layers.*.mlp.act_fn", "transformers.models.gemma.modeling_gemma.apply_rotary_pos_emb"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("round_normed", [True, False])
def test_closed_form_is_autograds_gradient(dtype: torch.dtype, round_normed: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, 64, generator=gen).to(dtype)
    weight = (torch.randn(64, generator=gen) + 1).to(torch.bfloat16)
    grad = torch.randn(3, 40, 64, generator=gen).to(torch.bfloat16)

    def forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        normed = normed.to(torch.bfloat16).float() if round_normed else normed
        return (weight.float() * normed).to(torch.bfloat16)

    leaves = [x.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    expected = torch.autograd.grad(forward(*leaves), leaves, grad)
    got = closed_form.rms_norm_backward(grad, x, weight, 1e-6, round_normed)
    for e, g in zip(expected, got):
        assert g is not None and g.dtype == e.dtype and g.shape == e.shape
        assert (g.float() - e.float()).abs().max() <= 2**-7 * e.float().abs().max()
    assert closed_form.rms_norm_backward(grad, x, weight, 1e-6, round_normed, needs=(False, True))[0] is None
    assert closed_form.rms_norm_backward(grad, x, weight, 1e-6, round_normed, needs=(True, False))[1] is None
    wrong = closed_form.rms_norm_backward(grad, x, weight, 1e-6, not round_normed)[1]
    assert not torch.equal(wrong, expected[1])  # the test can tell the rounding apart


@pytest.mark.parametrize(("op", "approximate"), [("silu", "none"), ("gelu", "none"), ("gelu", "tanh")])
def test_an_activations_closed_form_is_autograds_gradient_bit_for_bit(op: str, approximate: str) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    grad = torch.randn(5, 96, generator=gen)
    leaf = x.clone().requires_grad_(True)
    out = torch.nn.functional.silu(leaf.float()) if op == "silu" else \
        torch.nn.functional.gelu(leaf.float(), approximate=approximate)
    (expected,) = torch.autograd.grad(out, leaf, grad)
    got = closed_form.activation_backward(op, grad, x, approximate)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_the_patched_model_keeps_its_values_and_its_gradient(tiny_models: dict[str, Path],
                                                             patches: tuple[Path, Path]) -> None:
    """With the closed forms the logits and loss are the autograd patch's bit for bit; every gradient is within a
    BF16 rounding of it (the FP32 sums of the two gradients run in different orders)."""
    from graphdiff.capture.hf import load_hf_model

    model = load_hf_model(tiny_models["qwen3"]).train()
    results = []
    for path in patches:
        runtime.apply(model, path)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=IDS, labels=IDS, use_cache=False)
        out.loss.backward()
        results.append((out.logits.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
        runtime.remove(model)
    (closed, closed_grads), (auto, auto_grads) = results
    assert torch.equal(closed, auto)
    assert closed_grads.keys() == auto_grads.keys()
    for name, g in closed_grads.items():
        assert (g - auto_grads[name]).abs().max() <= 2**-7 * auto_grads[name].abs().max(), name


def test_a_rotary_embeddings_closed_form_is_autograds_gradient_bit_for_bit() -> None:
    """Bit for bit, and from the tables alone: the rotated input is given as its shape (a meta tensor)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, heads, 24, 64, generator=gen).to(torch.bfloat16) for heads in (4, 2))
    cos, sin = (torch.randn(2, 24, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    grads = [torch.randn(2, heads, 24, 64, generator=gen).to(torch.bfloat16) for heads in (4, 2)]
    leaves = [t.clone().requires_grad_(True) for t in (q, k)]
    outs = apply_rotary_pos_emb(*(t.float() for t in leaves), cos.float(), sin.float())
    expected = torch.autograd.grad(outs, leaves, grads)
    d_q = closed_form.rotary_backward(grads[0], torch.empty_like(q, device="meta"), cos, sin, 1)
    d_k = closed_form.rotary_backward(grads[1], torch.empty_like(k, device="meta"), cos, sin, 1)
    assert torch.equal(d_q, expected[0]) and torch.equal(d_k, expected[1])


def test_the_closed_forms_keep_no_more_for_the_backward_than_autograd(tiny_models: dict[str, Path],
                                                                       patches: tuple[Path, Path]) -> None:
    """The bytes a patched forward saves for its backward: with the closed forms at most autograd's (each keeps only
    the inputs it reads; RoPE's keeps its tables, not the rotated q and k)."""
    from graphdiff.capture.hf import load_hf_model

    model = load_hf_model(tiny_models["qwen3"]).train()
    kept = []
    for path in patches:
        runtime.apply(model, path)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
        runtime.remove(model)
        kept.append(sum(saved.values()))
    closed, autograd = kept
    assert closed <= autograd, kept


def test_with_closed_forms_nothing_is_checkpointed_and_without_them_only_what_keeps_activations(
        tiny_models: dict[str, Path], patches: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Autograd through RoPE keeps only its cos/sin tables: it runs once even without its closed form; the norms keep
    FP32 activations and run checkpointed there. Loss and gradients are the all-checkpointed patch's, bit for bit."""
    from graphdiff.capture.hf import load_hf_model

    model = load_hf_model(tiny_models["qwen3"]).train()
    calls: list[str] = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda fn, *a, **k: calls.append(fn.__name__) or checkpoint(fn, *a, **k))

    def loss_and_grads(path: Path) -> tuple[float, dict[str, torch.Tensor]]:
        runtime.apply(model, path)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=IDS, labels=IDS, use_cache=False)
        out.loss.backward()
        runtime.remove(model)
        return float(out.loss), {n: p.grad.clone() for n, p in model.named_parameters()}

    closed = loss_and_grads(patches[0])
    assert calls == []
    monkeypatch.setenv("GRAPHDIFF_CLOSED_FORM", "0")  # the closed forms switched off: autograd, as without them
    switched_off = loss_and_grads(patches[0])
    assert "torch_model_norm" in calls and switched_off[0] == closed[0]
    monkeypatch.delenv("GRAPHDIFF_CLOSED_FORM")
    calls.clear()
    loss, grads = loss_and_grads(patches[1])
    assert "torch_apply_rotary_pos_emb" not in calls and "torch_model_norm" in calls
    monkeypatch.setattr(runtime.dispatch, "keeps_intermediates", lambda *a: True)  # every splice checkpointed
    loss2, grads2 = loss_and_grads(patches[1])
    assert "torch_apply_rotary_pos_emb" in calls
    assert loss == loss2 and all(torch.equal(grads[n], grads2[n]) for n in grads)
