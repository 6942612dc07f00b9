"""The inference engines a scan compares the trainer against, behind one interface (engines/base.py): vLLM
(engines/vllm/) and a recorded TORCH_COMPILE_DEBUG dump (engines/dump.py). `start(name, ...)` starts one by name."""

from __future__ import annotations

import importlib
from pathlib import Path

from graphdiff.engines.base import Engine, EngineOptions
from graphdiff.errors import GraphdiffError
from graphdiff.records import Progress, Shape

ENGINES = {  # name -> module with start()
    "vllm": "graphdiff.engines.vllm.engine", "dump": "graphdiff.engines.dump", "inductor": "graphdiff.engines.inductor",
}


def start(name: str, model_dir: Path, shapes: list[Shape], options: EngineOptions | None = None,
          progress: Progress = lambda m: None) -> Engine:
    """Start the engine `name` on `model_dir` (a checkpoint; a dump directory for "dump"), record `shapes`."""
    if name not in ENGINES:
        raise GraphdiffError(f"unknown engine {name!r}: one of {', '.join(sorted(ENGINES))}")
    module = importlib.import_module(ENGINES[name])
    engine: Engine = module.start(model_dir, shapes, options or EngineOptions(), progress)
    return engine
