"""The log-prob gap: estimators, the trainer side, the engine-sample cache, and one real-engine run."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from graphdiff.capture.hf import load_hf_model
from graphdiff.engines.samples import SAMPLES_FILE, random_prompts, read_prompts, weights_fingerprint
from graphdiff.engines.vllm import session as eng
from graphdiff.errors import GraphdiffError
from graphdiff.measure import kl, logprobs
from graphdiff.measure.kl import gap_metrics, manifest_regions, position_curve
from graphdiff.measure.logprobs import engine_logprobs, train_logprobs
from graphdiff.measure.shapley import attribute
from graphdiff.models.resolve import read_config
from graphdiff.models.tiny import make_tiny
from graphdiff.records import EngineSample, EngineSamples, EngineSamplesFile, KLMeasurement, PositionBin, save_json


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("qwen3", tmp_path_factory.mktemp("kl") / "qwen3", layers=1)


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_estimators_on_known_numbers():
    engine = [_t([-1.0, -2.0, -0.5]), _t([-3.0])]
    train = [_t([-1.0, -2.5, -0.25]), _t([-2.0])]
    d = np.array([0.0, 0.5, -0.25, -1.0])  # engine - train
    m = gap_metrics(engine, train, engine_mode="compiled", trainer_mode="eager")
    assert m.k1 == pytest.approx(d.mean())
    assert m.k3 == pytest.approx(np.mean(np.exp(-d) - 1 + d))
    assert m.rms == pytest.approx(math.sqrt(np.mean(d**2)))
    assert m.max_abs == 1.0 and m.bitexact_fraction == 0.25 and m.tokens == 4 and m.sequences == 2
    assert m.k3 >= 0


def test_k1_standard_error_treats_sequences_as_units():
    diffs = [torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([-1.0, -1.0], dtype=torch.float64)]
    # k1 = 0; residual sums +2 and -2; sqrt(2/1 * 8) / 4 = 1
    assert kl.k1_standard_error(diffs) == pytest.approx(1.0)
    assert kl.k1_standard_error(diffs[:1]) is None
    m = gap_metrics([d.float() for d in diffs], [torch.zeros(2), torch.zeros(2)], engine_mode="eager",
                    trainer_mode="eager")
    assert m.k1_se == pytest.approx(1.0)


def test_k3_keeps_tiny_differences_exact():
    e = _t([-1.0])
    t = e - 2.0**-20  # exp(r) - 1 - r computed naively would round to 0
    m = gap_metrics([e], [t], engine_mode="eager", trainer_mode="eager")
    assert m.k3 == pytest.approx((2.0**-20) ** 2 / 2, rel=1e-5)
    same = gap_metrics([e], [e.clone()], engine_mode="eager", trainer_mode="eager")
    assert same.k1 == same.k3 == same.rms == 0 and same.bitexact_fraction == 1.0


def test_position_buckets_cover_every_token():
    diffs = [torch.arange(10, dtype=torch.float64), torch.ones(3, dtype=torch.float64)]
    same = [d == 0 for d in diffs]
    curve = position_curve(diffs, same, width=3)
    assert [(b.start, b.stop) for b in curve] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert sum(b.tokens for b in curve) == 13
    assert curve[0].k1 == pytest.approx((0 + 1 + 2 + 1 + 1 + 1) / 6)
    assert curve[0].bitexact_fraction == pytest.approx(1 / 6)  # position 0 of the first sequence
    assert curve[-1].k1 == 9 and curve[-1].rms == 9 and curve[-1].bitexact_fraction == 0


def test_the_default_buckets_are_128_tokens_up_to_max_tokens():
    e = [torch.zeros(1024), torch.zeros(1024)]
    t = [torch.full((1024,), 1e-3), torch.zeros(1024)]
    m = gap_metrics(e, t, engine_mode="compiled", trainer_mode="eager")
    assert [(b.start, b.stop) for b in m.position] == [(i, i + 128) for i in range(0, 1024, 128)]
    assert all(b.tokens == 256 and b.bitexact_fraction == 0.5 for b in m.position)
    assert m.k3_se is not None and m.k3 > 0


def test_a_bucket_is_at_the_engine_within_5_percent_or_the_floor():
    def b(rms: float, exact: float = 0.0) -> PositionBin:
        return PositionBin(start=0, stop=128, tokens=128, k1=0.0, rms=rms, bitexact_fraction=exact)

    plain = b(0.03)
    assert kl.at_target(plain, b(0.0014), b(0.001, 0.9))  # under 5% of the unpatched RMS
    assert kl.at_target(plain, b(0.0021), b(0.002, 0.9))  # over 5%, under 1.1x the floor
    assert not kl.at_target(plain, b(0.0023), b(0.002, 0.9))  # over both
    assert not kl.at_target(plain, b(0.0001, 0.99), b(0.0, 1.0))  # the floor is 0: bit-identical or nothing
    assert kl.at_target(plain, b(0.0, 1.0), b(0.0, 1.0))
    assert kl.at_target(plain, b(0.0014), None)  # no floor measured: 5% of the unpatched RMS
    assert kl.floor_ratio(b(0.0, 1.0), b(0.0, 1.0)) == "= floor"
    assert kl.floor_ratio(b(0.001), b(0.0, 1.0)) == "inf"
    assert kl.floor_ratio(b(0.003), b(0.002)) == "1.50"


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError):
        gap_metrics([_t([1.0, 2.0])], [_t([1.0])], engine_mode="eager", trainer_mode="eager")


def test_train_logprobs_are_the_teacher_forced_next_token_logprobs(tiny_qwen3):
    model = load_hf_model(tiny_qwen3)
    seqs = [EngineSample(prompt=[5, 9, 100], tokens=[7, 300, 2], logprobs=[0.0] * 3),
            EngineSample(prompt=[1], tokens=[42], logprobs=[0.0])]
    got = train_logprobs(model, seqs)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([[5, 9, 100, 7, 300, 2]])).logits[0].float().log_softmax(-1)
    assert got[0].dtype == torch.float32
    assert torch.equal(got[0], torch.stack([full[2, 7], full[3, 300], full[4, 2]]))
    assert [len(x) for x in got] == [3, 1]
    again = train_logprobs(model, seqs)
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # repeatable: subsets compare like with like


def test_random_prompts_are_seeded_and_in_vocabulary():
    config = {"vocab_size": 50}
    a = random_prompts(config, 3, 5, seed=1)
    assert a == random_prompts(config, 3, 5, seed=1) and a != random_prompts(config, 3, 5, seed=2)
    assert len(a) == 3 and all(len(p) == 5 and all(1 <= t < 50 for t in p) for p in a)


def test_read_prompts(tmp_path, tiny_qwen3):
    f = tmp_path / "p.jsonl"
    f.write_text("[1, 2, 3]\n\n[4]\n")
    assert read_prompts(f, tiny_qwen3, 2048) == [[1, 2, 3], [4]]
    f.write_text("[1, 99999]\n")
    with pytest.raises(GraphdiffError, match="token ids"):
        read_prompts(f, tiny_qwen3, 2048)
    f.write_text('"some text"\n')
    with pytest.raises(GraphdiffError, match="tokenizer"):  # tiny checkpoints ship without one
        read_prompts(f, tiny_qwen3, 2048)


def test_manifest_region_names_are_the_generated_regions(tmp_path):
    codegen = pytest.importorskip("graphdiff.codegen")
    scan_dir = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-qwen3"
    manifest = codegen.generate(scan_dir, tmp_path / "patch")
    assert manifest_regions(tmp_path / "patch" / "manifest.json") == [r.name for r in manifest.regions if r.generated]
    f = tmp_path / "m.json"
    f.write_text("{}")
    with pytest.raises(GraphdiffError, match="not a patch manifest"):
        manifest_regions(f)


def _fake_runtime(monkeypatch) -> list[list[str]]:
    """A stand-in training runtime: region r scales the LM head by a region-specific factor; `remove` is
    recorded as an empty entry (every patched copy must come off before the next runs)."""
    applied: list[list[str]] = []
    scale = {"rope": 1.01, "swiglu": 0.995, "residual": 1.002}

    def apply(model, manifest, regions=None):
        names = list(regions) if regions is not None else list(scale)
        applied.append(names)
        with torch.no_grad():
            for r in names:
                model.lm_head.weight.mul_(scale[r])
        return model

    def load_manifest(path):
        regions = json.loads(Path(path).read_text())["regions"]
        return types.SimpleNamespace(regions=[types.SimpleNamespace(name=r, kind=r, generated=True, enabled=True)
                                               for r in regions])

    module = types.ModuleType("graphdiff.runtime")
    module.apply = apply
    module.remove = lambda model: applied.append(["<removed>"])
    module.load_manifest = load_manifest
    monkeypatch.setattr(kl, "runtime", module)
    monkeypatch.setattr(logprobs, "runtime", module)  # the trainer side applies patches through it
    return applied


def _self_samples(model_dir: Path, prompts: list[list[int]], tokens: int) -> list[EngineSample]:
    """'Engine' samples whose log-probs are the eager trainer's own: a zero gap by construction."""
    model = load_hf_model(model_dir)
    gen = torch.Generator().manual_seed(0)
    seqs = [EngineSample(prompt=p, tokens=torch.randint(1, 2048, (tokens,), generator=gen).tolist(), logprobs=[])
            for p in prompts]
    for s, lp in zip(seqs, train_logprobs(model, seqs)):
        s.logprobs = lp.tolist()
    return seqs


