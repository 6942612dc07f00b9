"""The shipped patch never widens the gap: each generated region is measured on engine samples and a region that
widens it is left out (graphdiff.measure.gate), on the real runtime with the patch of the recorded tiny Qwen3 scan.
The 'engine' here is the trainer itself with chosen regions applied, so which region widens the gap is known."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from graphdiff.capture.hf import load_hf_model
from graphdiff.codegen import generate
from graphdiff.measure.gate import select_regions
from graphdiff.measure.logprobs import train_logprobs, trainer
from graphdiff.models.tiny import make_tiny
from graphdiff.records import EngineSample, save_json
from graphdiff.runtime import load_manifest
from tests.conftest import FIXTURES


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    manifest = generate(FIXTURES / "scans" / "tiny-qwen3", root / "patch")
    model = make_tiny("qwen3", root / "qwen3", layers=2)  # the scanned tiny:qwen3 (seed 0)
    return root, load_hf_model(model), [r.name for r in manifest.regions if r.generated]


def _engine(base, manifest: Path, regions: list[str]) -> list[EngineSample]:
    """Samples whose 'engine' log-probs are the trainer's with `regions` applied."""
    seqs = [EngineSample(prompt=[5, 9, 100, 7], tokens=[42, 7, 300, 2, 11, 900], logprobs=[]),
            EngineSample(prompt=[1, 2], tokens=[8, 1500, 3, 77, 6, 5], logprobs=[])]
    with trainer(base, "eager", manifest if regions else None, regions) as model:
        for s, lp in zip(seqs, train_logprobs(model, seqs)):
            s.logprobs = lp.tolist()
    return seqs


def _one_matched_one_not(base, manifest: Path, regions: list[str]) -> list[EngineSample]:
    """A long sequence whose 'engine' log-probs are the patched trainer's, and a short one's the unpatched one's."""
    gen = torch.Generator().manual_seed(3)
    long_ = EngineSample(prompt=[5, 9, 100, 7], tokens=torch.randint(3, 2000, (40,), generator=gen).tolist(),
                         logprobs=[])
    short = EngineSample(prompt=[1, 2], tokens=[8, 1500, 3], logprobs=[])
    for s, applied in ((long_, regions), (short, [])):
        with trainer(base, "eager", manifest if applied else None, applied) as model:
            s.logprobs = train_logprobs(model, [s])[0].tolist()
    return [long_, short]


def _copy(root: Path, name: str) -> Path:
    shutil.copytree(root / "patch", root / name)
    return root / name / "manifest.json"


def _mark_exact(path: Path) -> None:
    """The copied patch as `--exact` generated it: gated by equality with the engine's prefill scoring."""
    manifest = load_manifest(path)
    manifest.exact = True
    save_json(manifest, path)


def test_a_region_the_engine_does_not_have_is_left_out(setup):
    root, base, regions = setup
    widening = "model.layers.*.mlp.act_fn#gated_act"
    path = _copy(root, "one-out")
    samples = _engine(base, path, [r for r in regions if r != widening])
    manifest = select_regions(base, path, samples)
    enabled = {r.name for r in manifest.regions if r.enabled}
    assert enabled == set(regions) - {widening}
    left = next(r for r in manifest.regions if r.name == widening)
    assert left.effect.delta > 0 and left.effect.ci[0] <= left.effect.delta <= left.effect.ci[1]
    assert any(f"{widening} left out" in n for n in manifest.notes)
    assert load_manifest(path).regions == manifest.regions  # written back


def test_a_patch_that_cannot_narrow_the_gap_ships_nothing(setup):
    root, base, regions = setup
    path = _copy(root, "none")
    manifest = select_regions(base, path, _engine(base, path, []))  # the engine rounds as HF eager does
    assert not any(r.enabled for r in manifest.regions)
    assert any("left out" in n or "none enabled" in n for n in manifest.notes)


def test_when_every_region_narrows_the_gap_every_one_ships(setup):
    root, base, regions = setup
    path = _copy(root, "all")
    manifest = select_regions(base, path, _engine(base, path, regions))
    assert {r.name for r in manifest.regions if r.enabled} == set(regions)
    assert all(r.effect.delta <= 0 for r in manifest.regions if r.effect)


