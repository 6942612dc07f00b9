"""Reports over a recorded tiny-Qwen3 scan (fixtures/scans/tiny-qwen3): HTML, DOT/SVG, Model Explorer.

The scan was recorded from a real `graphdiff scan tiny:qwen3` run, so these tests need no engine.
The browser test opens the report in headless Chromium: no script errors, every region and site
present in the rendered DOM, and a screenshot.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graphdiff.errors import GraphdiffError
from graphdiff.records import ScanResult
from graphdiff.report import graphs as report_graphs
from graphdiff.report.html import find_region, load_scan, model_explorer, region_dot, write_report

SCAN = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-qwen3"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HAS_DOT = report_graphs.dot_binary() is not None


@pytest.fixture()
def scan_dir(tmp_path: Path) -> Path:
    d = tmp_path / "scan"
    shutil.copytree(SCAN, d)
    return d


@pytest.fixture(scope="module")
def scan() -> ScanResult:
    return load_scan(SCAN)[0]


def _kl(**fields: object) -> dict:
    """A KLResult as scan.json embeds it (`scan --kl`): the fields every one has, then `fields`."""
    return {"model": "tiny:qwen3", "architecture": "Qwen3ForCausalLM", "seed": 0, "temperature": 1.0,
            "max_tokens": 128, "prompts": 8, "method": "prompt_logprobs vs HF forward", "measurements": [], **fields}


def _attribution(names: list[str], values: list[float]) -> dict:
    return {"metric": "k1", "regions": names, "method": "exact", "baseline": 3.7e-3, "aligned": 2e-5,
            "reduction": 3.68e-3, "confidence": 0.95, "minimal_set": names[:1], "tokens": 1024, "sequences": 8,
            "bootstrap": 200, "seed": 0, "target": 0.9,
            "values": [{"region": n, "value": v, "ci_low": v / 2, "ci_high": v * 1.5} for n, v in zip(names, values)]}


def _node(dot: str, side: str, name: str) -> bool:
    return re.search(rf'(?m)^\s*"?{side}__{re.escape(name)}"? \[', dot) is not None


def _edge(dot: str, a: str, b: str) -> bool:
    return re.search(rf'"?{re.escape(a)}"? -> "?{re.escape(b)}"?', dot) is not None


def _chromium(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _script_errors(run: subprocess.CompletedProcess) -> list[str]:
    logged = [line for line in run.stderr.splitlines() if "Uncaught" in line or "ERROR:CONSOLE" in line]
    m = re.search(r'<html[^>]*data-js-errors="(\d+)"', run.stdout)
    recorded = int(m.group(1)) if m else -1  # -1: the recorder itself did not run
    return logged + ([f"{recorded} errors recorded in the page"] if recorded != 0 else [])


@pytest.mark.skipif(CHROMIUM is None, reason="headless chromium not installed")
def test_report_renders_in_headless_chromium_with_every_region_and_site(scan_dir: Path, scan: ScanResult,
                                                                         tmp_path: Path) -> None:
    html = write_report(scan_dir)[0]
    assert html == scan_dir / "report.html"
    run = _chromium(tmp_path, html.as_uri(), "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    assert _script_errors(run) == []
    assert 'data-ready="1"' in run.stdout  # the report's own script ran to the end
    dom = run.stdout
    for r in scan.regions:
        assert r.name in dom
    for s in scan.sites:
        assert s.id in dom
    assert dom.count('class="dataflow"') == (len(scan.regions) if HAS_DOT else 0)

    shot = tmp_path / "report.png"
    run = _chromium(tmp_path, html.as_uri(), "--hide-scrollbars", "--window-size=1400,2000", f"--screenshot={shot}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000


@pytest.mark.skipif(CHROMIUM is None, reason="headless chromium not installed")
def test_browser_check_catches_script_errors(scan_dir: Path, tmp_path: Path) -> None:
    """The error check above is not vacuous: a broken script in the page is reported."""
    html = write_report(scan_dir)[0]
    html.write_text(html.read_text().replace("</body>", "<script>undefinedFunction();</script></body>"))
    assert _script_errors(_chromium(tmp_path, html.as_uri(), "--dump-dom"))


def test_report_is_self_contained(scan_dir: Path) -> None:
    text = write_report(scan_dir)[0].read_text()
    assert not re.search(r"""(?:src|href)\s*=\s*["'](?:https?:)?//""", text)
    assert "@import" not in text and not re.search(r"url\(\s*['\"]?https?:", text)
    assert "<style>" in text and "<script>" in text


