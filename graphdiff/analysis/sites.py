"""The plan's one-sided decisions as sites, each with its evidence in one line."""

from __future__ import annotations

from graphdiff.analysis.kinds import classify
from graphdiff.analysis.match import Match
from graphdiff.analysis.plan import decide
from graphdiff.analysis.rounding import EngineRounding
from graphdiff.records import Decision, Graph, Node, SideRef, Site


def _ref(n: Node, how: str, kernel: str | None = None) -> SideRef:
    return SideRef(node=n.name, op=n.target, dtype=n.dtype, module=n.module, source=n.source,
                   kernel=kernel if kernel is not None else n.kernel, how=how)


def summary(d: Decision) -> str:
    """The decision's evidence in one line (for terminals; everything in it is a field of the plan)."""
    e = d.evidence
    if d.rule == "matched":
        return (f"matched {e.engine_node} ({d.module or '?'}); sorted-value distance {e.distance:.2e} "
                f"(runner-up {e.runner_up:.2e})")
    if d.rule == "inside-kernel":
        return (f"no engine node computes this value (other decomposition); the engine computes {e.stretch[0]} -> "
                f"{e.stretch[1]} inside {e.kernel.split(':')[0]} in FP32 (replay-verified)")
    if d.rule == "opaque-registry" and d.kind == "allreduce":  # graphdiff.analysis.tensor_parallel
        checked = (f"; on the recorded partials the all-reduce output is that on {e.replay_predicted:.2%}, one "
                   f"rounding of the FP32 sum (one GEMM) on {e.replay_naive:.2%}") if e.replay_naive is not None else ""
        return f"matched {e.engine_node}: {d.engine.how if d.engine else ''}{checked}; {e.registry}"
    if d.rule == "opaque-registry" and e.stretch:
        return f"no engine node computes this value: the engine computes it inside the opaque {e.registry}"
    if d.rule == "opaque-registry":
        return (f"trainer: its attention on FP32-upcast inputs, rounded once, differs on {d.train.changed:.0%} of "
                f"the output; {e.registry}")
    return "no engine value matched"


def sites_of(plan: list[Decision], train: Graph, engine_graphs: list[Graph]) -> list[Site]:
    """The one-sided decisions as sites (region and kind are set by group_regions)."""
    tnodes = train.node_map()
    enodes = {n.name: n for g in engine_graphs for n in g.nodes}
    by_graph = {g.name: g.node_map() for g in engine_graphs}  # node names repeat across graphs (pieces, ranks)
    sites = []
    for d in (d for d in plan if d.site):
        t = tnodes[d.node]
        side = "train" if d.train.on_grid else "engine"
        e = d.evidence
        if d.rule == "matched":
            engine = _ref(by_graph.get(e.engine_graph, {}).get(e.engine_node) or enodes[e.engine_node],
                          d.engine.how if d.engine else "", kernel=e.kernel or None)
        else:
            engine = SideRef(node="", op=e.engine_node, kernel=e.kernel or None, how=d.engine.how if d.engine else "")
        measured = d.train.changed if side == "train" else d.engine.changed if d.engine else None
        changed = measured if measured is not None else 1.0
        # kind "other" until group_regions (or find_sites) sets the site's own
        sites.append(Site(id=d.id, region="", kind="other", layer=d.layer, rounded_on=side, train=_ref(t, d.train.how),
                          engine=engine, matched=d.rule == "matched", confidence=e.confidence,
                          changed_fraction=changed, evidence=summary(d)))
    return sites


def find_sites(train: Graph, train_values: dict[str, object], changed: dict[str, float], engine: Graph,
               er: EngineRounding, matches: list[Match], unmatched: list[str]) -> list[Site]:
    """The sites of one engine graph (the decisions' one-sided part), kinds set: for single-graph callers."""
    sites = sites_of(decide(train, train_values, changed, engine, er, matches, unmatched), train, [engine])
    for s in sites:
        s.kind = classify(train, s.train.node)[0]
    return sites
