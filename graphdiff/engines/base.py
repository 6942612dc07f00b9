"""The engine interface: what a scan asks of an inference engine, whichever engine it is.

An engine starts on a checkpoint with `EngineOptions`, compiles the model, and hands back its compiled graphs as a
`Capture` with the kernel buffers of one forward per asked shape (what the replay re-runs). A live engine also
samples continuations with their log-probs and scores whole sequences in one prefill (the gap's reference), records
which experts it routed each token to (MoE), and stops. A recorded dump is an engine that only has graphs.

Each engine's module (`EngineKind`, found by name in `engines.ENGINES`) also says what a scan needs before and
around a start: which options it refuses, its capture made in a child process, its samples for the gap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from graphdiff.errors import GraphdiffError
from graphdiff.records import (
    Buffers,
    Capture,
    EngineMode,
    EngineSample,
    EngineSamples,
    Progress,
    SampleRequest,
    Shape,
)


def asked_config(compilation_config: dict, optimization_level: int | None) -> dict:
    """The compilation config as asked, with the -O level under "optimization_level" (what restarts the engine)."""
    return {**compilation_config, **({"optimization_level": optimization_level} if optimization_level is not None
                                     else {})}


def split_level(asked: dict) -> tuple[dict, int | None]:
    """asked_config's inverse: the compilation config without its "optimization_level", and that -O level."""
    config = dict(asked)
    level = config.pop("optimization_level", None)
    return config, int(level) if level is not None else None


DEFAULT_ENGINE = "vllm"  # `--engine`'s default, and the engine of a record made before it named one


def recorded_engine(engine_config: dict) -> str:
    """The engine a scan's or manifest's effective engine config was recorded from."""
    return str(engine_config.get("engine", DEFAULT_ENGINE))


def cpu_only(device: str) -> None:
    """Refuse `--device` other than cpu for what runs where it was built (vLLM, a recorded dump, the trainer)."""
    if device != "cpu":
        raise GraphdiffError(f"--device {device}: only --engine inductor takes --device (vLLM runs where it was "
                             "built)")


@dataclass
class EngineOptions:
    """How the engine is started: which engine, what a user passes to `vllm serve`, and the capture's own settings.
    The one record of them that the CLI, the pipeline, the measurements and `check` pass along."""

    engine: str = DEFAULT_ENGINE  # as `--engine` names it (engines.ENGINES)
    # as `vllm serve --compilation-config`; None: not given (a fresh engine: none; a recorded capture: its own)
    compilation_config: dict[str, Any] | None = None
    optimization_level: int | None = None  # as `vllm serve -O N`
    layers: int | None = None  # override num_hidden_layers (hf_overrides)
    debug_dir: Path | None = None  # keep the TORCH_COMPILE_DEBUG dump here
    min_model_len: int = 0  # room for sampling on the same engine after the capture (prompt + tokens)
    min_seqs: int = 0
    tensor_parallel_size: int = 1  # as `vllm serve --tensor-parallel-size`: > 1 captures every rank
    device: str = "cpu"  # where the engine runs (`--device`; `--engine inductor` runs on cpu or cuda)

    @property
    def config(self) -> dict[str, Any]:
        """The compilation config to start with (none given: empty)."""
        return dict(self.compilation_config or {})

    @property
    def asked(self) -> dict[str, Any]:
        """The compilation config with the -O level in it, as a scan records it and a restart reads it."""
        return asked_config(self.config, self.optimization_level)

    def with_asked(self, asked: dict) -> EngineOptions:
        """These options with the compilation config and -O level of `asked` (a recorded `asked`)."""
        config, level = split_level(asked)
        return replace(self, compilation_config=config, optimization_level=level)


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


class EngineKind(Protocol):
    """An engine's module as the registry finds it (`engines.kind(name)`): what a scan needs around a start."""

    NAME: str
    MODES: tuple[EngineMode, ...]  # the engine modes it samples the gap in (compiled first)
    PREFILL_ONLY: bool  # it records prefills only (no KV cache to decode with)
    GAP_METHOD: str  # how its side of the gap is measured ({temperature}, {seed})
    PROBES_FLOOR: bool  # its ops can be probed for batch variance where its decode differs from its prefill

    def check(self, options: EngineOptions, shapes: Sequence[Shape] | None = None, capture: bool = False) -> None:
        """Refuse, in one line before anything starts, options (and shapes) this engine cannot run; `capture`: what
        it must run for a capture of its compiled graphs."""
        ...

    def start(self, model_dir: Path, shapes: list[Shape], options: EngineOptions, progress: Progress) -> Engine:
        """The engine started in this process, its kernels recorded at every shape."""
        ...

    def capture_isolated(self, model_dir: Path, shapes: list[Shape], directory: Path, options: EngineOptions, *,
                         progress: Progress = lambda m: None, config_sha256: str = "",
                         sample: SampleRequest | None = None) -> tuple[Capture, Buffers, float]:
        """The engine's capture made in a child process into `directory` (engines/store.py) and read back, with its
        start-up time; `sample`: the same engine then samples (or scores) those prompts into out_dir."""
        ...

    def gap_samples(self, model_dir: Path, prompts: Sequence[list[int]], modes: Sequence[EngineMode],
                    options: EngineOptions, *, max_tokens: int, seed: int = 0, temperature: float = 1.0,
                    out_dir: Path | None = None, isolate: bool = True,
                    progress: Progress = lambda m: None) -> dict[EngineMode, EngineSamples]:
        """The engine's side of the gap per mode: from OUT/engine_samples.json when cached there, else from the
        engine (started in a child process unless `isolate` is False)."""
        ...
