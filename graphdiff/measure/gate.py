"""The shipped patch never widens the gap: every generated region measured, a region that widens it left out.

On the engine's own samples (fixed), each trainer pass applies a set of regions. Starting from every generated
region, each region's effect is what removing it changes (leave-one-out, k3 over every sampled token, with a
paired bootstrap interval over sequences); while one widens the gap, the worst is left out and the rest measured
again. If what remains does not narrow the gap against the unpatched trainer measurably (k3 and RMS lower, and
the 95% interval of the k3 change below zero), nothing is enabled. The manifest records every region's effect and
which are enabled; `runtime.apply` applies the enabled ones unless told otherwise. Beside its effect, each region's
cost: what its splice adds to a training step (`with_step_costs`).

A patch that claims exactness (`--exact`) is judged by equality, not by a gap estimate: a region is left out only
where removing it makes more of the trainer's log-probs equal the engine's prefill scoring of the same sequences (the
trainer's own task: one forward over each sequence), and the regions together ship where they make more tokens equal
than no patch does. Sampling noise in k3 cannot drop a region the engine's computation needs; each region's effect
says which criterion decided. Where the regions equality keeps do not make every token equal and widen k3 or the RMS,
the k3 criterion decides instead: a patch short of the engine never buys a few equal tokens with a wider gap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from graphdiff.measure.logprobs import engine_logprobs, per_token, train_logprobs, trainer
from graphdiff.records import EngineSample, Manifest, Progress, RegionEffect, ScanResult, save_json

BOOTSTRAP = 400


def _gap(base: torch.nn.Module, manifest: Path, regions: Sequence[str], samples: Sequence[EngineSample]
         ) -> tuple[np.ndarray, np.ndarray, float, int]:
    """Per-sequence k3 sums and token counts, the RMS of the diff, and how many tokens equal the engine's prefill
    scoring bit for bit, with `regions` applied."""
    engine = engine_logprobs(samples)
    with trainer(base, "eager", manifest if regions else None, list(regions)) as model:
        train = train_logprobs(model, samples)
    k3 = per_token(engine, train, "k3")
    diff = torch.cat(per_token(engine, train))
    prefill = engine_logprobs(samples, prefill=all(len(s.prefill_logprobs) == len(s.tokens) for s in samples))
    equal = sum(int((p == t.float()).sum()) for p, t in zip(prefill, train))
    return (np.array([float(x.sum()) for x in k3]), np.array([x.numel() for x in k3]),
            float(diff.pow(2).mean().sqrt()), equal)


@dataclass(frozen=True)
class Gap:
    k3: float
    rms: float
    tokens: int


def gap(base: torch.nn.Module, manifest: Path, regions: Sequence[str], samples: Sequence[EngineSample]) -> Gap:
    """k3 and the RMS of the diff over every sampled token, with `regions` of `manifest` applied."""
    k3, counts, rms, _ = _gap(base, manifest, regions, samples)
    return Gap(float(k3.sum() / counts.sum()), rms, int(counts.sum()))


def _interval(with_: np.ndarray, without: np.ndarray, counts: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the k3 difference (with - without), sequences resampled, paired."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(counts), size=(BOOTSTRAP, len(counts)))
    d = (with_[idx].sum(1) - without[idx].sum(1)) / counts[idx].sum(1)
    return float(np.quantile(d, 0.025)), float(np.quantile(d, 0.975))


def _leave_out(base: torch.nn.Module, manifest_path: Path, samples: Sequence[EngineSample], regions: list[str],
               by: str, progress: Progress) -> tuple[list[str], list[str], dict[str, RegionEffect], tuple | None]:
    """Leave-one-out from `regions`: while removing one improves the criterion `by` (fewer tokens equal the engine's
    prefill for "equality", a lower k3 for "k3"), the worst is left out. The enabled, the left out, each effect, and
    the enabled set's `_gap` (None where none is left)."""
    enabled, left_out, effects, final = list(regions), [], {}, None
    while enabled:
        final = full, counts, _, full_equal = _gap(base, manifest_path, enabled, samples)
        worst, worst_harm = None, 0.0
        for r in enabled:
            progress(f"without {r}")
            without, _, _, equal = _gap(base, manifest_path, [x for x in enabled if x != r], samples)
            delta = float((full.sum() - without.sum()) / counts.sum())
            effects[r] = RegionEffect(metric="k3", without=float(without.sum() / counts.sum()),
                                      with_=float(full.sum() / counts.sum()), delta=delta,
                                      ci=_interval(full, without, counts), tokens=int(counts.sum()),
                                      decided_by=by, equal_with=full_equal, equal_without=equal)
            harm = float(equal - full_equal) if by == "equality" else delta
            if harm > worst_harm:
                worst, worst_harm = r, harm
        if worst is None:
            break
        enabled.remove(worst)
        left_out.append(worst)
        final = None
    return enabled, left_out, effects, final


