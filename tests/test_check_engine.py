"""`graphdiff check`, the CI gate, against the real engine; its re-scans also exercise vLLM's piecewise compile
and custom ops on the CPU engine (one engine start each)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from graphdiff.capture.cpu_kind import stores_truncate
from graphdiff.records import CheckResult, ScanResult
from tests.test_cli_errors import run_cli

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def patch(cli_scan, tmp_path_factory) -> Path:
    from graphdiff.codegen import generate

    scan_dir, _ = cli_scan("qwen3")
    out = tmp_path_factory.mktemp("patch")
    manifest = generate(scan_dir, out)
    assert manifest.shapes and manifest.engine_config.get("mode")  # what check compares with
    return out / "manifest.json"


def _check(*args: str) -> tuple[int, str]:
    proc = run_cli("check", *args)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.returncode, proc.stdout


def test_a_fresh_patch_passes(patch):
    rc, out = _check(str(patch), "--shapes", "16", "--format", "json")
    result = CheckResult.model_validate_json(out)
    assert rc == 0 and result.ok, result.findings
    assert result.sites_left == 0 and not result.findings


def test_a_changed_model_config_fails_before_any_engine_starts(patch, tmp_path):
    model = Path(json.loads(patch.read_text())["model"])
    changed = tmp_path / "changed"
    shutil.copytree(model, changed)
    cfg = json.loads((changed / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (changed / "config.json").write_text(json.dumps(cfg))
    rc, out = _check(str(patch), "--model", str(changed), "--format", "markdown")
    assert rc == 1
    assert "must be regenerated" in out and "| model config | `rms_norm_eps` | 1e-06 | 1e-05 |" in out


def test_a_piecewise_engine_fails_the_patch_and_its_rescan_is_proven_at_every_graph(patch, tmp_path):
    """The engine compiled as on a GPU ({"mode": 3}: graphs split at attention): the compile config changed, and
    the re-scan (kept in --out) replays every kernel of every piecewise graph at both shapes."""
    rc, out = _check(str(patch), "-cc", '{"mode": 3}', "--shapes", "16,decode:2x16", "--out", str(tmp_path / "re"),
                     "--format", "json")
    result = CheckResult.model_validate_json(out)
    assert rc == 1 and not result.ok
    assert any(f.kind == "compile config" and f.what == "mode" and "VLLM_COMPILE" in f.now for f in result.findings)
    scan = ScanResult.model_validate_json((tmp_path / "re" / "scan.json").read_text())
    engine = json.loads((tmp_path / "re" / "engine" / "capture.json").read_text())
    assert len(engine["graphs"]) > 2 and scan.engine_config["mode"] == "VLLM_COMPILE"
    assert {r.shape for r in scan.replay} == {"prefill-16", "decode-2x16"}
    assert all(not r.error and r.predicted_bitexact >= 0.999 for r in scan.replay)
    ids = [k["id"] for g in engine["graphs"] for k in g["kernels"]]
    assert len(ids) == len(set(ids))  # kernel ids unique across the pieces


def test_a_scan_with_every_custom_op_is_proven_or_names_what_it_cannot_explain(tiny_models, tmp_path):
    """custom_ops ["all"]: on the CPU engine RoPE becomes vLLM's _C.rotary_embedding extern; the registry (tested
    against the real op in test_opaque_ops_engine.py) says it keeps FP32 inside, so the RoPE products are sites."""
    out = tmp_path / "scan"
    proc = run_cli("scan", str(tiny_models["qwen3"]), "-cc", '{"custom_ops": ["all"]}', "--shapes", "16",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    scan = ScanResult.model_validate_json((out / "scan.json").read_text())
    assert "+rotary_embedding" in scan.engine_config["custom_ops"] or "all" in scan.engine_config["custom_ops"]
    assert all(not r.error and r.predicted_bitexact >= 0.999 for r in scan.replay)
    assert not scan.not_replayed
    rope = [s for s in scan.sites if s.kind == "rope"]
    if stores_truncate(scan.engine_attention.get("build", "")):
        # a `_C_AVX512` build stores the rotated q/k truncated: the registry's claim (one rounding to nearest) does
        # not hold there, so the op is named and its sites are unproven rather than claimed
        assert any("rotary_embedding" in x for x in scan.unregistered_externs)
        assert rope and not any(s.proven for s in rope)
    else:
        assert not scan.unregistered_externs
        assert rope and all(s.proven for s in rope)
    assert all(d.rule == "opaque-registry" and "rotary_embedding" in d.evidence.kernel
               for d in scan.plan if d.site and d.kind == "rope")
