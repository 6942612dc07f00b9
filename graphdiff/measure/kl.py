"""The engine-vs-trainer log-prob gap on the engine's own samples (the paper's KL estimate).

The engine side (the engine's `gap_samples`, found by name in graphdiff.engines) samples once and caches the
samples with the engine's log-probs. The trainer recomputes the same tokens (graphdiff.measure.logprobs.train_logprobs),
with any callable model (eager, torch.compile'd, patched), so one set of engine samples serves many patch subsets.

diff = logp_engine - logp_train per token (FP32 values, differences in float64):
k1 = mean(diff), the paper's per-token KL estimate (engine -> trainer, tokens drawn from the engine);
k3 = mean(exp(r) - 1 - r), r = -diff: also unbiased for KL(engine || trainer), but >= 0 per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphdiff import engines, runtime
from graphdiff.engines.base import EngineOptions
from graphdiff.engines.samples import SAMPLES_FILE, random_prompts, read_prompts
from graphdiff.errors import GraphdiffError
from graphdiff.measure import routing
from graphdiff.measure.logprobs import engine_logprobs, per_token, train_logprobs, trainer
from graphdiff.records import (
    Attribution,
    EngineMode,
    EngineSample,
    GapName,
    GapSource,
    KLMeasurement,
    KLResult,
    PositionBin,
    Progress,
    RoutingAgreement,
    TrainerMode,
)

__all__ = ["SAMPLES_FILE", "random_prompts", "read_prompts", "measure", "gap_metrics", "subset_gaps"]

BUCKET = 128  # position buckets of the gap curve, in tokens
DEFAULT_MAX_TOKENS = 1024  # long enough to show how the gap grows with position

def floor(samples: Sequence[EngineSample]) -> KLMeasurement | None:
    """The engine's own floor: its decode log-probs vs its prefill scoring of the same sequences. A trainer that
    rounds exactly where the engine rounds still sees this gap (it scores whole sequences at once)."""
    if not samples or any(len(s.prefill_logprobs) != len(s.tokens) for s in samples):
        return None
    return gap_metrics(engine_logprobs(samples), engine_logprobs(samples, prefill=True), engine_mode="compiled",
                       trainer_mode="engine-prefill", label="floor: the engine's decode vs its own prefill scoring")


# --- metrics -------------------------------------------------------------------------------------------------

def position_curve(diffs: Sequence[torch.Tensor], same: Sequence[torch.Tensor],
                   width: int = BUCKET) -> list[PositionBin]:
    """k1, k3, RMS and the bit-identical fraction of the diff over continuation positions, `width` at a time."""
    length = max((len(d) for d in diffs), default=0)
    curve = []
    for start in range(0, length, width):
        part = torch.cat([d[start: start + width] for d in diffs])
        if part.numel():
            k3 = torch.expm1(-part) + part
            equal = torch.cat([s[start: start + width] for s in same])
            curve.append(PositionBin(start=start, stop=min(start + width, length), tokens=part.numel(),
                                     k1=float(part.mean()), rms=float(part.pow(2).mean().sqrt()), k3=float(k3.mean()),
                                     bitexact_fraction=float(equal.double().mean())))
    return curve


def gap_metrics(engine: Sequence[torch.Tensor], train: Sequence[torch.Tensor], *, engine_mode: EngineMode,
                trainer_mode: TrainerMode, regions: Sequence[str] | None = None, width: int = BUCKET,
                label: str = "") -> KLMeasurement:
    diffs = per_token(engine, train)
    d = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if d.numel() == 0:
        raise GraphdiffError("no sampled tokens to measure")
    same = [e.float() == t.float() for e, t in zip(engine, train)]
    k3 = per_token(engine, train, "k3")
    return KLMeasurement(
        engine_mode=engine_mode, trainer_mode=trainer_mode, regions=list(regions) if regions is not None else None,
        k1=float(d.mean()), k1_se=k1_standard_error(diffs), k3=float(torch.cat(k3).mean()),
        k3_se=k1_standard_error(k3), rms=float(d.pow(2).mean().sqrt()), max_abs=float(d.abs().max()),
        bitexact_fraction=float(torch.cat(same).double().mean()), tokens=d.numel(), sequences=len(diffs),
        position=position_curve(diffs, same, width), label=label,
    )


def k1_standard_error(diffs: Sequence[torch.Tensor]) -> float | None:
    """Standard error of a per-token mean (k1, or k3 given its terms) with sequences as the independent units
    (tokens of one sequence share context): the cluster-robust error of a ratio of sums. None with fewer than two
    sequences."""
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
    """The regions a manifest patches by default (generated and enabled)."""
    return [r.name for r in runtime.load_manifest(manifest).regions if r.generated and r.enabled]


# --- the whole measurement ---------------------------------------------------------------------------------

def check_request(config: dict, prompts: Sequence[list[int]], max_tokens: int, metric: str, attribute: bool,
                  manifest: Path | None) -> None:
    """Refuse, before any engine starts, a measurement that cannot run."""
    from graphdiff.capture.shapes import max_positions

    if max_tokens < 1:
        raise GraphdiffError("--max-tokens must be at least 1")
    longest = max(map(len, prompts)) + max_tokens
    if longest > max_positions(config):
        raise GraphdiffError(f"a {max(map(len, prompts))}-token prompt plus --max-tokens {max_tokens} needs {longest} "
                             f"positions; the model has {max_positions(config)} (max_position_embeddings)")
    if metric not in ("k1", "k3"):
        raise GraphdiffError(f"unknown metric {metric!r}; choose k1 or k3")
    if attribute and manifest is None:
        raise GraphdiffError("--attribute needs --manifest (the patches to attribute the gap to)")


def _logprobs_and_routing(model: Callable[..., Any], run: Sequence[EngineSample], trainer_label: str
                          ) -> tuple[list[torch.Tensor], list[RoutingAgreement]]:
    """The trainer's log-probs of the samples and, where the engine recorded its expert choices (MoE), how often
    the trainer's choices differ from them on the same tokens, per layer."""
    if not routing.has_routing(run) or not isinstance(model, torch.nn.Module):  # expert choices: module hooks
        return train_logprobs(model, run), []
    lps, found = [], []
    with routing.trainer_topk(model) as rec:
        for s in run:
            rec.calls = {}
            lps += train_logprobs(model, [s])
            found.append(routing.differing(s.routing, rec.calls))
    return lps, routing.agreement(found, routing.label(run), trainer_label)


