"""The engine-vs-trainer log-prob gap on the engine's own samples (the paper's KL estimate).

The engine side (graphdiff.measure.engine) samples once and caches the samples with the engine's
log-probs. The trainer recomputes the same tokens: `train_logprobs(model, sequences)`, one
teacher-forced HF forward per sequence over prompt + continuation (BF16 weights, batch 1, no
padding, no KV cache), `log_softmax(-1, dtype=float32)` of its BF16 logits — the engine sampler's
own formula — gathered at the sampled tokens. It takes any callable model (eager, torch.compile'd,
patched), so a caller can re-run it for many patch subsets against one set of engine samples.

diff = logp_engine - logp_train per token (FP32 values, differences in float64):
k1 = mean(diff), the paper's per-token KL estimate (engine -> trainer, tokens drawn from the engine);
k3 = mean(exp(r) - 1 - r), r = -diff: also unbiased for KL(engine || trainer), but >= 0 per token.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from graphdiff import runtime
from graphdiff.errors import GraphdiffError
from graphdiff.measure.engine import SAMPLES_FILE, random_prompts, read_prompts, sample_engine
from graphdiff.model import EngineMode, EngineSample, KLMeasurement, KLResult, PositionBin, TrainerMode

__all__ = ["SAMPLES_FILE", "random_prompts", "read_prompts", "sample_engine", "measure", "train_logprobs",
           "gap_metrics", "subset_gaps"]

Progress = Callable[[str], None]
POSITION_BINS = 8
DEFAULT_MAX_TOKENS = 64

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


# --- trainer side --------------------------------------------------------------------------------------------

def apply_manifest(model: torch.nn.Module, manifest: Path, regions: Sequence[str] | None = None) -> torch.nn.Module:
    """The model with the manifest's patches (all, or `regions`) applied by the training runtime, in place."""
    return runtime.apply(model, manifest, regions=list(regions) if regions is not None else None)


@contextlib.contextmanager
def trainer(base: torch.nn.Module, mode: TrainerMode = "eager", manifest: Path | None = None,
            regions: Sequence[str] | None = None) -> Iterator[Callable[..., Any]]:
    """The HF model as the trainer runs it: BF16, eager or torch.compile'd, optionally patched.

    Patches go on a copy of `base`, before compile (the compiled graph must contain them, as in training), and
    come off on exit; the runtime dispatches per model, so `base` itself stays unpatched meanwhile.
    """
    model = apply_manifest(copy.deepcopy(base), manifest, regions) if manifest is not None else base
    try:
        yield torch.compile(model, backend="inductor") if mode == "compiled" else model
    finally:
        if manifest is not None:
            runtime.remove(model)


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
        k1=float(d.mean()), k1_se=k1_standard_error(diffs), k3=float(torch.cat(per_token(engine, train, "k3")).mean()),
        rms=float(d.pow(2).mean().sqrt()), max_abs=float(d.abs().max()), bitexact_fraction=float(same.double().mean()),
        tokens=d.numel(), sequences=len(diffs), position=position_curve(diffs, bins),
    )


def k1_standard_error(diffs: Sequence[torch.Tensor]) -> float | None:
    """Standard error of k1 with sequences as the independent units (tokens of one sequence share context):
    the cluster-robust error of a ratio of sums. None with fewer than two sequences."""
    sums = np.array([float(d.sum()) for d in diffs])
    counts = np.array([d.numel() for d in diffs], dtype=np.float64)
    m = len(diffs)
    if m < 2 or counts.sum() == 0:
        return None
    resid = sums - sums.sum() / counts.sum() * counts
    return float(np.sqrt(m / (m - 1) * np.sum(resid**2)) / counts.sum())


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
        with trainer(base, mode, manifest if names else None, names) as model:
            return sequence_sums(engine, train_logprobs(model, samples), metric)

    return gaps


def manifest_regions(manifest: Path) -> list[str]:
    """The regions a manifest patches (those it generated)."""
    return [r.name for r in runtime.load_manifest(manifest).regions if r.generated]


# --- the whole measurement ---------------------------------------------------------------------------------