def test_patch_subsets_run_on_copies_and_feed_the_attribution(monkeypatch, tiny_qwen3):
    applied = _fake_runtime(monkeypatch)
    samples = _self_samples(tiny_qwen3, random_prompts({"vocab_size": 2048}, 3, 4), 6)
    base = load_hf_model(tiny_qwen3)
    before = base.lm_head.weight.clone()
    regions = ["rope", "swiglu", "residual"]
    gaps = kl.subset_gaps(base, Path("m.json"), regions, samples)
    assert np.array_equal(gaps(0), np.zeros(3))  # unpatched trainer = the 'engine'
    result = attribute(gaps, [len(s.tokens) for s in samples], regions, bootstrap=20)
    assert torch.equal(base.lm_head.weight, before)  # every subset patched a copy
    subsets = [a for a in applied if a != ["<removed>"]]
    assert sorted(map(tuple, subsets)) == sorted(tuple(r for i, r in enumerate(regions) if m >> i & 1)
                                                 for m in range(1, 8))
    assert applied[1::2] == [["<removed>"]] * 7  # every patched pass is undone before the next model runs
    assert sum(v.value for v in result.values) == pytest.approx(result.reduction, abs=1e-12)


def _cache_run(model_dir: Path, prompts: list[list[int]], samples: list[EngineSample], seed: int = 0,
               mode: str = "compiled") -> EngineSamples:
    return EngineSamples(mode=mode, model=str(model_dir.resolve()), weights=weights_fingerprint(model_dir),
                         seed=seed, temperature=1.0, max_tokens=len(samples[0].tokens),
                         versions=eng.engine_versions() if _has_vllm() else {}, samples=samples)