def test_region_dot_contains_both_sides_of_every_site(scan: ScanResult) -> None:
    _, train, engine = load_scan(SCAN)
    region = find_region(scan, "model.layers.*.self_attn.q_norm")
    dot = region_dot(scan, train, engine, region)
    layer0 = [s for s in scan.sites if s.region == region.name and s.layer == 0]
    assert layer0
    for s in layer0:
        assert _node(dot, "t", s.train.node) and _node(dot, "e", s.engine.node)
        assert _edge(dot, f"t__{s.train.node}", f"e__{s.engine.node}")  # the matched pair is linked
    assert "subgraph cluster_train" in dot and "subgraph cluster_engine" in dot
    assert "subgraph cluster_k0" in dot  # the fused kernel is a cluster


def test_region_dot_draws_unmatched_sites_inside_their_kernel(scan: ScanResult) -> None:
    _, train, engine = load_scan(SCAN)
    region = find_region(scan, "model.layers.*.self_attn#rope")  # the engine has no node for these values
    dot = region_dot(scan, train, engine, region)
    for s in scan.sites:
        if s.region == region.name and s.layer == 0:
            assert not s.matched and _node(dot, "t", s.train.node)
    assert dot.count("inside kernel") == 4 and "lhead=cluster_k" in dot


def test_dot_and_svg_export_of_a_region_and_a_layer(scan_dir: Path) -> None:
    (dot,) = write_report(scan_dir, "dot", region="q_norm")
    assert dot.name == "region-model.layers.self_attn.q_norm-qk_norm.dot" and "_to_copy_6" in dot.read_text()
    (layer,) = write_report(scan_dir, "dot", layer=1, out=scan_dir / "l1.dot")
    text = layer.read_text()
    assert all(_node(text, "t", s.train.node) for s in load_scan(scan_dir)[0].sites if s.layer == 1)
    if HAS_DOT:
        (svg,) = write_report(scan_dir, "svg", layer=0)
        assert svg.read_text().lstrip().startswith("<?xml") and "</svg>" in svg.read_text()


def test_dot_export_needs_exactly_one_of_region_or_layer(scan_dir: Path) -> None:
    with pytest.raises(GraphdiffError, match="--region NAME or --layer N"):
        write_report(scan_dir, "dot")
    with pytest.raises(GraphdiffError, match="not a region"):
        write_report(scan_dir, "dot", region="no.such.module")


def test_html_without_graphviz_has_a_note_and_the_dot_source(scan_dir: Path, scan: ScanResult,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report_graphs, "dot_binary", lambda: None)
    text = write_report(scan_dir)[0].read_text()
    assert "Graphviz <code>dot</code> was not found" in text
    assert 'class="dataflow"' not in text
    assert "digraph" in text  # the DOT source is kept for rendering elsewhere
    assert all(s.id in text for s in scan.sites)
    with pytest.raises(GraphdiffError, match="Graphviz `dot` is not installed"):
        write_report(scan_dir, "svg", region="q_norm")


def test_model_explorer_node_data_marks_sites_by_side(scan_dir: Path, scan: ScanResult) -> None:
    paths = write_report(scan_dir, "model-explorer")
    assert [p.name for p in paths] == ["node_data.json", "node_data.engine.json"]
    train = json.loads(paths[0].read_text())
    train_nodes = {n.name for n in load_scan(scan_dir)[1].graphs[0].nodes}
    assert set(train["results"]) == {s.train.node for s in scan.sites}
    assert set(train["results"]) <= train_nodes
    assert {v["value"] for v in train["results"].values()} == {1}  # every site here rounds on the train side
    assert [(t["value"], t["bgColor"]) for t in train["thresholds"]] == [(1, report_graphs.TRAIN_COLOR),
                                                                         (2, report_graphs.ENGINE_COLOR)]
    engine = json.loads(paths[1].read_text())
    assert set(engine["results"]) == {s.engine.node for s in scan.sites if s.engine and s.engine.node}