def measure(model_dir: Path, prompts: Sequence[list[int]], *, max_tokens: int, seed: int = 0,
            temperature: float = 1.0, modes: bool = False, manifest: Path | None = None,
            regions: Sequence[str] | None = None, attribute: bool = False, metric: str = "k3", bootstrap: int = 1000,
            out_dir: Path | None = None, isolate: bool = True, progress: Progress = lambda m: None,
            reproduce: str = "", compilation_config: dict | None = None,
            tensor_parallel_size: int = 1) -> KLResult:
    """Engine samples (compiled; with `modes` also eager) x trainer (eager; with `modes` also compiled),
    each trainer also patched by `manifest` when given; with `attribute`, Shapley over the regions.

    The attribution's `metric` defaults to k3: k1 and k3 estimate the same KL without bias, but k1's
    per-token terms have both signs and are ~rms in size, so at thousands of tokens its noise (see
    k1_se) swamps the differences between patch subsets; k3's terms are ~diff^2/2 and >= 0.
    """
    import transformers

    import graphdiff
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.measure.shapley import attribute as shapley_attribute
    from graphdiff.resolve import architecture, read_config

    config = read_config(model_dir)
    if max_tokens < 1:
        raise GraphdiffError("--max-tokens must be at least 1")
    if metric not in ("k1", "k3"):
        raise GraphdiffError(f"unknown metric {metric!r}; choose k1 or k3")
    if attribute and manifest is None:
        raise GraphdiffError("--attribute needs --manifest (the patches to attribute the gap to)")
    t0 = time.perf_counter()
    base = load_hf_model(model_dir)
    patched_label: list[str] | None = None
    names: list[str] = []
    if manifest is not None:  # a bad manifest or a missing runtime fails now, not after the engine ran
        with trainer(base, "eager", manifest, regions):
            pass
        patched_label = list(regions) if regions is not None else manifest_regions(manifest)
        if attribute:
            names = list(regions) if regions is not None else manifest_regions(manifest)
    engine_modes: list[EngineMode] = ["compiled", "eager"] if modes else ["compiled"]
    trainer_modes: list[TrainerMode] = ["eager", "compiled"] if modes else ["eager"]
    samples = sample_engine(model_dir, prompts, engine_modes, max_tokens=max_tokens, seed=seed,
                            temperature=temperature, out_dir=out_dir, isolate=isolate, progress=progress,
                            compilation_config=compilation_config,
                            **({"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}))
    t_engine = time.perf_counter()
    measurements = []
    notes = [f"engine: tensor_parallel_size {tensor_parallel_size}"] if tensor_parallel_size > 1 else []
    for tmode in trainer_modes:
        for patch in [None, patched_label] if manifest is not None else [None]:
            label = f"trainer {tmode}" + (f" + {'+'.join(patch)}" if patch else "")
            if tmode == "compiled":
                progress(f"{label}: torch.compile (inductor); the first sequence compiles")
            with trainer(base, tmode, manifest if patch is not None else None,
                         regions if patch is not None else None) as model:
                for emode in engine_modes:
                    run = samples[emode].samples
                    progress(f"{label} vs engine {emode}: {len(run)} sequences, "
                             f"{sum(len(s.tokens) for s in run)} tokens")
                    train = train_logprobs(model, run)
                    measurements.append(gap_metrics(engine_logprobs(run), train, engine_mode=emode,
                                                    trainer_mode=tmode, regions=patch))
    attribution = None
    if attribute:
        assert manifest is not None
        run = samples["compiled"].samples  # the paper's setting: compiled engine, eager trainer
        gaps = subset_gaps(base, manifest, names, run, metric=metric, progress=progress)
        attribution = shapley_attribute(gaps, [len(s.tokens) for s in run], names, metric=metric,
                                        bootstrap=bootstrap, seed=seed)
        # The empty subset is the unpatched model; the runtime with no region aligned should equal it bit for bit.
        plain = train_logprobs(base, run)
        with trainer(base, "eager", manifest, []) as model:
            none = train_logprobs(model, run)
        off = max((float((a - b).abs().max()) for a, b in zip(none, plain) if a.numel()), default=0.0)
        if off:
            notes.append(f"runtime.apply(regions=[]) is not bit-identical to the unpatched model "
                         f"(max |dlogp| {off:.3g})")
    first = samples[engine_modes[0]]
    return KLResult(
        model=str(model_dir), architecture=architecture(config), seed=seed, temperature=temperature,
        max_tokens=max_tokens, prompts=len(prompts), method=METHOD.format(temperature=temperature, seed=seed),
        versions={**first.versions, "transformers": transformers.__version__, "graphdiff": graphdiff.__version__},
        measurements=measurements, attribution=attribution, manifest=str(manifest) if manifest else None,
        timings={"engine_s": round(t_engine - t0, 3), "trainer_s": round(time.perf_counter() - t_engine, 3)},
        reproduce=reproduce, notes=notes,
    )
