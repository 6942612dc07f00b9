"""vLLM behind the engine interface: the real engine started in this process with the capture's hooks
(engines/vllm/capture.py), sampling and scoring through vLLM's own sampler (engines/vllm/session.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from graphdiff.engines.base import EngineOptions
from graphdiff.engines.vllm.capture import capture_vllm, record_routing
from graphdiff.engines.vllm.llm import engine_sample, score_prefill, stop_engine
from graphdiff.engines.vllm.start import EngineRun
from graphdiff.records import (
    Buffers,
    Capture,
    EngineSample,
    Progress,
    Shape,
)


@dataclass
class VllmEngine:
    """A started vLLM engine with its capture (the `Engine` interface)."""

    run: EngineRun
    name: str = "vllm"

    @property
    def capture(self) -> Capture:
        return self.run.capture

    @property
    def buffers(self) -> Buffers:
        return self.run.buffers

    @property
    def startup_s(self) -> float:
        return self.run.startup_s

    def sample(self, prompts: Sequence[list[int]], *, max_tokens: int, seed: int = 0,
               temperature: float = 1.0) -> list[EngineSample]:
        return engine_sample(self.run.llm, prompts, max_tokens=max_tokens, seed=seed, temperature=temperature)

    def score(self, samples: Sequence[EngineSample]) -> None:
        score_prefill(self.run.llm, samples)

    def record_routing(self, samples: Sequence[EngineSample], progress: Progress = lambda m: None) -> None:
        record_routing(self.run, list(samples), progress)

    def stop(self) -> None:
        stop_engine(self.run.llm)


def start(model_dir: Path, shapes: list[Shape], options: EngineOptions, progress: Progress) -> VllmEngine:
    """vLLM on `model_dir`, compiled with `options`, its kernels recorded at every shape."""
    return VllmEngine(capture_vllm(model_dir, shapes, options=options, progress=progress))

