"""The inference engines a scan compares the trainer against, behind one interface (engines/base.py): vLLM
(engines/vllm/), the HF model under torch.compile (engines/inductor.py) and a recorded TORCH_COMPILE_DEBUG dump
(engines/dump.py). Every caller reaches one by name here: `kind(name)` its module (`EngineKind`), `start(name, ...)`
an engine in this process."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import cast

from graphdiff.engines.base import Engine, EngineKind, EngineOptions
from graphdiff.errors import GraphdiffError
from graphdiff.records import Progress, Shape

ENGINES = {  # name -> module with start() (and, for a live engine, the rest of EngineKind)
    "vllm": "graphdiff.engines.vllm", "dump": "graphdiff.engines.dump", "inductor": "graphdiff.engines.inductor",
}
LIVE = ("vllm", "inductor")  # the engines a scan, kl or check starts on a checkpoint
RECORDED = ("dump",)  # read from a recorded directory, not started on a checkpoint: graphs only


def check_name(name: str, what: str, names: tuple[str, ...] = LIVE) -> None:
    """Refuse an engine name `what` ("graphdiff scans") does not take, naming those it does."""
    if name not in names:
        raise GraphdiffError(f"unknown engine {name!r}; {what} {' or '.join(names)}")


def kind(name: str) -> EngineKind:
    """The module of the engine `name`: its checks, capture in a child process and samples for the gap."""
    if name not in ENGINES:
        raise GraphdiffError(f"unknown engine {name!r}: one of {', '.join(sorted(ENGINES))}")
    return cast(EngineKind, importlib.import_module(ENGINES[name]))


def start(name: str, model_dir: Path, shapes: list[Shape], options: EngineOptions | None = None,
          progress: Progress = lambda m: None) -> Engine:
    """Start the engine `name` on `model_dir` (a checkpoint; a dump directory for "dump"), record `shapes`."""
    return kind(name).start(model_dir, shapes, options or EngineOptions(engine=name), progress)