def test_a_patch_whose_effect_other_samples_could_reverse_ships_nothing(setup):
    """One long sequence the patch matches (the 'engine' is the patched trainer) and one short one it does not (the
    unpatched trainer): together k3 and RMS fall, but resampled sequences can make the change positive, so the
    interval of the change does not lie below zero and nothing ships (cohere's held-out gap grew by 0.01% so)."""
    root, base, regions = setup
    path = _copy(root, "noise")
    manifest = select_regions(base, path, _one_matched_one_not(base, path, regions))
    assert not any(r.enabled for r in manifest.regions), [r.name for r in manifest.regions if r.enabled]
    assert any("measurably" in n and "interval" in n for n in manifest.notes), manifest.notes


def test_an_exact_patch_keeps_a_region_by_equality_with_the_engine_not_by_noise(setup):
    """`--exact`: the same noisy samples as above (one sequence at the engine, one not) ship every region, since
    removing any makes fewer tokens equal the engine's prefill scoring; a region the engine does not compute (the
    'engine' leaves it out) is left out by the same count, and each effect says equality decided."""
    root, base, regions = setup
    path = _copy(root, "exact")
    _mark_exact(path)
    samples = _one_matched_one_not(base, path, regions)
    for s in samples:
        s.prefill_logprobs = list(s.logprobs)
    kept = select_regions(base, path, samples)
    assert {r.name for r in kept.regions if r.enabled} == set(regions), kept.notes
    assert all(r.effect.decided_by == "equality" for r in kept.regions if r.effect)

    widening = "model.layers.*.mlp.act_fn#gated_act"
    path = _copy(root, "exact-one-out")
    _mark_exact(path)
    samples = _engine(base, path, [r for r in regions if r != widening])
    for s in samples:
        s.prefill_logprobs = list(s.logprobs)
    chosen = select_regions(base, path, samples)
    assert {r.name for r in chosen.regions if r.enabled} == set(regions) - {widening}
    left = next(r for r in chosen.regions if r.name == widening)
    assert left.effect.equal_without > left.effect.equal_with
    assert any(f"{widening} left out: without it" in n for n in chosen.notes), chosen.notes


def test_an_exact_patch_short_of_the_engine_that_widens_the_gap_is_decided_by_k3(setup):
    """`--exact` where the kept regions make more tokens equal the engine's prefill (one sequence of two) but the gap
    to its sampled log-probs widens (they are the unpatched trainer's): equality does not reach the engine, so k3
    decides, and a patch that widens k3 ships nothing."""
    root, base, regions = setup
    path = _copy(root, "exact-widens")
    _mark_exact(path)
    samples = _one_matched_one_not(base, path, regions)
    for s in samples:
        s.prefill_logprobs = list(s.logprobs)
    with trainer(base, "eager", None, []) as model:
        for s, lp in zip(samples, train_logprobs(model, samples)):
            s.logprobs = lp.tolist()
    chosen = select_regions(base, path, samples)
    assert not any(r.enabled for r in chosen.regions), [r.name for r in chosen.regions if r.enabled]
    assert any("decided by k3 instead" in n for n in chosen.notes), chosen.notes
    assert all(r.effect.decided_by == "k3" for r in chosen.regions if r.effect)


def test_an_exact_patch_that_makes_no_token_equal_is_decided_by_k3(setup):
    """`--exact` where no token equals the engine's prefill with or without the patch (the 'engine' is the patched
    trainer a little off on every token): equality tells nothing, so k3 decides, and the regions that narrow the gap
    ship instead of none."""
    root, base, regions = setup
    path = _copy(root, "exact-none-equal")
    _mark_exact(path)
    samples = _engine(base, path, regions)
    for s in samples:
        s.logprobs = [x + 1e-6 for x in s.logprobs]
        s.prefill_logprobs = list(s.logprobs)
    chosen = select_regions(base, path, samples)
    assert {r.name for r in chosen.regions if r.enabled} == set(regions), chosen.notes
    assert any("make no more tokens equal the engine's prefill (0 -> 0" in n for n in chosen.notes), chosen.notes
    assert all(r.effect.decided_by == "k3" for r in chosen.regions if r.effect)
