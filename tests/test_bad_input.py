"""Nothing half-done is ever trusted: every bad input is one line (exit 2, no traceback) before any engine starts,
nothing on disk changes where a command fails, outputs appear all at once, and every part of a scan directory
belongs to the same scan. The CLI cases are in tests/test_bad_input_cases.py (also the docs/BAD_INPUTS.md sweep)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphdiff.errors import GraphdiffError
from tests.test_bad_input_cases import CASES, FIXTURE_SCAN, build_workspace, run_cases, tree

SUITE = [c for c in CASES if c.suite and not c.engine]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = build_workspace(tmp_path_factory.mktemp("bad-input"))
    return {r["name"]: r for r in run_cases(root, SUITE)}


@pytest.mark.parametrize("case", SUITE, ids=[c.name for c in SUITE])
def test_bad_input_is_one_line_before_any_engine_and_changes_nothing(sweep, case):
    r = sweep[case.name]
    assert r["exit"] == case.exit, (r["stderr"], r["stdout"][-1000:])
    assert "Traceback" not in r["stderr"] + r["stdout"]
    assert r["vllm"] is False  # refused (or done) without importing the engine: no engine start, seconds at most
    assert case.says in r["stderr"] + r["stdout"], (r["stderr"], r["stdout"][-1000:])
    lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
    if case.exit == 2:
        assert len(lines) == 1 and lines[0].startswith("error:"), r["stderr"]
    if case.exit != 0:
        assert r["changed"] == []  # nothing written, nothing left behind
    else:  # only the new output appeared, all of it at once: no staging directory left
        out = next(a for a in case.argv[case.argv.index("--out") + 1:]).removeprefix("{ws}/")
        assert r["changed"] and all(c == out or c.startswith(out + "/") for c in r["changed"]), r["changed"]


# --- the helpers, in process ----------------------------------------------------------------------------------------

def test_staged_swaps_on_success_and_leaves_the_target_on_failure_or_ctrl_c(tmp_path):
    from graphdiff.artifacts import staged

    target = tmp_path / "out"
    with staged(target, "kl") as tmp:
        (tmp / "kl.json").write_text("first")
    assert (target / "kl.json").read_text() == "first"
    for error in (GraphdiffError("bad"), KeyboardInterrupt()):
        with pytest.raises(type(error)), staged(target, "kl") as tmp:
            (tmp / "kl.json").write_text("second")
            (tmp / "half.json").write_text("")
            raise error
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging directory left
        assert sorted(p.name for p in target.iterdir()) == ["kl.json"]
        assert (target / "kl.json").read_text() == "first"
    with staged(target, "kl", carry=("kl.json",)) as tmp:  # a cache carried over
        assert (tmp / "kl.json").read_text() == "first"
    deep = tmp_path / "a" / "b" / "out"
    with pytest.raises(KeyboardInterrupt), staged(deep, "kl"):
        raise KeyboardInterrupt
    assert not (tmp_path / "a").exists()  # parents made for the output are gone with it


def test_staged_replaces_only_its_own_kind_of_directory(tmp_path):
    from graphdiff.artifacts import staged

    mine = tmp_path / "user"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    scan = tmp_path / "scan"
    scan.mkdir()
    (scan / "scan.json").write_text("{}")
    (scan / "kl.json").write_text("{}")
    for target, made_by, says in ((mine, "scan", "not made by graphdiff"), (scan, "kl", "graphdiff scan directory"),
                                  (scan, "patch", "graphdiff scan directory")):
        with pytest.raises(GraphdiffError, match=says), staged(target, made_by):
            pass
    assert (mine / "notes.txt").read_text() == "keep" and (scan / "scan.json").is_file()
    with staged(scan, "scan") as tmp:  # a scan replaces a scan (its kl.json included)
        (tmp / "scan.json").write_text("new")
    assert sorted(p.name for p in scan.iterdir()) == ["scan.json"]


def test_random_weights_go_to_the_cache_and_the_users_directory_is_never_written(tmp_path, monkeypatch):
    from graphdiff.models.prepare import prepare_model
    from graphdiff.models.tiny import make_tiny

    monkeypatch.setenv("GRAPHDIFF_CACHE", str(tmp_path / "cache"))
    user = tmp_path / "user"
    user.mkdir()
    shutil.copy(make_tiny("qwen3", tmp_path / "tiny", layers=1) / "config.json", user / "config.json")
    (user / "tokenizer.json").write_text("{}")
    before = tree(user)
    with pytest.raises(GraphdiffError, match="--random-weights"):
        prepare_model(str(user), None, None, lambda m: None)
    resolved, notes = prepare_model(str(user), None, None, lambda m: None, random_weights=True)
    assert tree(user) == before
    assert resolved.path.is_relative_to(tmp_path / "cache") and any(resolved.path.glob("*.safetensors"))
    assert (resolved.path / "tokenizer.json").resolve() == (user / "tokenizer.json").resolve()
    assert any("seeded random" in n for n in notes)
    again, _ = prepare_model(str(user), None, None, lambda m: None, random_weights=True)
    assert again.path == resolved.path  # one copy per config


def test_a_truncated_or_damaged_safetensors_file_is_named(tmp_path):
    from graphdiff.models.resolve import model_fingerprint, safetensors_header
    from graphdiff.models.tiny import make_tiny

    model = make_tiny("qwen3", tmp_path / "m", layers=1)
    weights = model / "model.safetensors"
    fingerprint = model_fingerprint(model)
    data = weights.read_bytes()
    safetensors_header(weights)
    for broken, says in ((data[:-1], "is truncated"), (data[:4], "no complete header"),
                         (data[:8] + b"x" * (len(data) - 8), "damaged safetensors header")):
        weights.write_bytes(broken)
        with pytest.raises(GraphdiffError, match=says) as e:
            safetensors_header(weights)
        assert str(weights) in str(e.value)
    weights.write_bytes(data)
    assert model_fingerprint(model) == fingerprint
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert model_fingerprint(model) != fingerprint


def test_a_persisted_file_gets_one_message_per_way_it_is_wrong(tmp_path):
    from graphdiff.records import ScanResult, load_versioned

    scan = json.loads((FIXTURE_SCAN / "scan.json").read_text())
    cases = {"not JSON": ("{", "is not valid JSON"), "a manifest": ({"kind": "graphdiff.manifest"},
                                                                    "is a graphdiff patch manifest, not a scan"),
             "newer": ({**scan, "schema_version": 99}, "upgrade graphdiff"),
             "older": ({**scan, "schema_version": 1}, "older graphdiff"),
             "bad field": ({**scan, "layers_scanned": "two"}, "field layers_scanned"),
             "not graphdiff": ([1, 2], "not a graphdiff file")}
    for name, (content, says) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(GraphdiffError, match=says) as e:
            load_versioned(ScanResult, path, "scan")
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(GraphdiffError, match="is a directory"):
        load_versioned(ScanResult, tmp_path, "scan")


def test_compilation_config_is_checked_against_vllms_own_fields_without_importing_vllm():
    from graphdiff.engines.vllm.options import check_compilation_config, schema

    if schema() is None:
        pytest.skip("vLLM is not installed")
    check_compilation_config({"mode": 3, "backend": "inductor", "custom_ops": ["+rms_norm"], "compile_sizes": [],
                              "pass_config": {"eliminate_noops": True}, "cudagraph_mode": "piecewise",
                              "optimization_level": 2})
    check_compilation_config({"mode": "VLLM_COMPILE", "splitting_ops": None})
    for bad, says in (({"mode": 99}, "not a CompilationMode"), ({"mode": "fast"}, "not a CompilationMode"),
                      ({"modes": 3}, "did you mean 'mode'"), ({"custom_ops": "+rms_norm"}, "expected a list"),
                      ({"pass_config": {"nope": True}}, "not a field of vLLM's PassConfig"),
                      ({"compile_cache_save_format": "zip"}, "'binary', 'unpacked'"),
                      ({"enabled_custom_ops": []}, "not a field")):  # init=False: vLLM refuses it too
        with pytest.raises(GraphdiffError, match=says):
            check_compilation_config(bad)
    assert "vllm.config" not in sys.modules or "vllm" in sys.modules  # the check itself imports nothing of vLLM


def test_scan_directory_parts_must_belong_to_one_scan(tmp_path):
    from graphdiff.artifacts import ScanDir

    d = tmp_path / "scan"
    shutil.copytree(FIXTURE_SCAN, d)
    ScanDir(d).check_parts()  # recorded before ids: parts agree on the architecture
    capture = d / "engine" / "capture.json"
    data = json.loads(capture.read_text())
    capture.write_text(json.dumps({**data, "architecture": "LlamaForCausalLM"}))
    with pytest.raises(GraphdiffError, match="scan.json has architecture Qwen3ForCausalLM but engine/capture.json "
                                             "has LlamaForCausalLM"):
        ScanDir(d).check_parts()
    capture.write_text(json.dumps({**data, "scan_id": "b" * 12}))
    scan = json.loads((d / "scan.json").read_text())
    (d / "scan.json").write_text(json.dumps({**scan, "scan_id": "a" * 12}))
    with pytest.raises(GraphdiffError, match="parts disagree"):
        ScanDir(d).check_parts()


def test_check_names_the_model_it_was_asked_about_in_the_regenerate_line():
    from graphdiff.check import regenerate_command
    from graphdiff.records import Manifest

    m = Manifest.model_construct(model="tiny:qwen3", scan_command="graphdiff scan tiny:qwen3 --out s --patch")
    assert regenerate_command(m, "tiny:qwen3") == "graphdiff scan tiny:qwen3 --out s --patch"
    assert regenerate_command(m, "/models/other") == "graphdiff scan /models/other --out s --patch"


# --- Ctrl-C during a real run ---------------------------------------------------------------------------------------

def _interrupt_once(argv: list[str], ready: Path, pattern: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the CLI; once `pattern` exists under the staging directory beside `ready`, send it SIGINT."""
    # SIGINT as a terminal delivers it: a child inherits an ignored SIGINT (something in this test process may have
    # set SIG_IGN, e.g. a library's worker setup), and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "graphdiff_cli.main", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    staging = ready.parent / f".{ready.name}.graphdiff-staging-{proc.pid}"
    t0 = time.monotonic()
    while not any(staging.glob(pattern)) and proc.poll() is None and time.monotonic() - t0 < timeout:
        time.sleep(0.1)
    assert proc.poll() is None, "finished before it could be interrupted: " + proc.stderr.read()[-2000:]
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.engine
def test_an_interrupted_scan_leaves_the_previous_scan_as_it_was(tmp_path):
    """The issue's case: a Qwen3 scan directory scanned again as Llama, interrupted after the engine capture."""
    pytest.importorskip("vllm")
    d = tmp_path / "scan"
    shutil.copytree(FIXTURE_SCAN, d)
    before = tree(d)
    proc = _interrupt_once(["scan", "tiny:llama", "--shapes", "16", "--out", str(d)], d, "engine/capture.json")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert tree(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scan"]  # no staging directory left


@pytest.mark.engine
def test_an_interrupted_patch_leaves_the_previous_patch_as_it_was(tmp_path):
    """Interrupted while it measures the regions on the engine (the module and manifest already generated)."""
    pytest.importorskip("vllm")
    from graphdiff.codegen import generate

    scan = tmp_path / "scan"
    shutil.copytree(FIXTURE_SCAN, scan)
    out = tmp_path / "patch"
    generate(scan, out, ["model.norm#norm_weight"])
    before = tree(out)
    proc = _interrupt_once(["patch", str(scan), "--out", str(out), "--regions", "model.norm#norm_weight"], out,
                           "manifest.json")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["patch", "scan"]
