"""Run one graphdiff step in a child process: the engine never shares a process with the trainer.

vLLM's start-up changes process state that a later step would inherit: environment variables, Inductor's
config, OpenMP thread binding and NUMA memory, its own "current config" that its custom ops look up (and
that transformers then trips over when it builds some models). A child process takes all of that with
it when it exits. The protocol is small: the parent writes a JSON request, the child prints
`@progress MSG` lines while it works and `@error MSG` (one line, a GraphdiffError) if it fails, and
writes its result where the request says.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from graphdiff.errors import GraphdiffError
from graphdiff.records import Progress

PROGRESS, ERROR, DONE = "@progress", "@error", "@done"


def run(module: str, request: dict, progress: Progress = lambda m: None) -> None:
    """`python -m MODULE REQUEST.json` with `request`; its progress lines go to `progress`; a failure raises
    one GraphdiffError (the child's own message, else the last line it wrote to stderr)."""
    with tempfile.TemporaryDirectory(prefix="graphdiff-child-") as tmp:
        path, log = Path(tmp) / "request.json", Path(tmp) / "stderr.log"
        path.write_text(json.dumps(request))
        with log.open("w+") as err:
            proc = subprocess.Popen([sys.executable, "-m", module, str(path)], stdout=subprocess.PIPE, stderr=err,
                                    text=True)
            assert proc.stdout is not None
            error, last, finished = "", "", False
            try:
                for line in proc.stdout:
                    kind, _, msg = line.rstrip("\n").partition(" ")
                    if kind == PROGRESS:
                        progress(msg)
                        last = msg
                    elif kind == ERROR:
                        error = msg
                    elif kind == DONE:
                        last, finished = "", True
                rc = proc.wait()
            except BaseException:  # Ctrl-C: the child must not go on writing into an output being removed
                proc.kill()
                proc.wait()
                raise
            if rc != 0:
                err.seek(0)
                tail = [ln for ln in err.read().splitlines() if ln.strip()][-1:] or ["no output"]
                raise GraphdiffError(error or failure(module, rc, last, tail[0], finished))


def serve(main: Callable[[dict, Progress], None]) -> int:
    """The child's side: read the request named on the command line, run `main(request, progress)`."""
    request = json.loads(Path(sys.argv[1]).read_text())

    def say(kind: str, msg: str) -> None:
        print(kind, msg.replace("\n", " "), flush=True)

    try:
        main(request, lambda m: say(PROGRESS, m))
    except GraphdiffError as e:
        say(ERROR, str(e))
        return 2
    print(DONE, flush=True)  # its work is done: a crash after this is one at exit
    return 0


def failure(module: str, rc: int, step: str, tail: str, finished: bool = False) -> str:
    """One line for a child that died without saying why: the signal that killed it (a crash inside the engine's
    native code is a SIGSEGV, running out of memory a SIGKILL) and the step it was on."""
    import signal

    how = f"exit {rc}"
    if rc < 0:
        try:
            how = f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            how = f"killed by signal {-rc}"
        if -rc == signal.SIGSEGV:
            how += ", a crash in native code"
        elif -rc == signal.SIGKILL:
            how += ", often the out-of-memory killer"
    when = " at exit, after its work was done" if finished else f" while {step}" if step else ""
    return f"the {module} process failed ({how}){when}: {tail}"