def _has_vllm() -> bool:
    try:
        eng.engine_versions()
    except ImportError:
        return False
    return True


def test_measure_reads_cached_engine_samples_and_never_starts_an_engine(monkeypatch, tmp_path, tiny_qwen3):
    prompts = random_prompts({"vocab_size": 2048}, 2, 4)
    samples = _self_samples(tiny_qwen3, prompts, 5)
    save_json(EngineSamplesFile(runs=[_cache_run(tiny_qwen3, prompts, samples)]), tmp_path / SAMPLES_FILE)

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was started although its samples were cached")

    monkeypatch.setattr(eng, "_sample_here", no_engine)
    monkeypatch.setattr(eng, "_sample_subprocess", no_engine)
    result = kl.measure(tiny_qwen3, prompts, max_tokens=5, out_dir=tmp_path)
    (m,) = result.measurements
    assert (m.engine_mode, m.trainer_mode, m.regions) == ("compiled", "eager", None)
    assert m.k1 == 0 and m.bitexact_fraction == 1.0 and m.tokens == 10
    with pytest.raises(AssertionError, match="cached"):  # another seed samples anew
        kl.measure(tiny_qwen3, prompts, max_tokens=5, seed=1, out_dir=tmp_path)


def test_measure_with_a_manifest_adds_the_patched_trainer(monkeypatch, tmp_path, tiny_qwen3):
    _fake_runtime(monkeypatch)
    prompts = random_prompts({"vocab_size": 2048}, 2, 4)
    save_json(EngineSamplesFile(runs=[_cache_run(tiny_qwen3, prompts, _self_samples(tiny_qwen3, prompts, 4))]),
              tmp_path / SAMPLES_FILE)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"regions": ["rope", "swiglu"]}))
    result = kl.measure(tiny_qwen3, prompts, max_tokens=4, out_dir=tmp_path, manifest=manifest, attribute=True,
                        bootstrap=10)
    assert [m.regions for m in result.measurements] == [None, ["rope", "swiglu"]]
    assert result.measurements[1].bitexact_fraction < 1.0
    assert result.attribution is not None and result.attribution.regions == ["rope", "swiglu"]
    assert result.attribution.baseline == 0.0
    # no attention region in the patch: the gap is floor + rest (attention's order inside it), and the note says why
    assert [s.name for s in result.sources] == ["engine floor", "rest"] and "no attention region" in result.sources_note
    assert result.left_out == []