def _trainer_measurements(base: torch.nn.Module, samples: dict, trainer_modes: Sequence[TrainerMode],
                          manifest: Path | None, regions: Sequence[str] | None, patched: list[str] | None,
                          progress: Progress) -> tuple[list[KLMeasurement], list[RoutingAgreement]]:
    """Every trainer mode, unpatched and (with a manifest) patched, against every engine mode's samples; the
    eager trainers' routing agreement with the compiled engine (MoE)."""
    out, agree = [], []
    for tmode in trainer_modes:
        for patch in [None, patched] if manifest is not None else [None]:
            label = f"trainer {tmode}" + (f" + {'+'.join(patch)}" if patch else "")
            if tmode == "compiled":
                progress(f"{label}: torch.compile (inductor); the first sequence compiles")
            with trainer(base, tmode, manifest if patch is not None else None,
                         regions if patch is not None else None) as model:
                for emode, found in samples.items():
                    run = found.samples
                    progress(f"{label} vs engine {emode}: {len(run)} sequences, "
                             f"{sum(len(s.tokens) for s in run)} tokens")
                    if tmode == "eager" and emode == "compiled":
                        lps, found = _logprobs_and_routing(model, run, "patched" if patch else "unpatched")
                        agree += found
                    else:
                        lps = train_logprobs(model, run)
                    out.append(gap_metrics(engine_logprobs(run), lps, engine_mode=emode, trainer_mode=tmode,
                                           regions=patch))
    return out, agree


def _attribution(base: torch.nn.Module, manifest: Path, names: list[str], run: Sequence[EngineSample], metric: str,
                 bootstrap: int, seed: int, progress: Progress) -> tuple[Attribution, list[str]]:
    """Shapley over the regions on the compiled engine's samples (the paper's setting: eager trainer)."""
    from graphdiff.measure.shapley import attribute as shapley_attribute

    gaps = subset_gaps(base, manifest, names, run, metric=metric, progress=progress)
    attribution = shapley_attribute(gaps, [len(s.tokens) for s in run], names, metric=metric, bootstrap=bootstrap,
                                    seed=seed)
    # The empty subset is the unpatched model; the runtime with no region aligned should equal it bit for bit.
    plain = train_logprobs(base, run)
    with trainer(base, "eager", manifest, []) as model:
        none = train_logprobs(model, run)
    off = max((float((a - b).abs().max()) for a, b in zip(none, plain) if a.numel()), default=0.0)
    return attribution, ([f"runtime.apply(regions=[]) is not bit-identical to the unpatched model "
                          f"(max |dlogp| {off:.3g})"] if off else [])


REST_LIMIT = 0.05  # the share of the patched gap that may stay unnamed in a bucket
TARGET_OF_UNPATCHED = 0.05  # the patched RMS may be this share of the unpatched RMS in a bucket ...
TARGET_OF_FLOOR = 1.1  # ... or this multiple of the engine floor's RMS


