"""Scan against the real engine: the paper's regions, found (not listed), with replay evidence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphdiff.analysis.scan import analyze, run_train_side
from graphdiff.capture.cpu_kind import cpu_kind
from graphdiff.records import ScanResult

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def qwen3_scan(engine_run) -> ScanResult:
    model_dir = Path(engine_run.capture.model)
    train = run_train_side(model_dir, engine_run.capture.prompt_tokens)
    config = json.loads((model_dir / "config.json").read_text())
    return analyze(engine_run.capture, engine_run.buffers, train, model=str(model_dir), layers_total=2, config=config)


@pytest.mark.kind  # the engine as this CPU kind runs it
def test_qwen3_has_the_papers_three_regions_and_the_norm_casts(qwen3_scan):
    kinds = {r.kind: r for r in qwen3_scan.regions}
    assert {"rope", "qk_norm", "gated_act", "residual_norm", "norm_weight"} <= set(kinds)
    for kind in ("rope", "qk_norm", "gated_act", "residual_norm"):
        region = kinds[kind]
        assert region.layers == [0, 1], region
        assert region.rounded_on == ["train"]  # the engine keeps these in FP32, the trainer rounds
        assert not region.differing_layers
    # q and k norms are separate HF modules: two qk_norm regions
    assert {r.module for r in qwen3_scan.regions if r.kind == "qk_norm"} == {
        "model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"}
    gated = kinds["gated_act"]
    silu = [s for s in qwen3_scan.sites if s.region == gated.name]
    assert {s.train.op for s in silu} == {"aten.silu.default"}


@pytest.mark.kind  # the engine as this CPU kind runs it
def test_attention_that_rounds_inside_is_a_site_per_layer(qwen3_scan, engine_run):
    """vLLM's CPU vec attention keeps the softmax probabilities FP32 (registry, tests/test_opaque_engine.py); HF's
    BF16 sdpa stores them as BF16: the trainer's attention output differs from its FP32-input result. Its amx
    attention rounds them itself: no attention site."""
    from graphdiff.analysis.opaque import attention_rule

    info = engine_run.capture.attention
    assert info["backend"] == "CPU_ATTN" and info.get("isa")
    rule = attention_rule(info)
    assert rule is not None, info  # vec and amx are both described
    if not rule.probabilities_fp32:  # the amx kernel rounds P itself, as HF's sdpa does: no site, no region
        assert not any(r.kind == "attention" for r in qwen3_scan.regions)
        assert not any(d.rule == "opaque-registry" and d.site for d in qwen3_scan.plan)
        return
    (region,) = [r for r in qwen3_scan.regions if r.kind == "attention"]
    assert region.name == "model.layers.*.self_attn#attention" and region.layers == [0, 1]
    sites = [s for s in qwen3_scan.sites if s.region == region.name]
    assert len(sites) == 2 and all("scaled_dot_product" in s.train.op for s in sites)
    assert all(0.05 < s.changed_fraction < 1 and "registry" in s.engine.how for s in sites)
    assert {s.engine.kernel.split(":")[0] for s in sites} == {"torch.ops.vllm.unified_attention_with_output.default"}
    assert len({s.engine.kernel for s in sites}) == 2  # each layer its own call
    assert any(r.kind == "rope" and r.name == "model.layers.*.self_attn#rope" for r in qwen3_scan.regions)


@pytest.mark.kind  # the engine as this CPU kind runs it
def test_every_kernel_replays_bit_exactly_under_the_predicted_model(qwen3_scan):
    assert qwen3_scan.replay
    for r in qwen3_scan.replay:
        assert not r.error, r
        assert r.predicted_bitexact >= 0.999, r
        assert r.naive_bitexact < r.predicted_bitexact - 0.1, r  # round-after-every-op is visibly wrong


@pytest.mark.kind  # the engine as this CPU kind runs it
def test_norm_kernels_sum_rows_in_the_order_their_code_says(qwen3_scan):
    """The norm kernels store their FP32 row sums: replayed in the order read from their code (lanes, then a
    halving tree) they equal the stores exactly, in ATen's order they do not (the evidence for the order); each
    norm region records its modules' lanes for the patch."""
    ordered = [r for r in qwen3_scan.replay if r.reduction_lanes]
    assert ordered and {r.reduction_lanes for r in ordered} <= {8, 16, 32, 64}
    assert all(r.aten_order_fp32_error is not None and r.fp32_max_rel_error <= r.aten_order_fp32_error
               and r.predicted_bitexact >= r.aten_order_bitexact for r in ordered)
    assert any(r.fp32_max_rel_error == 0 < r.aten_order_fp32_error for r in ordered)
    norms = [r for r in qwen3_scan.regions if r.kind in ("norm_weight", "qk_norm")]
    assert norms and all(r.reduction_lanes for r in norms)
    assert all(m.startswith("model.") and n > 0 for r in norms for m, n in r.reduction_lanes.items())


