"""The GPU script's step runner (benchmarks/inductor_gpu_checks.py) with fake steps: a failing step is recorded and
the rest goes on, a step that needs it is skipped, a step over its budget is stopped, and the JSON is on disk after
every step (a device run killed halfway still leaves what it found)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("inductor_gpu_checks", ROOT / "benchmarks" / "inductor_gpu_checks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_failing_step_is_recorded_and_the_json_is_written_after_each_step(tmp_path):
    gc = load_script()
    out = tmp_path / "checks.json"
    seen: list[list[str]] = []

    def on_disk() -> dict:  # what a later step finds already written
        seen.append(list(json.loads(out.read_text())["steps"]))
        return {"n": len(seen)}

    def fail() -> None:
        raise RuntimeError("no wheel")

    def slow() -> None:
        end = time.monotonic() + 5
        while time.monotonic() < end:
            pass

    def skip() -> None:
        raise gc.Skipped("not available: module X")

    steps = [gc.Step("first", 10, lambda: {"x": 1}), gc.Step("broken", 10, fail),
             gc.Step("after_broken", 10, lambda: 1, ("broken",)), gc.Step("slow", 0.2, slow),
             gc.Step("optional", 10, skip), gc.Step("last", 10, on_disk, ("first",))]
    result = gc.run_steps(steps, {"device": "cpu"}, out, budget_s=60)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result, default=str))
    s = written["steps"]
    assert s["first"]["result"] == {"x": 1}
    assert s["broken"]["error"] == "RuntimeError: no wheel" and "traceback" in s["broken"]
    assert "needs broken" in s["after_broken"]["skipped"]
    assert "over its budget" in s["slow"]["error"] and s["slow"]["seconds"] < 2
    assert s["optional"] == {"skipped": "not available: module X", "seconds": 0.0, "budget_s": 10}
    assert seen == [["first", "broken", "after_broken", "slow", "optional"]] and s["last"]["result"] == {"n": 1}
    assert not out.with_name(out.name + ".tmp").exists()


def test_no_step_starts_once_the_run_s_budget_is_spent(tmp_path):
    gc = load_script()
    steps = [gc.Step("a", 10, lambda: time.sleep(0.6)), gc.Step("b", 10, lambda: 1)]
    s = gc.run_steps(steps, {}, tmp_path / "c.json", budget_s=1.5)["steps"]
    assert "result" in s["a"] and s["b"]["skipped"] == "the run's time budget is spent"


def test_the_import_chain_names_a_missing_module_with_what_it_found(monkeypatch):
    gc = load_script()
    monkeypatch.setattr(gc, "IMPORT_CHAIN", ("json", "no_such_module_for_gpu_checks"))
    try:
        gc.import_chain("cpu")
    except gc.ImportChainError as e:
        assert "no_such_module_for_gpu_checks" in str(e)
        assert e.detail["modules"]["no_such_module_for_gpu_checks"].startswith("error: ModuleNotFoundError")
        assert "cuda_available" in e.detail
    else:
        raise AssertionError("a missing module passed the import chain")