def at_target(unpatched: PositionBin, patched: PositionBin, floor_bin: PositionBin | None) -> bool:
    """Whether a bucket's patched gap is at the engine: RMS at most the larger of 5% of the unpatched RMS and 1.1x
    the floor's; where the floor is bit-identical (0), the patched log-probs must be bit-identical too."""
    if floor_bin is not None and floor_bin.bitexact_fraction == 1.0:
        return patched.bitexact_fraction == 1.0
    limit = max(TARGET_OF_UNPATCHED * unpatched.rms, TARGET_OF_FLOOR * (floor_bin.rms if floor_bin else 0.0))
    return patched.rms <= limit


def floor_ratio(patched: PositionBin, floor_bin: PositionBin) -> str:
    """Patched RMS / floor RMS, for the terminal: '= floor' where both are 0, 'inf' where only the floor is."""
    if floor_bin.rms:
        return f"{patched.rms / floor_bin.rms:.2f}"
    return "= floor" if patched.rms == 0 else "inf"


def gap_sources(patched: KLMeasurement, substituted: KLMeasurement | None,
                floor_m: KLMeasurement | None) -> list[GapSource]:
    """The patched gap per bucket as attention order (what the engine's attention op removes), the engine's own
    floor (its decode vs its prefill), and the rest (what remains beyond the floor with the engine's op). Without
    the engine's op (`substituted` None) the rest holds attention's order too."""
    total = [b.rms ** 2 for b in patched.position]
    sub = [b.rms ** 2 for b in substituted.position] if substituted is not None else total
    fl = [b.rms ** 2 for b in floor_m.position] if floor_m is not None else [0.0] * len(total)
    parts: list[tuple[GapName, str, list[float]]] = [
        ("engine floor", "the engine's decode vs its own prefill scoring (ms)", fl),
        ("rest", "patched trainer with the engine's attention op, minus the floor (ms)" if substituted is not None
         else "patched trainer minus the floor, attention's order included (ms)", [a - f for a, f in zip(sub, fl)])]
    if substituted is not None:
        parts.insert(0, ("attention order", "patched trainer minus the same with the engine's attention op (ms)",
                         [t - a for t, a in zip(total, sub)]))
    return [GapSource(name=n, what=w, ms=ms, share=[m / t if t else 0.0 for m, t in zip(ms, total)])
            for n, w, ms in parts]


def rest_buckets(sources: Sequence[GapSource], limit: float = REST_LIMIT) -> list[int]:
    """Buckets where the unnamed rest is more than `limit` of the patched gap."""
    rest = next((s for s in sources if s.name == "rest"), None)
    return [i for i, share in enumerate(rest.share) if share > limit] if rest is not None else []


def left_out(manifest: Path) -> list[str]:
    """The regions the scan found that the patch does not apply, each with why: not generated, or left out by the
    gate (they are in the patched gap, by name)."""
    return [f"{r.name}: {r.reason if not r.generated else 'left out: measured to widen the gap'}"
            for r in runtime.load_manifest(manifest).regions if not r.generated or not r.enabled]


def _sources(model_dir: Path, manifest: Path, patched: list[str], run: Sequence[EngineSample],
             measurements: list[KLMeasurement], floor_m: KLMeasurement | None,
             progress: Progress) -> tuple[KLMeasurement | None, list[GapSource], str]:
    """The attention-order diagnostic, where the patch aligns attention's rounding (else its order is not the
    only difference left there) and the engine's op can run here."""
    from graphdiff.measure.engine_attention import patched_logprobs

    kinds = {r.name: r.kind for r in runtime.load_manifest(manifest).regions}
    fixed = next((m for m in measurements if m.regions and m.engine_mode == "compiled" and m.trainer_mode == "eager"),
                 None)
    if fixed is None:
        return None, [], ""
    if not any(kinds.get(r) == "attention" for r in patched):
        return None, gap_sources(fixed, None, floor_m), ("no attention region is patched: attention's accumulation "
                                                          "order is not separated from the rest")
    try:
        lps = patched_logprobs(model_dir, manifest, patched, run, progress)
    except GraphdiffError as e:
        return None, gap_sources(fixed, None, floor_m), f"attention order not measured (it is in the rest): {e}"
    sub = gap_metrics(engine_logprobs(run), lps, engine_mode="compiled", trainer_mode="eager", regions=patched,
                      label="patched trainer with the engine's attention op (diagnostic)")
    return sub, gap_sources(fixed, sub, floor_m), ""