def select_regions(base: torch.nn.Module, manifest_path: Path, samples: Sequence[EngineSample],
                   progress: Progress = lambda m: None) -> Manifest:
    """Measure each generated region's effect, leave out those that widen the gap; writes the manifest back."""
    from graphdiff.runtime import load_manifest

    manifest = load_manifest(manifest_path)
    generated = [r.name for r in manifest.regions if r.generated]
    tokens = sum(len(s.tokens) for s in samples)
    by = "equality" if manifest.exact else "k3"
    progress(f"measuring the patch region by region on {len(samples)} engine samples ({tokens} tokens)")
    none_k3, counts, none_rms, none_equal = _gap(base, manifest_path, [], samples)
    k3_none = none_k3.sum() / counts.sum()
    notes = [n for n in manifest.notes if not n.startswith("measured:")]
    enabled, left_out, effects, final = _leave_out(base, manifest_path, samples, generated, by, progress)
    final_k3, _, final_rms, final_equal = final or (none_k3, counts, none_rms, none_equal)
    k3_final = final_k3.sum() / counts.sum()
    if by == "equality" and enabled and final_equal < counts.sum() and (k3_final > k3_none or final_rms > none_rms
                                                                         or final_equal <= none_equal):
        # equality decides while it reaches the engine; short of it, a few more equal tokens must not buy a wider gap,
        # and where no token is made equal it tells nothing: the gap decides
        why = (f"make {final_equal} of {int(counts.sum())} tokens equal the engine's prefill, not all, and widen the "
               f"gap (k3 {k3_none:.3g} -> {k3_final:.3g}, rms {none_rms:.4f} -> {final_rms:.4f})"
               if final_equal > none_equal else
               f"make no more tokens equal the engine's prefill ({none_equal} -> {final_equal} of {int(counts.sum())})")
        notes.append(f"measured: the regions kept by equality {why}: decided by k3 instead")
        by = "k3"
        enabled, left_out, effects, final = _leave_out(base, manifest_path, samples, generated, by, progress)
        final_k3, _, final_rms, final_equal = final or (none_k3, counts, none_rms, none_equal)
        k3_final = final_k3.sum() / counts.sum()
    # narrowed measurably: the 95% interval of the k3 change (sequences resampled, paired) lies below zero, so that
    # other samples do not see it widen (a change within the noise ships nothing); an exact patch: more tokens equal
    low, high = _interval(final_k3, none_k3, counts) if enabled else (0.0, 0.0)
    narrows = (final_equal > none_equal if by == "equality" else
               k3_final < k3_none and final_rms <= none_rms and high < 0)
    if enabled and not narrows:
        notes.append(f"measured: the generated regions together do not narrow the gap measurably (k3 {k3_none:.3g} "
                     f"-> {k3_final:.3g}, change 95% interval [{low:+.2g}, {high:+.2g}]; rms {none_rms:.4f} -> "
                     f"{final_rms:.4f}; tokens equal to the engine's prefill {none_equal} -> {final_equal} of "
                     f"{tokens}): none enabled")
        left_out += enabled
        enabled = []
        k3_final, final_rms, final_equal = k3_none, none_rms, none_equal
    for region in manifest.regions:
        region.enabled = region.name in enabled
        region.effect = effects.get(region.name, region.effect)
    for r in left_out:
        notes.append(f"measured: {r} left out" + _why_left_out(effects.get(r)))
    notes.append(f"measured: on {len(samples)} engine samples ({tokens} tokens) the enabled regions take k3 "
                 f"{k3_none:.3g} -> {k3_final:.3g}, rms {none_rms:.4f} -> {final_rms:.4f} and the tokens equal to "
                 f"the engine's prefill scoring {none_equal} -> {final_equal} (decided by {by})")
    manifest.notes = notes
    save_json(manifest, manifest_path)
    return manifest