@pytest.mark.kind  # the engine as this CPU kind runs it
def test_sites_carry_evidence_and_sources_on_both_sides(qwen3_scan):
    replayed = {r.kernel.split(":")[0] for r in qwen3_scan.replay}
    for s in qwen3_scan.sites:
        assert s.train.source and s.train.source.line > 0
        assert s.engine is not None and s.engine.kernel
        if s.kind == "attention":  # inside the engine's opaque attention call of the same layer
            assert "attention" in s.engine.kernel and s.engine.kernel.split(":")[0] not in replayed
            continue
        assert s.engine.kernel.split(":")[0] in replayed
        assert s.evidence and 0.0 <= s.confidence <= 1.0
        if s.matched:
            assert s.engine.node and s.engine.source is not None
    unmatched_rope = [s for s in qwen3_scan.sites if s.kind == "rope" and not s.matched]
    assert unmatched_rope, "HF's q*cos / rotate_half(q)*sin have no engine node: found as in-kernel sites"


@pytest.mark.kind  # the engine as this CPU kind runs it
def test_every_kernel_is_replayed_at_every_recorded_shape(qwen3_scan, engine_run):
    """One engine start, three shapes (a 13- and a 64-token prefill, a decode step of 4 sequences with their KV
    caches): every generated kernel replays bit-exactly at each, and on this one compiled graph the sites are
    the same at every shape."""
    labels = [s.label for s in engine_run.capture.shapes]
    generated = {k.id for g in engine_run.capture.graphs for k in g.kernels if k.kind == "generated"}
    for label in labels:
        here = [r for r in qwen3_scan.replay if r.shape == label]
        assert {r.kernel for r in here} == generated, label
        assert all(not r.error and r.predicted_bitexact >= 0.999 for r in here), label
    assert qwen3_scan.sites and all(s.shapes == labels for s in qwen3_scan.sites)
    assert not any(r.shape_dependent for r in qwen3_scan.regions)
    assert [s.label for s in qwen3_scan.shapes] == labels


@pytest.mark.kind  # the engine as this CPU kind runs it
def test_site_ids_do_not_depend_on_the_token_count(qwen3_scan, engine_run):
    """The same analysis with the 64-token prefill as the trainer's prompt gives the same site ids (module, source
    line, the op's position on it) although make_fx numbers the trainer's nodes afresh."""
    cap = engine_run.capture.model_copy(deep=True)
    cap.shapes = [cap.shapes[1], cap.shapes[0], cap.shapes[2]]
    cap.prompt_tokens = cap.shapes[0].prompts[0]
    model_dir = Path(cap.model)
    train = run_train_side(model_dir, cap.prompt_tokens)
    config = json.loads((model_dir / "config.json").read_text())
    longer = analyze(cap, engine_run.buffers, train, model=str(model_dir), layers_total=2, config=config)
    assert len(cap.prompt_tokens) == 64
    assert sorted(s.id for s in longer.sites) == sorted(s.id for s in qwen3_scan.sites)
    assert {r.name for r in longer.regions} == {r.name for r in qwen3_scan.regions}


@pytest.mark.kind  # the engine as this CPU kind runs it
def test_the_plan_decides_every_floating_trainer_value_once(qwen3_scan, engine_run):
    """One decision per trainer value (shape variants aside), with the rule and its evidence as fields; the sites are
    exactly the one-sided decisions."""
    ref = qwen3_scan.shapes[0].label
    at_ref = [d for d in qwen3_scan.plan if ref in d.shapes]
    assert len({d.node for d in at_ref}) == len(at_ref)
    assert {d.id for d in qwen3_scan.plan if d.site} == {s.id for s in qwen3_scan.sites}
    for d in qwen3_scan.plan:
        if d.rule == "matched":
            assert d.evidence.engine_node and d.evidence.distance is not None and d.engine is not None
        if d.rule == "inside-kernel":
            assert len(d.evidence.stretch) == 2 and d.evidence.kernel and d.evidence.replay_predicted == 1.0
        if d.site:
            assert d.region and d.kind and d.engine is not None and d.train.on_grid != d.engine.on_grid
    # opaque-registry: the attention decisions, where the engine's attention keeps P in FP32 (vLLM CPU's vec kernel)
    from graphdiff.analysis.opaque import attention_rule

    rule = attention_rule(engine_run.capture.attention)
    assert {d.rule for d in qwen3_scan.plan} >= {"matched", "inside-kernel"} | (
        {"opaque-registry"} if rule is not None and rule.probabilities_fp32 else set())


@pytest.mark.kind  # the engine as this CPU kind runs it
def test_scan_result_round_trips_as_json(qwen3_scan):
    again = ScanResult.model_validate_json(qwen3_scan.model_dump_json())
    assert again == qwen3_scan


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_scan_cli_on_qwen2_and_llama_finds_the_analogous_regions(arch, cli_scan):
    out, proc = cli_scan(arch)
    result = ScanResult.model_validate_json((out / "scan.json").read_text())
    kinds = {r.kind for r in result.regions}
    assert {"rope", "gated_act", "residual_norm"} <= kinds
    assert "qk_norm" not in kinds  # no q/k norm in these architectures
    assert all(r.predicted_bitexact >= 0.999 for r in result.replay)
    assert "sites in" in proc.stdout and "rope" in proc.stdout
    attn = result.engine_attention  # the CPU kind and the vLLM ops build the scan holds for, recorded and said
    assert attn["cpu"] == cpu_kind() and attn["build"] in ("_C", "_C_AVX512", "_C_AVX2")
    assert f"engine kernels of a {attn['cpu']} CPU" in " ".join(proc.stdout.split())


