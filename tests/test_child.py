"""A child process that dies without a message is reported in one line: how it died and on which step."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from graphdiff.child import failure, run
from graphdiff.errors import GraphdiffError


def test_a_crash_names_the_signal_and_the_step() -> None:
    msg = failure("graphdiff.engines.vllm.process", -signal.SIGSEGV, "recording at prefill-2048", "File <unknown>")
    assert "killed by SIGSEGV, a crash in native code" in msg and "while recording at prefill-2048" in msg
    assert "exit 3" in failure("m", 3, "", "boom") and "while" not in failure("m", 3, "", "boom")


def test_a_child_killed_by_a_signal_raises_one_error(tmp_path, monkeypatch) -> None:
    (tmp_path / "dies.py").write_text("import os, signal, sys\nprint('@progress loading', flush=True)\n"
                                      "os.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    seen: list[str] = []
    with pytest.raises(GraphdiffError, match="killed by SIGSEGV.*while loading"):
        run("dies", {}, seen.append)
    assert seen == ["loading"]


def test_a_child_that_dies_after_its_work_says_so(tmp_path, monkeypatch) -> None:
    """A crash while the interpreter finalizes (a native thread still alive) is not blamed on the last step."""
    (tmp_path / "dies_at_exit.py").write_text(
        "import atexit, os, signal, sys\nfrom graphdiff import child\n"
        "atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))\n"
        "sys.exit(child.serve(lambda req, progress: progress('sampling')))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{Path(__file__).parents[1]}")
    with pytest.raises(GraphdiffError, match="killed by SIGABRT.* at exit, after its work was done") as e:
        run("dies_at_exit", {}, lambda m: None)
    assert "while sampling" not in str(e.value)
