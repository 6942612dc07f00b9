"""The chain after the scan: where an unnamed rest is left in the patched gap, the patched trainer's first departure
from the engine is looked up (against the scan's own engine capture and buffers, in memory) and named; where it is
not, nothing runs."""

from __future__ import annotations

import types
from pathlib import Path

from graphdiff import pipeline
from graphdiff.records import Departure, GapSource, KLResult


def _gap(rest: list[float]) -> KLResult:
    return KLResult(model="m", architecture="A", seed=0, temperature=1.0, max_tokens=256, prompts=1, method="",
                    measurements=[], bucket=128,
                    sources=[GapSource(name="engine floor", what="", ms=[0.0] * len(rest), share=[0.0] * len(rest)),
                             GapSource(name="rest", what="", ms=rest, share=rest)])


def _outcome() -> types.SimpleNamespace:
    return types.SimpleNamespace(engine=types.SimpleNamespace(graphs=[], prompt_tokens=[1, 2, 3]),
                                 buffers={"prefill-3": {}}, model_dir=Path("/ckpt"), config={"c": 1},
                                 result=types.SimpleNamespace(model="tiny:qwen3", layers_total=2))


def _refuse(*a, **k):  # noqa: ANN002, ANN003
    raise AssertionError("traced")


def test_a_named_gap_runs_nothing(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(pipeline, "run_train_side", _refuse)
    monkeypatch.setattr(pipeline, "analyze", _refuse)
    assert pipeline.patched_departure(_outcome(), tmp_path / "m.json", _gap([0.05, 0.01]), print) == (None, "")


def test_an_unnamed_rest_is_traced_to_the_patched_trainers_first_departure(monkeypatch, tmp_path) -> None:
    seen: dict = {}
    found = Departure(node="mm_14", op="aten.mm.default", module="model.layers.2.self_attn.q_proj", layer=2,
                      engine_node="view_71", differing=0.36, equal_before=17, source="modeling_cohere.py:249 q = ...")
    outcome = _outcome()

    def train_side(model_dir, prompt, manifest):  # noqa: ANN001
        seen.update(model_dir=model_dir, prompt=prompt, manifest=manifest)
        return "patched trainer"

    def analyze(engine_cap, buffers, train, **kw):  # noqa: ANN001, ANN003
        seen.update(engine=engine_cap, buffers=buffers, train=train, **kw)
        return types.SimpleNamespace(departure=seen.get("answer", found))

    monkeypatch.setattr(pipeline, "run_train_side", train_side)
    monkeypatch.setattr(pipeline, "analyze", analyze)
    departure, note = pipeline.patched_departure(outcome, tmp_path / "m.json", _gap([0.0, 0.9]), print)
    assert departure == found
    # the scan's own capture and buffers, no engine start; the trainer patched by the manifest on the scan's prompt
    assert seen["engine"] is outcome.engine and seen["buffers"] is outcome.buffers
    assert seen["train"] == "patched trainer" and seen["manifest"] == tmp_path / "m.json"
    assert seen["prompt"] == [1, 2, 3] and seen["model_dir"] == Path("/ckpt")
    assert "128-255" in note and "0-127" not in note and "q_proj" in note and "36.0%" in note
    seen["answer"] = None
    departure, note = pipeline.patched_departure(outcome, tmp_path / "m.json", _gap([0.2]), print)
    assert departure is None and "equals the engine on every matched value" in note
