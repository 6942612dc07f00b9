"""The chain after the scan: where an unnamed rest is left in the patched gap, the patched trainer's first departure
from the engine is looked up (against the scan's own engine capture) and named; where it is not, nothing runs."""

from __future__ import annotations

import types
from pathlib import Path

from graphdiff import pipeline
from graphdiff.artifacts import ScanDir
from graphdiff.records import Departure, GapSource, KLResult


def _gap(rest: list[float]) -> KLResult:
    return KLResult(model="m", architecture="A", seed=0, temperature=1.0, max_tokens=256, prompts=1, method="",
                    measurements=[], bucket=128,
                    sources=[GapSource(name="engine floor", what="", ms=[0.0] * len(rest), share=[0.0] * len(rest)),
                             GapSource(name="rest", what="", ms=rest, share=rest)])


def _outcome() -> types.SimpleNamespace:
    return types.SimpleNamespace(engine=types.SimpleNamespace(graphs=[]), model_dir=Path("/ckpt"))


def test_a_named_gap_runs_nothing(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(pipeline, "scan", lambda *a, **k: (_ for _ in ()).throw(AssertionError("scanned")))
    assert pipeline.patched_departure(ScanDir(tmp_path), _outcome(), tmp_path / "m.json", _gap([0.05, 0.01]),
                                      print) == (None, "")


def test_an_unnamed_rest_is_traced_to_the_patched_trainers_first_departure(monkeypatch, tmp_path) -> None:
    seen = {}
    found = Departure(node="mm_14", op="aten.mm.default", module="model.layers.2.self_attn.q_proj", layer=2,
                      engine_node="view_71", differing=0.36, equal_before=17, source="modeling_cohere.py:249 q = ...")

    def scan(spec, **kw):  # noqa: ANN001, ANN003 - pipeline.scan's signature
        seen.update(spec=spec, **kw)
        return types.SimpleNamespace(result=types.SimpleNamespace(departure=found))

    monkeypatch.setattr(pipeline, "scan", scan)
    d = ScanDir(tmp_path)
    departure, note = pipeline.patched_departure(d, _outcome(), tmp_path / "m.json", _gap([0.0, 0.9]), print)
    assert departure == found
    assert seen["engine_dump"] == d.engine_dir and seen["manifest"] == tmp_path / "m.json"  # no engine start
    assert "128-255" in note and "0-127" not in note and "q_proj" in note and "36.0%" in note
    found_none = types.SimpleNamespace(result=types.SimpleNamespace(departure=None))
    monkeypatch.setattr(pipeline, "scan", lambda spec, **kw: found_none)
    departure, note = pipeline.patched_departure(d, _outcome(), tmp_path / "m.json", _gap([0.2]), print)
    assert departure is None and "equals the engine on every matched value" in note
