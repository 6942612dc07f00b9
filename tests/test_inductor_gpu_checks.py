"""The lent-GPU script (benchmarks/inductor_gpu_checks.py) runs end to end on the CPU, so a GPU session only runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.engine  # compiles the tiny model with Inductor in a child process (a minute or two here)
def test_the_gpu_script_runs_on_the_cpu_in_one_go_into_one_json(tmp_path):
    out = tmp_path / "checks.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "inductor_gpu_checks.py"), "--device", "cpu",
                          "--quick", "--archs", "qwen3", "--json", str(out), "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    steps = {name: e.get("result", e) for name, e in result["steps"].items()}
    assert set(steps["imports"]["modules"]) >= {"torch", "pydantic", "graphdiff.pipeline"}
    assert steps["cuda_gemm"] and steps["cuda_sdpa"]["FLASH_ATTENTION"]["p_bf16_block_all"]["identical"] > 0
    assert "result" in result["steps"]["triton_replay"] or "skipped" in result["steps"]["triton_replay"]
    assert "error" not in steps["qwen3.scan"], steps["qwen3.scan"]
    replay = steps["qwen3.kernel_replay"]
    assert replay["proven"], replay
    assert set(replay["kernels"][next(iter(replay["kernels"]))]) == {"prefill-16", "prefill-128"}
    gap = steps["qwen3.gap"]
    assert gap["unpatched"]["buckets"] and gap["patched"]["rms"] < gap["unpatched"]["rms"]
    splices = steps["qwen3.splices"]
    assert splices["checks"] > 0 and splices["failed"] == 0, splices
    if result["triton"].startswith("skipped"):
        assert splices["triton_checks"] == 0
    else:  # Triton's interpreter ran every splice that has kernels
        assert result["triton"].startswith("interpreter") and splices["triton_checks"] > 0
    step = steps["training_step"]
    assert "error" not in step, step
    assert {"unpatched", "all"} <= set(step["variants"]) and step["variants"]["all"]["peak_mib"] > 0
