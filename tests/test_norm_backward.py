"""An RMS norm splice's closed-form gradient: recognised in the graph, checked against autograd, run by the runtime
with the forward's values unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.codegen import generate, norm_backward
from graphdiff.codegen.generate import MODULE_FILE

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "scans"
IDS = torch.randint(0, 2000, (2, 48), generator=torch.Generator().manual_seed(3))
NORMS = ["model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.layers.*.self_attn.q_norm",
         "model.layers.*.self_attn.k_norm", "model.norm"]


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


def test_the_norms_and_only_they_get_a_closed_form(patches: tuple[Path, Path]) -> None:
    splices = json.loads((patches[0] / "manifest.json").read_text())["splices"]
    closed = {s["key"] for s in splices if s.get("torch_backward")}
    assert closed == set(NORMS)
    source = (patches[0] / MODULE_FILE).read_text()
    assert "def rms_norm_backward(" in source  # carried as source: the runtime imports nothing of the scanner


def test_which_norms_get_one(tmp_path: Path) -> None:
    """OLMo2's norm scales the FP32 normalized value and casts the product: recognised. Gemma's scales by
    (1 + weight): not the form the closed gradient is for."""
    olmo2 = generate(FIXTURES / "tiny-olmo2-3", tmp_path / "olmo2").splices
    assert {s.key for s in olmo2 if getattr(s, "torch_backward", "")} == {
        "model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm", "model.layers.*.post_attention_layernorm",
        "model.layers.*.post_feedforward_layernorm", "model.norm"}
    gemma = generate(FIXTURES / "tiny-gemma-3", tmp_path / "gemma").splices
    assert any(s.key == "model.norm" for s in gemma)
    assert not any(getattr(s, "torch_backward", "") for s in gemma)


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
    got = norm_backward.rms_norm_backward(grad, x, weight, 1e-6, round_normed)
    for e, g in zip(expected, got):
        assert g is not None and g.dtype == e.dtype and g.shape == e.shape
        assert (g.float() - e.float()).abs().max() <= 2**-7 * e.float().abs().max()
    assert norm_backward.rms_norm_backward(grad, x, weight, 1e-6, round_normed, needs=(False, True))[0] is None
    assert norm_backward.rms_norm_backward(grad, x, weight, 1e-6, round_normed, needs=(True, False))[1] is None
    wrong = norm_backward.rms_norm_backward(grad, x, weight, 1e-6, not round_normed)[1]
    assert not torch.equal(wrong, expected[1])  # the test can tell the rounding apart


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
