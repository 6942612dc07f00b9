"""A child process that dies without a message is reported in one line: how it died and on which step."""

from __future__ import annotations

import signal

import pytest

from graphdiff.child import failure, run
from graphdiff.errors import GraphdiffError


def test_a_crash_names_the_signal_and_the_step() -> None:
    msg = failure("graphdiff.capture.engine_process", -signal.SIGSEGV, "recording at prefill-2048", "File <unknown>")
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