def test_model_explorer_uses_model_node_data_for_several_graphs(scan: ScanResult) -> None:
    _, train, engine = load_scan(SCAN)
    second = engine.graphs[0].model_copy(update={"name": "engine_graph_1"})
    engine = engine.model_copy(update={"graphs": [engine.graphs[0], second]})
    data = model_explorer(scan, train, engine)["node_data.engine.json"]
    assert set(data) == {"engine_graph_0", "engine_graph_1"} and "results" in data["engine_graph_0"]


def test_measured_kl_is_shown_with_shapley_and_nonuniformity_charts(scan_dir: Path, scan: ScanResult) -> None:
    raw = json.loads((scan_dir / "scan.json").read_text())
    raw["nonuniformity"] = {"mul": 0.8, "add": -0.1}
    names = [r.name for r in scan.regions]
    raw["kl"] = _kl(attribution=_attribution(names, [1e-4 * (i + 1) for i in range(len(names))]),
                    manifest="patches/manifest.json", compilation_config={"mode": 3, "custom_ops_seen": ["none"]})
    (scan_dir / "scan.json").write_text(json.dumps(raw))
    text = write_report(scan_dir)[0].read_text()
    assert "patches/manifest.json" in text  # a string field as a card
    assert text.count('<svg class="chart"') == 2
    assert '<a href="#model.layers.self_attn.q_norm-qk_norm"><text' in text  # shapley bars link to their region
    assert "custom_ops_seen" in text  # anything else is shown as JSON


def test_kl_result_shows_measurements_and_shapley_with_intervals(scan_dir: Path, scan: ScanResult) -> None:
    """`graphdiff kl` results (KLResult: measurements + Shapley attribution) get a table and a chart."""
    names = [r.name for r in scan.regions[:3]]
    meas = {"engine_mode": "compiled", "trainer_mode": "eager", "k3": 1e-4, "rms": 0.06, "max_abs": 0.4,
            "bitexact_fraction": 0.0, "tokens": 1024, "sequences": 8}
    raw = json.loads((scan_dir / "scan.json").read_text())
    raw["nonuniformity"] = {}  # only the Shapley chart in this page
    raw["kl"] = _kl(measurements=[meas | {"regions": None, "k1": 3.7e-3}, meas | {"regions": names, "k1": 2.0e-5}],
                    attribution=_attribution(names, [2e-3, 1e-3, 6.8e-4]))
    (scan_dir / "scan.json").write_text(json.dumps(raw))
    text = write_report(scan_dir)[0].read_text()
    # the headline is k3 with its standard error (>= 0 per token), not k1
    assert "KL (k3 ± se) · compiled engine vs eager trainer, unpatched" in text and "KL k1" not in text
    assert "<th>k1 (KL)</th>" in text and "3 regions patched" in text
    assert text.count('<svg class="chart"') == 1 and text.count('class="err"') == 3  # no position buckets here
    assert f"Minimal set: {names[0]}." in text
    assert "prompts 8" in text and "graphdiff.kl" not in text  # run settings summarized, bookkeeping not dumped


def test_report_without_kl_says_not_measured(scan_dir: Path) -> None:
    raw = json.loads((scan_dir / "scan.json").read_text())
    raw["kl"], raw["nonuniformity"] = None, {}
    (scan_dir / "scan.json").write_text(json.dumps(raw))
    assert "not measured in this scan" in write_report(scan_dir)[0].read_text()


def test_report_shows_the_measured_gap_and_nonuniformity(scan_dir: Path, scan: ScanResult) -> None:
    """The recorded scan ran with --patch --kl: its gap table and the non-uniformity chart are shown."""
    assert scan.kl and scan.nonuniformity
    text = write_report(scan_dir)[0].read_text()
    assert "<th>k3</th>" in text and "nonuniformity" in text.lower()
    assert "contrast: projections" in text


