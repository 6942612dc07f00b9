"""records.walk: the one breadth-first walk the analysis, codegen and report take along a graph's dataflow."""

from __future__ import annotations

from graphdiff.records import walk

#   a -> b -> d -> e
#   a -> c -> d
INPUTS = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"], "e": ["d"]}
USERS = {"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": ["e"], "e": []}


def test_nearest_first_each_once_without_the_starts() -> None:
    assert list(walk(["a"], USERS.__getitem__)) == ["b", "c", "d", "e"]
    assert list(walk(["e"], INPUTS.__getitem__)) == ["d", "b", "c", "a"]


def test_through_stops_the_walk_past_a_node_but_reaches_it() -> None:
    assert list(walk(["a"], USERS.__getitem__, through=lambda n: n != "b")) == ["b", "c", "d", "e"]
    assert list(walk(["a"], USERS.__getitem__, through=lambda n: n not in ("b", "c"))) == ["b", "c"]


def test_hops_bound_the_distance() -> None:
    assert list(walk(["a"], USERS.__getitem__, hops=1)) == ["b", "c"]
    assert list(walk(["a"], USERS.__getitem__, hops=0)) == []
    assert list(walk(["b", "c"], USERS.__getitem__, hops=1)) == ["d"]
