"""vLLM as the engine registry finds it by the name vllm (`EngineKind`): its checks before it starts, its start in
this process (engine.py), its capture in a child process (process.py) and its samples for the gap (session.py).
Behind them: its start (start.py, cpu.py, options.py), its capture in this process (capture.py) or every rank's
(tp.py, tp_worker.py). Everything vLLM-specific is imported when called."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from graphdiff.engines.base import Engine, EngineOptions, cpu_only
from graphdiff.errors import GraphdiffError
from graphdiff.records import Buffers, Capture, EngineMode, EngineSamples, Progress, SampleRequest, Shape

NAME = "vllm"
MODES: tuple[EngineMode, ...] = ("compiled", "eager")
PREFILL_ONLY = False
PROBES_FLOOR = True  # measure.floor_ops runs vLLM CPU's GEMM dispatch and attention at the model's shapes
GAP_METHOD = (
    "engine: vLLM samples (temperature {temperature}, seed {seed}+i per prompt, EOS ignored) and returns each sampled "
    "token's log-prob from its sampler (raw_logprobs = log_softmax(BF16 logits, dtype=float32), KV-cache decoding); "
    "trainer: HF transformers, BF16 weights, one teacher-forced forward per sequence over prompt+continuation (batch "
    "1, no padding, use_cache=False), log_softmax(BF16 logits, dtype=float32) at the sampled tokens; trainer "
    "'compiled' = torch.compile(model) (inductor, default mode); engine 'eager' = enforce_eager=True; "
    "diff = logp_engine - logp_train in float64 of the FP32 values; floor: the engine's decode log-probs vs its "
    "prompt_logprobs scoring of the same prompt+continuation in one prefill"
)


def check(options: EngineOptions, shapes: Sequence[Shape] | None = None, capture: bool = False) -> None:
    """vLLM's options checked before it starts: the compilation config against the installed vLLM's own, -O's range,
    no --device (it runs where it was built); `capture`: a compiled graph to capture (not -O 0, not mode 0)."""
    from graphdiff.engines.vllm.cpu import check_options
    from graphdiff.engines.vllm.options import check_compilation_config

    cpu_only(options.device)
    if capture:
        check_options(options.config, options.optimization_level)
        return
    check_compilation_config(options.config)
    if options.optimization_level is not None and options.optimization_level not in (0, 1, 2, 3):
        raise GraphdiffError(f"-O {options.optimization_level}: vLLM has optimization levels 0 to 3")


def start(model_dir: Path, shapes: list[Shape], options: EngineOptions, progress: Progress) -> Engine:
    """vLLM on `model_dir` in this process, compiled with `options`, its kernels recorded at every shape."""
    from graphdiff.engines.vllm import engine

    return engine.start(model_dir, shapes, options, progress)


def capture_isolated(model_dir: Path, shapes: list[Shape], directory: Path, options: EngineOptions, *,
                     progress: Progress = lambda m: None, config_sha256: str = "",
                     sample: SampleRequest | None = None) -> tuple[Capture, Buffers, float]:
    """vLLM's capture in a child process (engines/vllm/process.py)."""
    from graphdiff.engines.vllm import process

    return process.capture_isolated(model_dir, shapes, directory, compilation_config=options.compilation_config,
                                    optimization_level=options.optimization_level, progress=progress,
                                    config_sha256=config_sha256, sample=sample,
                                    tensor_parallel_size=options.tensor_parallel_size)


def gap_samples(model_dir: Path, prompts: Sequence[list[int]], modes: Sequence[EngineMode], options: EngineOptions,
                *, max_tokens: int, seed: int = 0, temperature: float = 1.0, out_dir: Path | None = None,
                isolate: bool = True, progress: Progress = lambda m: None) -> dict[EngineMode, EngineSamples]:
    """vLLM's samples with their log-probs (engines/vllm/session.py)."""
    from graphdiff.engines.vllm.session import sample_engine

    return sample_engine(model_dir, prompts, modes, max_tokens=max_tokens, seed=seed, temperature=temperature,
                         out_dir=out_dir, isolate=isolate, progress=progress, compilation_config=options.asked,
                         tensor_parallel_size=options.tensor_parallel_size)