def test_cli_report_writes_each_format(scan_dir: Path) -> None:
    from graphdiff_cli.main import app

    runner = CliRunner()
    res = runner.invoke(app, ["report", str(scan_dir)])
    assert res.exit_code == 0, res.output
    assert (scan_dir / "report.html").exists()
    res = runner.invoke(app, ["report", str(scan_dir), "--format", "model-explorer"])
    assert res.exit_code == 0 and (scan_dir / "node_data.json").exists()
    res = runner.invoke(app, ["report", str(scan_dir), "--format", "dot", "--region", "act_fn", "--out",
                              str(scan_dir / "x.dot")])
    assert res.exit_code == 0 and "digraph" in (scan_dir / "x.dot").read_text()
    res = runner.invoke(app, ["report", str(scan_dir), "--format", "png"])
    assert res.exit_code == 2 and "unknown format" in res.output
    res = runner.invoke(app, ["report", str(scan_dir / "missing")])
    assert res.exit_code == 2 and "no scan.json" in res.output


def test_the_gap_by_position_is_plotted_with_the_floor_and_its_sources(scan_dir: Path) -> None:
    """kl.json's position buckets: RMS and bit-identical lines for unpatched, patched, patched with the engine's
    attention op and the floor, and the table of named sources per bucket."""
    def curve(rms: list[float], exact: list[float]) -> list[dict]:
        return [{"start": 128 * i, "stop": 128 * (i + 1), "tokens": 1024, "k1": 0.0, "rms": r,
                 "bitexact_fraction": e} for i, (r, e) in enumerate(zip(rms, exact))]

    def meas(regions: list[str] | None, rms: list[float], exact: list[float], **kw: object) -> dict:
        return {"engine_mode": "compiled", "trainer_mode": "eager", "regions": regions, "k1": 0.0, "k3": 1e-5,
                "k3_se": 2e-6, "rms": rms[0], "max_abs": 0.1, "bitexact_fraction": exact[0], "tokens": 2048,
                "sequences": 8, "position": curve(rms, exact), **kw}

    raw = json.loads((scan_dir / "scan.json").read_text())
    raw["kl"] = _kl(max_tokens=256, bucket=128,
                    measurements=[meas(None, [0.04, 0.041], [0.0, 0.0]), meas(["a"], [0.009, 0.012], [0.3, 0.1])],
                    engine_attention=meas(["a"], [0.002, 0.003], [0.7, 0.6]),
                    floor=meas(None, [0.0, 0.001], [1.0, 0.98], trainer_mode="engine-prefill"),
                    sources=[{"name": "attention order", "what": "", "ms": [7.7e-5, 1.3e-4], "share": [0.95, 0.94]}])
    (scan_dir / "scan.json").write_text(json.dumps(raw))
    text = write_report(scan_dir)[0].read_text()
    assert "The gap by position" in text
    assert text.count('<svg class="chart"') >= 2  # RMS and bit-identical fraction
    for label in ("unpatched", "patched, the engine&#39;s attention op", "floor: engine decode vs its prefill"):
        assert label in text
    assert "0.0120 (10%)" in text and "0.29" in text  # the patched bucket and patched / unpatched = 0.012 / 0.041
    assert "share of the patched ms: attention order" in text and "94%" in text


