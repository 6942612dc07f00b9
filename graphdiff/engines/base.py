"""The engine interface: what a scan asks of an inference engine, whichever engine it is.

An engine starts on a checkpoint with `EngineOptions`, compiles the model, and hands back its compiled graphs as a
`Capture` with the kernel buffers of one forward per asked shape (what the replay re-runs). A live engine also
samples continuations with their log-probs and scores whole sequences in one prefill (the gap's reference), records
which experts it routed each token to (MoE), and stops. A recorded dump is an engine that only has graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from graphdiff.records import Buffers, Capture, EngineSample, Progress


@dataclass
class EngineOptions:
    """How the engine is started: what a user passes to `vllm serve`, and the capture's own settings."""

    compilation_config: dict[str, Any] = field(default_factory=dict)  # as `vllm serve --compilation-config`
    optimization_level: int | None = None  # as `vllm serve -O N`
    layers: int | None = None  # override num_hidden_layers (hf_overrides)
    debug_dir: Path | None = None  # keep the TORCH_COMPILE_DEBUG dump here
    min_model_len: int = 0  # room for sampling on the same engine after the capture (prompt + tokens)
    min_seqs: int = 0
    tensor_parallel_size: int = 1  # as `vllm serve --tensor-parallel-size`: > 1 captures every rank
    device: str = "cpu"  # where the engine runs (`--device`; `--engine inductor` runs on cpu or cuda)


class Engine(Protocol):
    """A started engine: its compiled graphs captured, its kernels recorded at each asked shape."""

    @property
    def name(self) -> str:
        """As `--engine` names it."""
        ...

    @property
    def capture(self) -> Capture:
        """Its graphs, kernels, config and versions."""
        ...

    @property
    def buffers(self) -> Buffers:
        """Shape label -> kernel id -> that forward's recorded buffers."""
        ...

    @property
    def startup_s(self) -> float:
        """Seconds from start to a compiled, ready engine."""
        ...

    def sample(self, prompts: Sequence[list[int]], *, max_tokens: int, seed: int = 0,
               temperature: float = 1.0) -> list[EngineSample]:
        """One continuation per prompt (request i seeded with seed + i), each sampled token's log-prob, and the
        whole sequence scored in one prefill (`score`)."""
        ...

    def score(self, samples: Sequence[EngineSample]) -> None:
        """Each sample's tokens scored in one prefill of prompt + continuation, into `prefill_logprobs`."""
        ...

    def record_routing(self, samples: Sequence[EngineSample], progress: Progress) -> None:
        """MoE: the experts the engine chose for every token of each sample, into `routing`; nothing for a dense
        model."""
        ...

    def stop(self) -> None:
        """Free the engine and its threads, so another can start in this process."""
        ...