def _floor_ops(model_dir: Path, floor_m: KLMeasurement | None, prompts: Sequence[list[int]], max_tokens: int,
               probes: bool, progress: Progress) -> list[str]:
    """Where the engine's decode differs from its own prefill: its ops probed for batch variance at this model's
    shapes, the decode step's M being the prompts decoding in lockstep (measure.floor_ops); `probes`: the engine's
    ops can be probed so (its kind's PROBES_FLOOR)."""
    if floor_m is None or floor_m.bitexact_fraction >= 1.0 or not probes:
        return []
    from graphdiff.measure.floor_ops import floor_ops

    prompt_len = max(len(p) for p in prompts)
    try:
        return floor_ops(model_dir, prompt_len + max_tokens, prompt_len, len(prompts), progress)
    except GraphdiffError as e:
        return [f"not probed: {e}"]


def _patched_regions(base: torch.nn.Module, manifest: Path | None,
                     regions: Sequence[str] | None) -> list[str] | None:
    """The regions the patched trainer applies (None: no manifest); a bad manifest fails now, before the engine."""
    if manifest is None:
        return None
    with trainer(base, "eager", manifest, regions):
        pass
    return list(regions) if regions is not None else manifest_regions(manifest)


def measure(model_dir: Path, prompts: Sequence[list[int]], *, options: EngineOptions | None = None,
            max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0, temperature: float = 1.0, modes: bool = False,
            manifest: Path | None = None, regions: Sequence[str] | None = None, attribute: bool = False,
            metric: str = "k3", bootstrap: int = 1000, out_dir: Path | None = None, isolate: bool = True,
            progress: Progress = lambda m: None, reproduce: str = "") -> KLResult:
    """Engine samples (compiled; with `modes` also eager) x trainer (eager; with `modes` also compiled),
    each trainer also patched by `manifest` when given; the engine's own floor; with `attribute`, Shapley over the
    regions. The engine is `options.engine` as `options` start it (`--engine inductor`: the torch.compile'd model's
    teacher-forced scores are the samples).

    The attribution's `metric` defaults to k3: k1 and k3 estimate the same KL without bias, but k1's
    per-token terms have both signs and are ~rms in size, so at thousands of tokens its noise (see
    k1_se) swamps the differences between patch subsets; k3's terms are ~diff^2/2 and >= 0.
    """
    import transformers

    import graphdiff
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.models.resolve import architecture, read_config

    options = options or EngineOptions()
    kind = engines.kind(options.engine)
    config = read_config(model_dir)
    check_request(config, prompts, max_tokens, metric, attribute, manifest)
    t0 = time.perf_counter()
    base = load_hf_model(model_dir)
    patched = _patched_regions(base, manifest, regions)
    engine_modes: list[EngineMode] = ["compiled", "eager"] if modes else ["compiled"]
    trainer_modes: list[TrainerMode] = ["eager", "compiled"] if modes else ["eager"]
    samples = kind.gap_samples(model_dir, prompts, engine_modes, options, max_tokens=max_tokens, seed=seed,
                               temperature=temperature, out_dir=out_dir, isolate=isolate, progress=progress)
    t_engine = time.perf_counter()
    measurements, agree = _trainer_measurements(base, samples, trainer_modes, manifest, regions, patched, progress)
    attribution = None
    tp = options.tensor_parallel_size
    notes = [f"engine: tensor_parallel_size {tp}"] if tp > 1 else []
    if attribute:
        assert manifest is not None and patched is not None
        attribution, more = _attribution(base, manifest, patched, samples["compiled"].samples, metric, bootstrap,
                                         seed, progress)
        notes += more
    floor_m = floor(samples["compiled"].samples)
    substituted, sources, sources_note = (_sources(model_dir, manifest, patched, samples["compiled"].samples,
                                                   measurements, floor_m, progress)
                                          if manifest is not None and patched else (None, [], ""))
    first = samples[engine_modes[0]]
    return KLResult(
        model=str(model_dir), architecture=architecture(config), seed=seed, temperature=temperature,
        max_tokens=max_tokens, prompts=len(prompts),
        method=kind.GAP_METHOD.format(temperature=temperature, seed=seed),
        versions={**first.versions, "transformers": transformers.__version__, "graphdiff": graphdiff.__version__},
        measurements=measurements, floor=floor_m, bucket=BUCKET, engine_attention=substituted, sources=sources,
        sources_note=sources_note, left_out=left_out(manifest) if manifest is not None else [],
        compilation_config=options.asked, attribution=attribution,
        manifest=str(manifest) if manifest else None,
        timings={"engine_s": round(t_engine - t0, 3), "trainer_s": round(time.perf_counter() - t_engine, 3)},
        reproduce=reproduce, notes=notes, routing=agree,
        floor_ops=_floor_ops(model_dir, floor_m, prompts, max_tokens, kind.PROBES_FLOOR, progress))
