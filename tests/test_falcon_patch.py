"""Falcon with --exact (issue 35), from the recorded 3-layer tiny Falcon scan (fixtures/scans/tiny-falcon-3, recorded
from a real run: fixtures/scans/README.md).

What kept every region of it from being generated, each removed by a general rule: its attention calls torch's sdpa
in its own code (the runtime swaps that call while the attention module runs); its down projection `input @
self.weight.T` flattens the tokens and splits them back (a view written against the input's sizes, and an output
that is a view of a site leaves FP32 as the site does); its residual add `dropout_add(x, residual, prob, training)`
takes settings after its tensors (bound with the values the graph was traced under); its parallel block sums the
MLP's and the attention's outputs in place (`+=`, an add as any other)."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.capture.hf import load_hf_model
from graphdiff.codegen import generate
from graphdiff.models.tiny import make_tiny
from tests.conftest import FIXTURES

FALCON = FIXTURES / "scans" / "tiny-falcon-3"
ATTENTION = "transformer.h.*.self_attention#attention"
DOWN = "transformer.h.*.mlp.dense_4h_to_h#other"
BLOCK_SUM = "transformer.h.*#other"
gen_module = importlib.import_module("graphdiff.codegen.generate")


@pytest.fixture(scope="module")
def patches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("falcon")
    generate(FALCON, root / "fp32")
    generate(FALCON, root / "exact", exact=True)
    return {"fp32": root / "fp32", "exact": root / "exact"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return load_hf_model(make_tiny("falcon", tmp_path_factory.mktemp("falcon") / "model", layers=3))


def _manifest(patch: Path) -> dict:
    return json.loads((patch / "manifest.json").read_text())


def test_every_region_is_generated_with_exact(patches: dict[str, Path]) -> None:
    manifest = _manifest(patches["exact"])
    assert {r["name"]: r["reason"] for r in manifest["regions"] if not r["generated"]} == {}
    attention = next(s for s in manifest["splices"] if s["target"] == "attention")
    assert attention["function"] == runtime.TORCH_SDPA and attention["torch_fn"] == "attention_engine_op"
    assert "def sdpa_call(" in (patches["exact"] / "graphdiff_patch.py").read_text()
    adds = [s for s in manifest["splices"] if s["function"].endswith(".dropout_add")]
    assert adds and all(s["inputs"] == ["arg:x", "arg:residual"] and not s["problems"] for s in adds)
    carries = [s for s in manifest["splices"] if BLOCK_SUM in s["regions"]]
    assert carries and all(s["fp32_outputs"] == ["mlp", "self_attention"] for s in carries)


def test_settings_after_the_tensors_take_the_traced_values() -> None:
    from transformers.models.falcon import modeling_falcon

    params = list(inspect.signature(modeling_falcon.dropout_add).parameters.values())
    assert gen_module._settings(params[2:]) == {"prob": 0.0, "training": False}
    assert gen_module._settings(list(inspect.signature(lambda x, table: x).parameters.values())[1:]) == (
        "its parameter table")


def test_the_down_projection_follows_the_tokens_and_leaves_fp32(patches: dict[str, Path]) -> None:
    """Emitted at 16 tokens, it runs at 2 x 21 and returns the un-rounded FP32 product while its regions are aligned."""
    manifest = runtime.load_manifest(patches["fp32"])
    gen = runtime.load_generated(manifest, patches["fp32"] / "manifest.json")
    splice = next(s for s in manifest.splices if s.regions == [DOWN])
    fn = getattr(gen, splice.torch_fn)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 1024, generator=g).bfloat16()
    x = torch.randn(2, 21, 1024, generator=g).bfloat16()
    want = (x.float().reshape(-1, 1024) @ weight.float().T).reshape(2, 21, 256)
    (aligned,) = fn(weight, x, align=frozenset({DOWN, BLOCK_SUM}))
    (plain,) = fn(weight, x, align=frozenset())
    assert aligned.dtype == torch.float32 and torch.equal(aligned, want)
    assert plain.dtype == torch.bfloat16 and torch.equal(plain, want.bfloat16())
    assert "reshape(16" not in (patches["fp32"] / "graphdiff_patch.py").read_text()


def test_the_attention_modules_own_sdpa_call_runs_the_patch(patches: dict[str, Path], model: torch.nn.Module,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """While a patched FalconAttention runs, its `torch.nn.functional.scaled_dot_product_attention` call goes to the
    generated attention function (which calls torch's own sdpa again, on FP32 inputs); elsewhere, and after remove,
    torch's sdpa is itself."""
    manifest = runtime.load_manifest(patches["fp32"])
    gen = runtime.load_generated(manifest, patches["fp32"] / "manifest.json")
    original, seen = gen.attention_fp32_inputs, []

    def spy(module, query, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append((type(module).__name__, query.dtype))
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(gen, "attention_fp32_inputs", spy)
    builtin = torch.nn.functional.scaled_dot_product_attention
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        runtime.apply(model, patches["fp32"], regions=[ATTENTION])
        try:
            assert torch.nn.functional.scaled_dot_product_attention is not builtin
            q = torch.randn(1, 2, 4, 8)
            assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, q, q), builtin(q, q, q))
            patched = model(ids).logits
        finally:
            runtime.remove(model)
        again = model(ids).logits
    assert seen == [("FalconAttention", torch.bfloat16)] * 3
    assert torch.nn.functional.scaled_dot_product_attention is builtin
    assert not torch.equal(patched, plain) and torch.equal(again, plain)
