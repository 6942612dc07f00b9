"""An engine whose attention op rounds where the trainer's sdpa does (vLLM CPU's amx kernel) leaves the scan no
attention site; `--attention engine` still runs its op, for its key order (graphdiff.codegen.attention_order)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from graphdiff.codegen import generate
from graphdiff.records import EngineSample
from tests.conftest import FIXTURES

ATTENTION = "model.layers.*.self_attn#attention"


def _scan_without_attention_sites(tmp_path: Path, engine_attention: dict) -> Path:
    """The recorded tiny Qwen3 scan as an engine with an amx-like attention op records it: no attention site,
    no attention region."""
    scan_dir = tmp_path / "scan"
    shutil.copytree(FIXTURES / "scans" / "tiny-qwen3", scan_dir)
    scan = json.loads((scan_dir / "scan.json").read_text())
    region = next(r for r in scan["regions"] if r["name"] == ATTENTION)
    scan["regions"] = [r for r in scan["regions"] if r["name"] != ATTENTION]
    scan["sites"] = [s for s in scan["sites"] if s["id"] not in region["sites"]]
    scan["engine_attention"] = engine_attention
    (scan_dir / "scan.json").write_text(json.dumps(scan))
    return scan_dir


def test_the_engine_op_attention_is_generated_where_the_scan_has_no_attention_site(tmp_path):
    scan_dir = _scan_without_attention_sites(tmp_path, {"backend": "CPU_ATTN", "isa": "amx", "build": "_C"})
    manifest = generate(scan_dir, tmp_path / "engine", attention="engine")
    region = next(r for r in manifest.regions if r.name == ATTENTION)
    assert region.generated and region.layers == [0, 1] and region.sites == []
    splice = next(s for s in manifest.splices if s.target == "attention")
    assert splice.torch_fn == "attention_engine_op" and splice.module == "model.layers.*.self_attn"
    # with FP32 attention there is nothing to align: no site, no region
    assert ATTENTION not in {r.name for r in generate(scan_dir, tmp_path / "fp32").regions}
    # the gate and `--regions` name it like any region
    assert [r.name for r in generate(scan_dir, tmp_path / "one", [ATTENTION], attention="engine").regions] == [
        ATTENTION]


def test_no_order_region_for_another_engine_backend_or_where_the_scan_has_one(tmp_path):
    other = _scan_without_attention_sites(tmp_path / "a", {"backend": "FLASH_ATTN"})
    assert ATTENTION not in {r.name for r in generate(other, tmp_path / "p1", attention="engine").regions}
    sites = generate(FIXTURES / "scans" / "tiny-qwen3", tmp_path / "p2", attention="engine")
    assert [r.sites for r in sites.regions if r.name == ATTENTION] != [[]]  # the scan's own region, its sites


@pytest.mark.engine
def test_the_order_region_runs_what_the_attention_region_runs(tiny_models, tmp_path):
    """Patched by the order region or by the scan's own attention region (both `--attention engine`), the
    trainer's log-probs are the same bit for bit: the same engine op runs in every layer."""
    pytest.importorskip("vllm")
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.measure.kl import manifest_regions
    from graphdiff.measure.logprobs import train_logprobs, trainer
    from tests.test_engine_attention import _scan_with_this_engine_attention

    own = _scan_with_this_engine_attention(tmp_path / "own")
    info = json.loads((own / "scan.json").read_text())["engine_attention"]
    order = _scan_without_attention_sites(tmp_path / "order", info)
    gen = torch.Generator().manual_seed(5)
    samples = [EngineSample(prompt=torch.randint(3, 2000, (8,), generator=gen).tolist(),
                            tokens=torch.randint(3, 2000, (200,), generator=gen).tolist(), logprobs=[0.0] * 200)]
    out = []
    for scan_dir in (own, order):
        patch = tmp_path / scan_dir.parent.name / "patch"
        generate(scan_dir, patch, attention="engine")
        with trainer(load_hf_model(tiny_models["qwen3"]), "eager", patch / "manifest.json",
                     manifest_regions(patch / "manifest.json")) as model:
            out.append(train_logprobs(model, samples)[0])
    assert torch.equal(out[0], out[1])


@pytest.mark.engine
def test_a_traced_trainer_with_the_engine_op_attention_records_and_reruns_it(tiny_models, tmp_path):
    """The scan's capture of a patched trainer (make_fx) records the engine-op attention as one op and its re-run
    gives the patched model's own logits: `scan --manifest` compares what the patched trainer computes."""
    pytest.importorskip("vllm")
    from graphdiff import runtime
    from graphdiff.capture.hf import load_hf_model, run_graph, trace_hf
    from tests.test_engine_attention import _scan_with_this_engine_attention

    patch = tmp_path / "patch"
    generate(_scan_with_this_engine_attention(tmp_path), patch, attention="engine")
    model = runtime.apply(load_hf_model(tiny_models["qwen3"]), patch / "manifest.json")
    ids = torch.randint(3, 2000, (1, 40), generator=torch.Generator().manual_seed(6))
    gm, _ = trace_hf(model, ids)
    assert [str(n.target) for n in gm.graph.nodes if "vllm_cpu_attention" in str(n.target)] == [
        "graphdiff.vllm_cpu_attention.default"] * 2  # one per layer
    with torch.no_grad():
        assert torch.equal(run_graph(gm, model, ids), model(ids).logits)