def _bucketed(ms: list[float]) -> KLMeasurement:
    return KLMeasurement(label="m", engine_mode="compiled", trainer_mode="eager", tokens=10, sequences=1, k1=0.0,
                         k3=0.0, rms=0.0, max_abs=0.0, bitexact_fraction=0.0,
                         position=[PositionBin(start=128 * i, stop=128 * (i + 1), tokens=5, rms=m ** 0.5, k1=0.0)
                                   for i, m in enumerate(ms)])


def test_the_patched_gap_splits_into_attention_order_floor_and_rest_per_bucket() -> None:
    patched, with_engine_op, engine_floor = _bucketed([4.0, 4.0]), _bucketed([1.0, 0.1]), _bucketed([0.5, 0.0])
    sources = {s.name: s.share for s in kl.gap_sources(patched, with_engine_op, engine_floor)}
    assert sources["attention order"] == pytest.approx([0.75, 0.975])
    assert sources["engine floor"] == pytest.approx([0.125, 0.0])
    assert sources["rest"] == pytest.approx([0.125, 0.025])
    # more than 5% of the gap unnamed in bucket 0 only: that is where the departure is looked for
    assert kl.rest_buckets(kl.gap_sources(patched, with_engine_op, engine_floor)) == [0]
    # without the engine's attention op, attention's order is in the rest
    assert {s.name: s.share for s in kl.gap_sources(patched, None, engine_floor)}["rest"] == pytest.approx([0.875, 1.0])


def test_regions_the_patch_does_not_apply_are_named_with_why(monkeypatch, tmp_path) -> None:
    manifest = tmp_path / "manifest.json"
    regions = [types.SimpleNamespace(name="a#rope", generated=False, enabled=False, reason="PyTorch emitter: x"),
               types.SimpleNamespace(name="b#attention", generated=True, enabled=False, reason=""),
               types.SimpleNamespace(name="c#norm", generated=True, enabled=True, reason="")]
    monkeypatch.setattr(kl, "runtime", types.SimpleNamespace(load_manifest=lambda p: types.SimpleNamespace(
        regions=regions)))
    assert kl.left_out(manifest) == ["a#rope: PyTorch emitter: x", "b#attention: left out: measured to widen the gap"]


@pytest.mark.engine
@pytest.mark.kind
def test_gap_between_the_real_engine_and_the_trainer(engine_run):
    """Sampling on the session's compiled engine (tiny Qwen3, 2 layers); HF eager and compiled recompute."""
    model_dir = Path(engine_run.capture.model)
    prompts = random_prompts(read_config(model_dir), 4, 8, seed=0)
    samples = eng.engine_sample(engine_run.llm, prompts, max_tokens=16, seed=0)
    assert [len(s.tokens) for s in samples] == [16] * 4 and all(len(s.logprobs) == 16 for s in samples)
    again = eng.engine_sample(engine_run.llm, prompts, max_tokens=16, seed=0)
    assert [s.tokens for s in again] == [s.tokens for s in samples]  # seeded: the cache is reproducible

    model = load_hf_model(model_dir)
    engine = engine_logprobs(samples)
    eager = train_logprobs(model, samples)
    m = gap_metrics(engine, eager, engine_mode="compiled", trainer_mode="eager")
    diff = torch.cat([e.double() - t.double() for e, t in zip(engine, eager)])
    assert m.tokens == 64 and m.sequences == 4 and sum(b.tokens for b in m.position) == 64
    assert all(math.isfinite(x) for x in (m.k1, m.k3, m.rms, m.max_abs))
    assert m.k1 == pytest.approx(float(diff.mean()), abs=1e-12)
    assert 0 < m.rms < 0.2  # aligned: an off-by-one position would differ by nats, not hundredths

    compiled = train_logprobs(torch.compile(model, backend="inductor"), samples)
    mc = gap_metrics(engine, compiled, engine_mode="compiled", trainer_mode="compiled")
    assert all(math.isfinite(x) for x in (mc.k1, mc.k3, mc.rms, mc.max_abs)) and mc.tokens == 64
    between = torch.cat([a - b for a, b in zip(eager, compiled)]).abs()
    assert 0 < between.max() < 0.5  # compile moves roundings: the trainer's own log-probs change, slightly


