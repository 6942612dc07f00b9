"""Planted mismatches (fixtures/planted/pairs.py): the scan finds exactly the planted sites.

Each pair runs for real: the trainer side eagerly, the engine side through Inductor (C++ backend
here), with the same hooks, buffer recorder, replay, matcher and site logic as a model scan.
"""

from __future__ import annotations

import importlib.util
import inspect
import re

import pytest

from graphdiff.analysis.match import match_values
from graphdiff.analysis.rounding import eager_values, engine_rounding, train_rounding
from graphdiff.analysis.sites import find_sites
from graphdiff.capture.function import capture_compiled, trace_eager
from tests.conftest import FIXTURES

spec = importlib.util.spec_from_file_location("planted_pairs", FIXTURES / "planted" / "pairs.py")
pairs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pairs)


def expected_sites(name: str) -> set[tuple[int, str]]:
    lines, start = inspect.getsourcelines(getattr(pairs, f"{name}_train"))
    return {(start + i, m.group(1)) for i, line in enumerate(lines) if (m := re.search(r"# SITE:(\w+)", line))}


def found_sites(name: str) -> tuple[set[tuple[int, str]], list]:
    train_mod, engine_mod, args = pairs.pair(name)
    arg_names = list(inspect.signature(train_mod.fn).parameters)[1:]
    egraph, buffers = capture_compiled(engine_mod, args, arg_names)
    tgraph, gm, inputs = trace_eager(train_mod, args, arg_names)
    values = eager_values(gm, inputs)
    er = engine_rounding(egraph, buffers)
    matches, unmatched = match_values(tgraph, values, egraph, er.values)
    sites = find_sites(tgraph, values, train_rounding(gm, values), egraph, er, matches, unmatched)
    return {(s.train.source.line, s.rounded_on) for s in sites if s.train.source}, er.replays


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[set, set, list]]:
    out = {}
    for name in pairs.NAMES:
        found, replays = found_sites(name)
        out[name] = (expected_sites(name), found, replays)
    return out


def test_precision_and_recall_are_one(results):
    tp = sum(len(exp & got) for exp, got, _ in results.values())
    n_found = sum(len(got) for _, got, _ in results.values())
    n_expected = sum(len(exp) for exp, _, _ in results.values())
    precision, recall = tp / max(n_found, 1), tp / max(n_expected, 1)
    report = {k: (sorted(e), sorted(g)) for k, (e, g, _) in results.items() if e != g}
    print(f"planted suite: precision {precision:.3f}, recall {recall:.3f} over {n_expected} planted sites")
    assert n_expected >= 10
    assert (precision, recall) == (1.0, 1.0), report


def test_every_planted_engine_kernel_replays_exactly(results):
    assert sum(len(r) for _, _, r in results.values()) >= len(results) - 1  # all but the lone matmul fuse
    for name, (_, _, replays) in results.items():
        for r in replays:
            assert not r.error and r.predicted_bitexact == 1.0, (name, r)
