"""Shared fixtures. Engine tests (marked `engine`) share ONE real vLLM engine per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphdiff.capture.cpu_kind import FORCE_ENV, apply_forced_kind, cpu_kind, native_kind
from graphdiff.models.tiny import make_tiny

apply_forced_kind()  # GRAPHDIFF_CPU_KIND=avx512: this session and every engine it starts run as that CPU kind

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PROMPT = [17, 912, 33, 1500, 7, 256, 1024, 3, 88, 640, 1999, 5, 42]


def pytest_report_header(config: pytest.Config) -> str:
    forced = f" (forced by {FORCE_ENV}; the CPU is {native_kind()})" if cpu_kind() != native_kind() else ""
    return f"graphdiff CPU kind: {cpu_kind()}{forced}"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(arch, root / arch, layers=2) for arch in ("qwen3", "qwen2", "llama")}


def engine_shapes(model_dir: Path) -> list:
    """The session engine's recorded forwards: PROMPT (the trainer's), a 64-token prefill, a batched decode step."""
    from graphdiff.capture.shapes import decode, prefill, with_prompts
    from graphdiff.models.resolve import read_config

    return with_prompts([prefill(len(PROMPT)), prefill(64), decode(4, 24)], read_config(model_dir), first=PROMPT)


@pytest.fixture(scope="session")
def engine_run(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The real engine on tiny Qwen3, compiled fresh, with a TORCH_COMPILE_DEBUG dump beside it; it records
    three shapes in its one start (engine_shapes)."""
    pytest.importorskip("vllm")
    from graphdiff.engines.vllm.capture import EngineOptions, capture_vllm

    debug = tmp_path_factory.mktemp("inductor-debug")
    run = capture_vllm(tiny_models["qwen3"], engine_shapes(tiny_models["qwen3"]),
                       options=EngineOptions(debug_dir=debug))
    run.debug_dir = debug
    return run


def reference_buffers(run) -> dict:  # noqa: ANN001 - EngineRun
    """The kernel records of the first recorded shape (the trainer's prompt)."""
    return run.buffers[run.capture.shapes[0].label]


@pytest.fixture(scope="session")
def cli_scan(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """`graphdiff scan` of a tiny model in a fresh process (the session already holds an engine);
    one run per architecture, shared by the tests that need a scan directory."""
    import subprocess
    import sys

    done: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def run(arch: str) -> tuple[Path, subprocess.CompletedProcess]:
        if arch not in done:
            out = tmp_path_factory.mktemp(f"scan-{arch}")
            proc = subprocess.run([sys.executable, "-m", "graphdiff_cli.main", "scan", str(tiny_models[arch]),
                                   "--out", str(out)], capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[arch] = (out, proc)
        return done[arch]

    return run
