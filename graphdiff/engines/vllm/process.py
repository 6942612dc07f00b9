"""The vLLM engine's capture as files (engines/store.py: capture.json + buffers.pt), made in a child process.

`scan` never starts the engine in its own process: vLLM's start-up changes process state (environment,
Inductor config, OpenMP binding, its current-config global that custom ops and some transformers models
trip over), and the trainer must run as it would in a training job. So the engine is captured in a child
(`python -m graphdiff.engines.vllm.process`, see graphdiff.child) that writes what `graphdiff capture
--engine vllm` writes; the scan, `scan --engine-dump` and `graphdiff replay` all read it back the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from graphdiff import child
from graphdiff.engines.base import Engine, EngineOptions
from graphdiff.engines.store import load_engine_capture, save_engine_capture
from graphdiff.records import (
    Buffers,
    Capture,
    Progress,
    SampleRequest,
    Shape,
)


def capture_isolated(model_dir: Path, shapes: list[Shape], directory: Path, *,
                     compilation_config: dict[str, Any] | None = None, optimization_level: int | None = None,
                     progress: Progress = lambda m: None, config_sha256: str = "",
                     sample: SampleRequest | None = None,
                     tensor_parallel_size: int = 1) -> tuple[Capture, Buffers, float]:
    """Capture the engine in a child process into `directory`; returns the capture, its buffers and the
    engine's start-up time. `sample` (prompts, max_tokens, seed, temperature, out_dir): the same engine then samples
    them with log-probs, and scores them in one prefill, into out_dir/engine_samples.json (what `kl` and the patch's
    measurement read), so a scan with --patch and --kl starts one engine."""
    child.run("graphdiff.engines.vllm.process",
              dict(model_dir=str(model_dir), shapes=[s.model_dump() for s in shapes], out=str(directory),
                   compilation_config=compilation_config or {}, optimization_level=optimization_level,
                   config_sha256=config_sha256, sample=sample.model_dump() if sample is not None else None,
                   tensor_parallel_size=tensor_parallel_size), progress)
    cap, buffers = load_engine_capture(directory, model_dir)
    return cap, buffers, cap.startup_s or 0.0


def _serve(req: dict, progress: Progress) -> None:
    from graphdiff.engines.vllm.engine import start

    s = SampleRequest.model_validate(req["sample"]) if req.get("sample") else None
    longest = max((len(p) for p in s.prompts), default=0) + s.max_tokens if s is not None else 0
    options = EngineOptions(compilation_config=req["compilation_config"], optimization_level=req["optimization_level"],
                            min_model_len=longest, min_seqs=len(s.prompts) if s is not None else 0,
                            tensor_parallel_size=req.get("tensor_parallel_size", 1))
    model_dir = Path(req["model_dir"])
    engine = start(model_dir, [Shape.model_validate(s) for s in req["shapes"]], options, progress)
    try:
        engine.capture.config_sha256 = req["config_sha256"]
        engine.capture.startup_s = round(engine.startup_s, 3)
        save_engine_capture(engine.capture, engine.buffers, Path(req["out"]))
        if s is not None:
            _sample(engine, s, req, model_dir, progress)
    finally:  # before the interpreter finalizes: a live engine client thread aborts it at exit (TP engines)
        engine.stop()


def _sample(engine: Engine, s: SampleRequest, req: dict, model_dir: Path, progress: Progress) -> None:
    """The capture's engine samples the request's prompts (and records MoE routing on them) into out_dir."""
    from graphdiff.engines.base import asked_config
    from graphdiff.engines.samples import samples_run, store_samples
    from graphdiff.engines.vllm.session import engine_versions

    progress(f"sampling {len(s.prompts)} x {s.max_tokens} tokens on the same engine (for the gap)")
    got = engine.sample(s.prompts, max_tokens=s.max_tokens, seed=s.seed, temperature=s.temperature)
    engine.record_routing(got, progress)
    config = asked_config(req["compilation_config"], req["optimization_level"])
    store_samples(Path(s.out_dir), samples_run(model_dir, "compiled", s.prompts, max_tokens=s.max_tokens,
                                               seed=s.seed, temperature=s.temperature,
                                               compilation_config=config, versions=engine_versions(),
                                               samples=got))


if __name__ == "__main__":
    sys.exit(child.serve(_serve))