def test_the_engine_child_process_protocol(monkeypatch, tmp_path, capsys):
    from graphdiff import child

    request, result = tmp_path / "request.json", tmp_path / "samples.json"
    request.write_text(json.dumps(dict(model_dir="m", prompts=[[1, 2]], modes=["eager"], max_tokens=1, seed=0,
                                       temperature=1.0, result=str(result), compilation_config={})))
    monkeypatch.setattr(sys, "argv", ["graphdiff.engines.vllm.session", str(request)])

    def fake(model_dir, prompts, modes, *, max_tokens, seed, temperature, progress, compilation_config):
        progress("sampling\nnow")
        return {"eager": [EngineSample(prompt=[1, 2], tokens=[3], logprobs=[-0.5])]}

    monkeypatch.setattr(eng, "_sample_here", fake)
    assert child.serve(eng._child) == 0
    # one line per message: the parent reads lines; the last says the work is done
    assert capsys.readouterr().out == "@progress sampling now\n@done\n"
    assert json.loads(result.read_text()) == {"eager": [{"prompt": [1, 2], "tokens": [3], "logprobs": [-0.5],
                                                     "prefill_logprobs": [], "routing": {}}]}

    def failing(*args, **kwargs):
        raise GraphdiffError("vLLM could not start on m: boom")

    monkeypatch.setattr(eng, "_sample_here", failing)
    assert child.serve(eng._child) == 2
    assert capsys.readouterr().out == "@error vLLM could not start on m: boom\n"


def test_a_failing_child_is_one_error_in_the_parent(tmp_path):
    """The engine capture's child process, given a model that does not exist: the parent gets its one line."""
    from graphdiff.engines.vllm.process import capture_isolated

    with pytest.raises(GraphdiffError, match="does not exist"):
        capture_isolated(tmp_path / "nope", [], tmp_path / "engine")


def test_cli_kl_user_errors_exit_2_before_any_engine_runs(monkeypatch, tmp_path, tiny_qwen3):
    from graphdiff_cli.main import app
    from typer.testing import CliRunner

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(eng, "_sample_here", no_engine)
    monkeypatch.setattr(eng, "_sample_subprocess", no_engine)
    runner = CliRunner()
    cases = [
        (["--engine", "sglang"], "unknown engine"),
        (["--random", "2", "--prompts", str(tmp_path / "p.txt")], "not both"),
        (["--attribute"], "--attribute needs --manifest"),
        (["--manifest", str(tmp_path / "m.json")], "cannot read the manifest"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--prompts", str(tmp_path / "missing.txt")], "no prompts file"),
    ]
    for args, message in cases:
        res = runner.invoke(app, ["kl", str(tiny_qwen3), "--out", str(tmp_path / "out"), *args])
        assert res.exit_code == 2, (args, res.output)
        assert message in " ".join(res.output.split()), (args, res.output)


def test_real_runtime_patches_come_off_after_every_subset(tmp_path):
    """With the real runtime and a patch generated from the recorded tiny-Qwen3 scan: the empty subset is the
    unpatched trainer, and after 2^k patched passes (RoPE is replaced process-wide while patched) the
    unpatched model computes exactly what it did before."""
    runtime = pytest.importorskip("graphdiff.runtime")
    codegen = pytest.importorskip("graphdiff.codegen")
    scan_dir = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-qwen3"
    manifest = codegen.generate(scan_dir, tmp_path / "patch")
    model_dir = make_tiny("qwen3", tmp_path / "qwen3", layers=2)  # the scanned tiny:qwen3 (seed 0)
    regions = ["model.layers.*.self_attn#rope", "model.layers.*.mlp.act_fn#gated_act", "model.layers.*#residual_norm"]
    assert set(regions) <= {r.name for r in manifest.regions if r.generated}
    samples = _self_samples(model_dir, random_prompts({"vocab_size": 2048}, 2, 6), 6)
    base = load_hf_model(model_dir)
    before = train_logprobs(base, samples)
    gaps = kl.subset_gaps(base, tmp_path / "patch" / "manifest.json", regions, samples, metric="k3")
    result = attribute(gaps, [len(s.tokens) for s in samples], regions, bootstrap=20)
    assert result.baseline == 0.0 and result.subsets["model.layers.*#residual_norm"] > 0  # moves the trainer off HF
    assert runtime.active_regions(base) is None
    assert all(torch.equal(a, b) for a, b in zip(before, train_logprobs(base, samples)))
