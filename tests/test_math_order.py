"""Ops the engine computes with Inductor's math, with no rounding site (issue 35), from the recorded 3-layer tiny
GPT-NeoX scan (fixtures/scans/tiny-gpt_neox-3, recorded from a real run: fixtures/scans/README.md).

The engine's MLP kernel computes GELU as Inductor lowers it (`0.5 * x * (1 + erf(x / sqrt(2)))`, erf in its
vectorized math); the trainer's `F.gelu` is ATen's kernel. Both read the same BF16 input and round once, so the scan
finds no site, yet 0.28% of the outputs differ: the scan finds the op from the engine's own buffers and the patch
computes it as Inductor does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.analysis.match import Match
from graphdiff.analysis.math_ops import math_differences
from graphdiff.analysis.rounding import engine_rounding
from graphdiff.capture.hf import load_hf_model
from graphdiff.codegen import generate
from graphdiff.models.tiny import make_tiny
from graphdiff.records import Capture, ScanResult
from graphdiff.replay.inductor_math import inductor_math
from tests.conftest import FIXTURES

NEOX = FIXTURES / "scans" / "tiny-gpt_neox-3"
ACT = "gpt_neox.layers.*.mlp.act#math"
GELU_KERNEL = "cpp_fused_gelu_onednn_mm_view_3:9"  # layer 0's up projection and GELU


def _analysis(buffers: dict) -> dict[str, list[str]]:
    """`math_differences` on the recorded graphs, the scan's matches and the engine's recorded `buffers` (the GELU
    kernels' only)."""
    train = Capture.model_validate_json((NEOX / "train.capture.json").read_text()).graphs[0]
    engine = Capture.model_validate_json((NEOX / "engine" / "capture.json").read_text()).graphs[0]
    scan = ScanResult.model_validate_json((NEOX / "scan.json").read_text())
    matched = {engine.name: ([Match(d.node, d.evidence.engine_node, 0.0, 1.0, "") for d in scan.plan
                              if d.rule == "matched" and d.evidence.engine_node], [])}
    er = engine_rounding(engine, buffers)
    return math_differences(train, matched, [engine], {engine.name: er.values}, buffers, er.replays)


def _buffers() -> dict:
    recorded = torch.load(NEOX / "engine" / "buffers.pt", weights_only=False)
    return next(iter(recorded.values()))


def _aten_is_inductor_here() -> bool:
    """Does this CPU's ATen GELU compute the recorded engine values (recorded on an AVX-512 CPU)? On an AVX2 CPU it
    does: ATen's 8-lane vectorized erf gives what Inductor's kernel gave, and there is nothing to align."""
    (x,), (out,) = (r.values() for r in (_buffers()[GELU_KERNEL]["in"], _buffers()[GELU_KERNEL]["out"]))
    return torch.equal(torch.nn.functional.gelu(x).reshape(out.shape), out)


def test_the_engine_gelu_is_found_computed_by_inductors_math() -> None:
    found = _analysis(_buffers())
    want = {} if _aten_is_inductor_here() else {
        "gpt_neox.layers.0.mlp.act": ["gelu"], "gpt_neox.layers.1.mlp.act": ["gelu_1"],
        "gpt_neox.layers.2.mlp.act": ["gelu_2"]}
    assert {m: v for m, v in found.items() if "mlp.act" in m} == want


def test_an_engine_value_atens_gelu_computes_is_not_recorded() -> None:
    """Layer 0's recorded output replaced by ATen's GELU of its recorded input: nothing to align there."""
    if _aten_is_inductor_here():
        pytest.skip("this CPU's ATen GELU computes the recorded engine values: no layer is found to replace")
    buffers = _buffers()
    record = buffers[GELU_KERNEL]
    (x,) = record["in"].values()
    ((name, out),) = record["out"].items()
    aten = torch.nn.functional.gelu(x).reshape(out.shape)
    assert not torch.equal(aten, out)  # the recorded engine output is not ATen's
    buffers[GELU_KERNEL] = {**record, "out": {name: aten}}
    found = _analysis(buffers)
    assert "gpt_neox.layers.0.mlp.act" not in found and "gpt_neox.layers.1.mlp.act" in found


def test_the_gelu_kernel_replays_with_inductors_math_and_not_atens() -> None:
    """The evidence for a value a kernel holds in FP32 and does not store (a rotary embedding's cos)."""
    engine = Capture.model_validate_json((NEOX / "engine" / "capture.json").read_text()).graphs[0]
    replay = next(r for r in engine_rounding(engine, _buffers()).replays if r.kernel == GELU_KERNEL)
    assert replay.predicted_bitexact == 1.0
    assert replay.aten_math_bitexact is not None and 0.99 < replay.aten_math_bitexact < 1.0


@pytest.fixture(scope="module")
def patch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("neox") / "patch"
    generate(NEOX, out, exact=True)
    return out


def test_the_patched_gelu_computes_the_engines_values(patch: Path, tmp_path: Path) -> None:
    manifest = json.loads((patch / "manifest.json").read_text())
    region = next(r for r in manifest["regions"] if r["name"] == ACT)
    assert region["kind"] == "math" and region["generated"]
    assert "inductor_math('gelu', " in (patch / "graphdiff_patch.py").read_text()
    model = load_hf_model(make_tiny("gpt_neox", tmp_path / "model", layers=3))
    record = _buffers()[GELU_KERNEL]
    (x,) = record["in"].values()
    (out,) = record["out"].values()
    act = model.gpt_neox.layers[0].mlp.act
    assert torch.equal(act(x).reshape(out.shape), out) == _aten_is_inductor_here()
    runtime.apply(model, patch, regions=[ACT])
    try:
        y = act(x.clone().requires_grad_(True))
        assert y.dtype == torch.bfloat16 and torch.equal(y.reshape(out.shape), out)
    finally:
        runtime.remove(model)


def test_inductor_gelu_keeps_the_eager_gradient() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 3
    for form, approximate in (("gelu", "none"), ("gelu_tanh", "tanh")):
        a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        inductor_math(form, a).sum().backward()
        torch.nn.functional.gelu(b, approximate=approximate).sum().backward()
        assert torch.equal(a.grad, b.grad), form