def _why_left_out(e: RegionEffect | None) -> str:
    if e is None:
        return ""
    if e.decided_by == "equality" and e.equal_without is not None and e.equal_with is not None \
            and e.equal_without > e.equal_with:
        return (f": without it {e.equal_without - e.equal_with} more tokens equal the engine's prefill scoring "
                f"({e.equal_with} -> {e.equal_without})")
    return f": it widens the gap (k3 {e.delta:+.3g} with it)" if e.delta > 0 else ""


GATE_TOKENS = 256  # tokens per sample the patch is measured on when no longer samples are at hand
GATE_PROMPTS = 8
STEP_TOKENS = 256  # the training step each region's splice cost is timed in (batch 1)


def gate(scan: ScanResult, patch_dir: Path, samples_dir: Path, *, max_tokens: int = GATE_TOKENS,
         prompts: int = GATE_PROMPTS, model_dir: Path | None = None, progress: Progress = lambda m: None) -> Manifest:
    """Measure the patch in `patch_dir`, generated from `scan`, on the engine's samples (those cached in `samples_dir`,
    else from the engine, started as the scan configured it; `--engine inductor`: its teacher-forced scores) and leave
    out the regions that widen the gap."""
    from graphdiff import engines
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.engines.base import EngineOptions, recorded_engine
    from graphdiff.engines.samples import random_prompts
    from graphdiff.models.prepare import scanned_model
    from graphdiff.models.resolve import read_config

    if model_dir is None:
        model_dir = scanned_model(scan, progress)
    asked = random_prompts(read_config(model_dir), prompts, 16, 0)
    options = EngineOptions(engine=recorded_engine(scan.engine_config),
                            device=str(scan.engine_config.get("device", "cpu"))).with_asked(scan.compilation_config)
    samples = engines.kind(options.engine).gap_samples(model_dir, asked, ["compiled"], options, max_tokens=max_tokens,
                                                       out_dir=samples_dir, progress=progress)["compiled"].samples
    base = load_hf_model(model_dir)
    manifest = select_regions(base, patch_dir / "manifest.json", samples, progress)
    return with_step_costs(base, manifest, patch_dir, progress)


def with_step_costs(base: torch.nn.Module, manifest: Manifest, patch_dir: Path, progress: Progress = lambda m: None,
                    tokens: int = STEP_TOKENS) -> Manifest:
    """The manifest with each generated region's training-step cost (`splice_cost.region_costs`), written back."""
    from graphdiff.measure.splice_cost import region_costs

    if not any(r.generated for r in manifest.regions):
        return manifest
    progress(f"timing each region's splice in a training step ({tokens} tokens)")
    costs = region_costs(base, patch_dir, tokens)
    for region in manifest.regions:
        region.step_ms = round(costs[region.name], 2) if region.name in costs else None
    manifest.step_tokens = tokens
    manifest.step_layers = int(getattr(getattr(base, "config", None), "num_hidden_layers", 0) or 0)
    save_json(manifest, patch_dir / "manifest.json")
    return manifest


def gate_patch(scan_dir: Path, patch_dir: Path, *, max_tokens: int = GATE_TOKENS, prompts: int = GATE_PROMPTS,
               model_dir: Path | None = None, progress: Progress = lambda m: None) -> Manifest:
    """`gate` of the scan in `scan_dir`, on the samples cached there."""
    from graphdiff.artifacts import ScanDir

    return gate(ScanDir(scan_dir).load_scan(), patch_dir, scan_dir, max_tokens=max_tokens, prompts=prompts,
                model_dir=model_dir, progress=progress)