def test_the_engines_own_floor_is_named_where_its_decode_differs_from_its_prefill(scan_dir: Path) -> None:
    """Where the engine's decode differs from its own prefill scoring (batch variance, as on AMX), the report and
    `kl` say on what share of tokens and that no trainer patch removes it; where the floor is 0 they say nothing."""
    from graphdiff.records import KLResult
    from graphdiff.report.gap import floor_note

    def meas(exact: float, **kw: object) -> dict:
        return {"engine_mode": "compiled", "trainer_mode": "eager", "regions": None, "k1": 0.0, "k3": 1e-5,
                "rms": 0.004, "max_abs": 0.1, "bitexact_fraction": exact, "tokens": 2048, "sequences": 8,
                "position": [{"start": 0, "stop": 256, "tokens": 2048, "k1": 0.0, "rms": 0.004,
                              "bitexact_fraction": exact}], **kw}

    raw = json.loads((scan_dir / "scan.json").read_text())
    raw["kl"] = _kl(max_tokens=256, bucket=256, measurements=[meas(0.0), meas(0.5, regions=["a"])],
                    floor=meas(0.68, trainer_mode="engine-prefill"))
    assert floor_note(KLResult.model_validate(raw["kl"])) is not None
    (scan_dir / "scan.json").write_text(json.dumps(raw))
    text = write_report(scan_dir)[0].read_text()
    assert "differs from its own prefill scoring of the same sequences on 655 of 2048 tokens (32.0%" in text
    assert "Made by" not in text  # no probe recorded: no kernel named
    probed = ["down_proj GEMM (onednn_mm, 512 -> 256): 6% of rows differ at M = 2 vs 528",
              "attention (vLLM CPU decode over the KV cache vs prefill): 0% of decode rows differ at 528 tokens"]
    note = floor_note(KLResult.model_validate({**raw["kl"], "floor_ops": probed}))
    assert note is not None and "Made by" in note and "down_proj GEMM (onednn_mm" in note and "attention" not in \
        note.split("Made by")[1]
    note = floor_note(KLResult.model_validate({**raw["kl"], "floor_ops": probed[1:]}))
    assert note is not None and "None of the probed ops" in note
    raw["kl"]["floor"]["bitexact_fraction"] = 1.0
    assert floor_note(KLResult.model_validate({**raw["kl"], "floor_ops": probed})) is None


def test_moe_routing_agreement_is_tabled_and_absent_for_a_dense_model(scan_dir: Path) -> None:
    assert "MoE routing agreement" not in write_report(scan_dir)[0].read_text()
    raw = json.loads((scan_dir / "scan.json").read_text())
    raw["routing"] = [{"layer": 1, "shape": "prefill-16", "tokens": 16, "differing": 3, "fraction": 3 / 16}]
    (scan_dir / "scan.json").write_text(json.dumps(raw))
    text = write_report(scan_dir)[0].read_text()
    assert "MoE routing agreement" in text and "18.75%" in text
    # the gap's samples too (kl.json routing, embedded by scan --kl), unpatched and patched, not as raw JSON
    kl = _kl(routing=[{"layer": 0, "shape": "4 samples x 272 tokens", "tokens": 1088, "differing": 17,
                       "fraction": 17 / 1088, "trainer": "unpatched"},
                      {"layer": 0, "shape": "4 samples x 272 tokens", "tokens": 1088, "differing": 4,
                       "fraction": 4 / 1088, "trainer": "patched"}])
    raw["kl"] = kl
    (scan_dir / "scan.json").write_text(json.dumps(raw))
    text = write_report(scan_dir)[0].read_text()
    assert "4 samples x 272 tokens" in text and "1.56%" in text and "0.37%" in text and "patched" in text
    assert '"routing": [' not in text  # tabled, not dumped with the other KL results


def test_the_summary_names_what_the_replay_does_not_cover(scan_dir: Path) -> None:
    """"On every generated kernel" only when it is true; kernels not replayed or unexplained, and engine parameters
    never read, are named on the page as in the terminal's summary."""
    text = write_report(scan_dir)[0].read_text()
    assert "on every generated kernel" in text and "not replayed" not in text
    raw = json.loads((scan_dir / "scan.json").read_text())
    raw["not_replayed"] = ["cpp_fused_moe_7:2 @ prefill-16: inputs could not be resolved"]
    raw["engine_unread"] = ["model.layers.1.mlp.gate.e_score_correction_bias",
                            "model.layers.2.mlp.gate.e_score_correction_bias"]
    (scan_dir / "scan.json").write_text(json.dumps(raw))
    text = write_report(scan_dir)[0].read_text()
    assert "on every generated kernel" not in text and "bit-identical on every kernel" not in text
    assert "not replayed: cpp_fused_moe_7:2 @ prefill-16" in text
    assert "never reads" in text and "model.layers.*.mlp.gate.e_score_correction_bias (layers 1, 2)" in text