def test_scan_of_a_bundled_hf_id_runs_offline(tmp_path):
    """An HF id resolves to a bundled config; weights are seeded random; nothing is downloaded."""
    out = tmp_path / "q06"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRAPHDIFF_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "graphdiff_cli.main", "scan", "Qwen/Qwen3-0.6B", "--layers", "1",
                           "--tokens", "8", "--out", str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = ScanResult.model_validate_json((out / "scan.json").read_text())
    assert result.layers_total == 28 and result.layers_scanned == 1
    assert {"rope", "qk_norm", "gated_act"} <= {r.kind for r in result.regions}
    assert any("bundled" in n for n in result.notes)


@pytest.fixture(scope="module")
def engine_capture_dir(engine_run, tmp_path_factory) -> Path:
    """The session engine's capture as `graphdiff capture --engine vllm --out DIR` writes it."""
    from graphdiff.engines.store import save_engine_capture

    dump = tmp_path_factory.mktemp("engine-capture")
    save_engine_capture(engine_run.capture.model_copy(deep=True), engine_run.buffers, dump)
    return dump


def test_scan_from_an_engine_capture_made_elsewhere(engine_capture_dir, tiny_models, tmp_path):
    """`capture --engine vllm` on the engine machine, `scan --engine-dump` on a laptop: same sites."""
    from graphdiff.errors import GraphdiffError
    from graphdiff.models.tiny import make_tiny
    from graphdiff.pipeline import scan

    outcome = scan(str(tiny_models["qwen3"]), engine_dump=engine_capture_dir)
    result = outcome.result
    assert not outcome.engine_started
    assert {"rope", "qk_norm", "gated_act", "residual_norm"} <= {r.kind for r in result.regions}
    assert all(r.predicted_bitexact >= 0.999 for r in result.replay)
    other = make_tiny("qwen3", tmp_path / "other-weights", layers=2, seed=7)
    with pytest.raises(GraphdiffError, match="other weights"):
        scan(str(other), engine_dump=engine_capture_dir)


def test_scan_refuses_a_dump_without_buffers(tmp_path):
    from tests.conftest import FIXTURES
    from tests.test_cli_errors import one_error_line, run_cli

    msg = one_error_line(run_cli("scan", "tiny:qwen3", "--engine-dump", str(FIXTURES / "dumps" / "vllm-cpu-tiny-qwen3"),
                                 "--out", str(tmp_path)))
    assert "without recorded kernel buffers" in msg


def test_scan_of_the_patched_trainer_finds_no_site_left(engine_capture_dir, tiny_models, tmp_path):
    """The generated patch (from a scan against this machine's engine) leaves no one-sided rounding that the
    scanner can see: trainer and engine now round in the same places."""
    from graphdiff.analysis.opaque import attention_rule
    from graphdiff.artifacts import ScanDir
    from graphdiff.codegen import generate
    from graphdiff.pipeline import scan

    d = ScanDir(tmp_path / "scan")
    outcome = scan(str(tiny_models["qwen3"]), engine_dump=engine_capture_dir, out=d)
    d.save_train(outcome.train.capture)
    d.save_scan(outcome.result)
    manifest = generate(d.root, tmp_path / "patch")
    assert all(r.generated for r in manifest.regions)
    plain = outcome.result
    patched = scan(str(tiny_models["qwen3"]), engine_dump=engine_capture_dir,
                   manifest=tmp_path / "patch" / "manifest.json").result
    assert len(plain.sites) >= 20
    assert patched.sites == [], [s.id for s in patched.sites]
    # unpatched, the trainer parts from the engine in layer 0, before any attention; patched (rounding points and
    # the norms' sum order), every matched value before an attention output is bit-identical: a departure left is
    # the output projection of an attention (the engine's attention op sums in its own order, a few elements
    # differ; its output is not a matched value, the o_proj GEMM is the first one after it). Where the engine's
    # attention rounds the probabilities itself (vLLM CPU's amx kernel, in its own key blocks), the patch has no
    # attention region and the trainer's sdpa rounds them in other blocks: more of o_proj differs, still o_proj.
    assert plain.departure is not None and plain.departure.layer == 0
    assert not plain.departure.module.endswith("o_proj"), plain.departure
    rule = attention_rule(outcome.engine.attention)
    aligned = rule is not None and rule.probabilities_fp32  # the patch aligns attention: only its sum order left
    left = patched.departure
    assert left is None or (left.module.endswith("self_attn.o_proj") and (left.differing < 0.01 or not aligned)
                            and left.equal_before > plain.departure.equal_before), left
