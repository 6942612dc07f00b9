"""The rounding plan: one decision per trainer value, by named rules.

A site is a training-graph value that one side rounds to low precision and the other does not.
Matched values compare the two sides' rounding directly. A training value with no engine
counterpart (the engine decomposes that computation differently) is a site when the trainer
rounds it and the engine computes the whole stretch around it inside one fused kernel —
in FP32 registers — which the replay of that kernel has verified.

Each decision carries a stable id (module path, source line, the op's position on that line), the
rule that made it and its evidence as fields. `graphdiff.analysis.reads` marks how the engine's readers read the
values, `graphdiff.analysis.sites` makes the one-sided decisions sites, `graphdiff.analysis.kinds` decides a site's
kind from the dataflow around it (no model names), `graphdiff.analysis.regions` groups the sites into regions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphdiff.analysis.match import Match
from graphdiff.analysis.opaque import ExternRule, extern_rule
from graphdiff.analysis.rounding import EngineRounding, is_view
from graphdiff.ops import CASTS, EXACT, is_heavy, is_low, op_name
from graphdiff.records import Decision, Evidence, Graph, KernelEvidence, Node, SideState, layer_of, walk
from graphdiff.replay.interpreter import LOW

MAX_HOPS = 12


# --- stable ids ------------------------------------------------------------------------------------

def stable_ids(graph: Graph) -> dict[str, str]:
    """`module/file:line/op.k` for every computing node: the k-th `op` that source line issues in that module.

    Built only from what the model code says (module path, source line, op), so an id survives other token
    counts, other kinds found in the same module, and re-traces that number nodes differently."""
    seen: Counter[tuple] = Counter()
    ids = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        where = f"{Path(n.source.file).name}:{n.source.line}" if n.source else "-"
        key = (n.module, where, op_name(n.target))
        ids[n.name] = f"{n.module or '<root>'}/{where}/{key[2]}.{seen[key]}"
        seen[key] += 1
    return ids


# --- dataflow around a value ----------------------------------------------------------------------

def step(graph: Graph, down: bool) -> Callable[[str], list[str]]:
    """A node's users (`down`) or inputs: the step of a walk along the dataflow."""
    nodes, users = graph.node_map(), graph.users()
    return (lambda name: users.get(name, [])) if down else (lambda name: nodes[name].inputs)


def _representable(v: object) -> bool:
    """Does this value already sit on the BF16 grid (was it rounded here or upstream)?"""
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        return False
    return v.dtype in LOW or torch.equal(v.to(torch.bfloat16).to(v.dtype), v)


def _same_value_chain(graph: Graph, start: str) -> list[str]:
    users, nodes = graph.users(), graph.node_map()
    return [start, *walk([start], lambda n: [u for u in users.get(n, [])
                                             if is_view(nodes[u]) or op_name(nodes[u].target) in CASTS])]


def _base(engine: Graph, e: str) -> str:
    nodes = engine.node_map()
    while is_view(nodes[e]) and nodes[e].inputs:
        e = nodes[e].inputs[0]
    return e


def _fp32_readers(engine: Graph, base: str, chain: list[str]) -> list[str]:
    """Computing consumers of an FP32 value and its FP32 views (not its casts)."""
    nodes, users = engine.node_map(), engine.users()
    return [u for c in chain if not is_low(nodes[c].dtype) for u in users.get(c, [])
            if u not in chain and nodes[u].op == "call_function" and op_name(nodes[u].target) not in CASTS]


def engine_state(e: str, engine: Graph, er: EngineRounding) -> SideState:
    """How the engine holds the value of node `e`: rounded here, on the grid from upstream, or FP32."""
    nodes = engine.node_map()
    base = _base(engine, e)
    kernel = nodes[base].kernel
    # The value is rounded right after it is computed if it, or a cast/view of it that carries the
    # same value, is what a kernel stores in low precision -- unless only a downcast copy is stored and the
    # value's own consumers read it in FP32 (vLLM's residual `r = x.to(bf16)`, a graph output when it is live
    # across a piecewise split, while the norm reads the FP32 sum).
    chain = _same_value_chain(engine, base)
    for same in chain:
        if same in er.rounded:
            readers = _fp32_readers(engine, base, chain) if same != base and not is_low(nodes[base].dtype) else []
            if readers:
                return SideState(dtype="float32", how=f"FP32 for {', '.join(readers[:4])} in "
                                                      f"{(kernel or '').split(':')[0]} (a BF16 copy is "
                                                      f"{er.rounded[same]})")
            return SideState(dtype=nodes[same].dtype, rounds=True, on_grid=True, how=f"rounded: {er.rounded[same]}")
    if _representable(er.values.get(e)):
        return SideState(dtype=nodes[e].dtype, on_grid=True, how="already on the BF16 grid here (loaded or "
                                                                  "rounded upstream)")
    return SideState(dtype="float32", how=f"FP32 in {kernel.split(':')[0]}" if kernel else "not rounded")


def train_state(t: Node, value: object, changed: dict[str, float]) -> SideState:
    """Eager stores every op's result in its dtype: a computing op with a low-precision result rounds there."""
    rounds = is_low(t.dtype) and op_name(t.target) not in EXACT
    frac = changed.get(t.name)
    how = (f"rounded to {t.dtype} (changes {frac:.0%} of elements)" if rounds and frac else
           f"stored in {t.dtype}" + (" (exact here)" if rounds else ""))
    return SideState(dtype=t.dtype, rounds=rounds, on_grid=_representable(value), changed=frac, how=how)


def _nearest_matched(graph: Graph, start: str, matched: dict[str, Match], down: bool) -> str | None:
    nodes = graph.node_map()
    reached = walk([start], step(graph, down), hops=MAX_HOPS,
                   through=lambda o: nodes[o].op == "call_function" and not is_heavy(nodes[o].target))
    return next((other for other in reached if other in matched), None)


def _producing_kernel(engine: Graph, name: str) -> str | None:
    """The generated kernel computing a node, looking through glue (views, aliasing concatenation)."""
    nodes = engine.node_map()
    generated = {k.id for k in engine.kernels if k.kind == "generated"}
    if nodes[name].kernel:
        return nodes[name].kernel if nodes[name].kernel in generated else None
    glue = walk([name], lambda n: nodes[n].inputs, through=lambda n: not nodes[n].kernel, hops=MAX_HOPS - 1)
    return next((nodes[n].kernel for n in glue if nodes[n].kernel in generated), None)


def _anchors(train: Graph, engine: Graph, by_train: dict[str, Match]) -> dict[str, Match]:
    """Matched values plus shared graph inputs (weights, activations): what anchors an in-kernel stretch."""
    by_param = {name: node for node, name in engine.inputs.items()}
    anchors = dict(by_train)
    for node, name in train.inputs.items():
        if name in by_param:
            anchors[node] = Match(node, by_param[name], 0.0, 1.0, "same graph input")
    return anchors


def _replay_fields(kernel: str | None, replays: dict[str, KernelEvidence]) -> dict:
    rep = replays.get(kernel or "")
    return dict(replay_predicted=round(rep.predicted_bitexact, 6), replay_naive=round(rep.naive_bitexact, 6)) \
        if rep else {}


# --- the rules of a decision -----------------------------------------------------------------------

@dataclass
class _Evidence:
    """What the rules read besides the trainer node: both graphs, the engine's rounding and the matches."""
    train: Graph
    engine: Graph
    er: EngineRounding
    by_train: dict[str, Match]  # trainer node -> its engine match
    anchors: dict[str, Match]  # matches plus shared graph inputs: what can start or end an in-engine stretch
    unmatched: set[str]
    rounded: set[str]  # trainer nodes whose low-precision store changes some element
    kernel_inputs: dict[str, set[str]]  # engine kernel id -> the engine nodes it reads
    replays: dict[str, KernelEvidence]
    device: str = "cpu"  # where the engine's kernels ran: the registry key's device


@dataclass
class _Stretch:
    """Around an unmatched trainer value: the match of the nearest matched value below it and of the nearest
    anchor above it, the ends of the stretch the engine computes without a node of its own for the value."""
    below: Match | None
    above: Match | None


def _stretch(ev: _Evidence, name: str) -> _Stretch:
    below = _nearest_matched(ev.train, name, ev.by_train, down=True)
    above = _nearest_matched(ev.train, name, ev.anchors, down=False)
    return _Stretch(ev.by_train[below] if below else None, ev.anchors[above] if above else None)


def _compared_after_downcast(ev: _Evidence, t: Node) -> bool:
    """Rule: a matched FP32 trainer value that a downcast of the same value follows is not decided here; the two
    sides are compared at that downcast. Unless an op also reads the FP32 value itself (a residual sum the next
    residual add reads in FP32 while a matmul reads its downcast): that op computes with what the engine may have
    rounded, so the value is decided here."""
    if t.name not in ev.by_train or is_low(t.dtype):
        return False
    tnodes, users = ev.train.node_map(), ev.train.users()
    chain = _same_value_chain(ev.train, t.name)
    # the chain up to its downcasts: the FP32 value itself
    unrounded = {t.name, *walk([t.name], lambda n: [u for u in users.get(n, [])
                                                    if u in chain and not is_low(tnodes[u].dtype)])}
    if any(u not in chain for c in unrounded for u in users.get(c, [])):
        return False
    return any(is_low(tnodes[c].dtype) and not is_view(tnodes[c]) for c in chain[1:])


def _rule_matched(ev: _Evidence, t: Node, ts: SideState, base: dict[str, Any]) -> Decision | None:
    """Rule "matched": the value has an engine counterpart. It is a site where exactly one side's value is on the
    BF16 grid and that side's op at this node is what put it there (otherwise the site is upstream)."""
    m = ev.by_train.get(t.name)
    if m is None:
        return None
    es = engine_state(m.engine, ev.engine, ev.er)
    kernel = ev.engine.node_map()[_base(ev.engine, m.engine)].kernel
    one_side_on_grid = ts.on_grid != es.on_grid
    rounded_here = t.name in ev.rounded if ts.on_grid else es.rounds
    return Decision(**base, engine=es, rule="matched", site=one_side_on_grid and rounded_here, evidence=Evidence(
        engine_node=m.engine, engine_graph=ev.engine.name, kernel=kernel or "", distance=m.distance,
        runner_up=m.runner_up, confidence=m.confidence, **_replay_fields(kernel, ev.replays)))


def _rule_inside_kernel(ev: _Evidence, base: dict[str, Any], s: _Stretch) -> Decision | None:
    """Rule "inside-kernel": an unmatched value the trainer rounds, in a stretch that one generated engine kernel
    computes whole (the kernel producing the matched value below reads, or itself computes, the anchor above):
    FP32 registers in the engine, a site."""
    below, above = s.below, s.above
    if below is None or above is None or (kernel := _producing_kernel(ev.engine, below.engine)) is None:
        return None
    computed_in_kernel = ev.engine.node_map()[above.engine].kernel == kernel
    if not (computed_in_kernel or above.engine in ev.kernel_inputs.get(kernel, ())):
        return None
    return Decision(**base, engine=SideState(dtype="float32", how=f"FP32 inside {kernel.split(':')[0]}"),
                    rule="inside-kernel", site=True, evidence=Evidence(
                        engine_graph=ev.engine.name, kernel=kernel, stretch=[above.engine, below.engine],
                        confidence=min(below.confidence, above.confidence), **_replay_fields(kernel, ev.replays)))


def _rule_opaque_registry(ev: _Evidence, t: Node, base: dict[str, Any], s: _Stretch) -> Decision | None:
    """Rule "opaque-registry": an unmatched value the trainer rounds, after an input of an opaque op that the
    registry says computes in FP32 inside, with no matched value below it or that op computing the one below: FP32
    in the engine, a site; except the value that leaves the stretch for a boundary (the op's output), which both
    sides round once."""
    below, above = s.below, s.above
    if above is None or (extern := _fp32_extern_reading(ev.engine, above.engine, ev.device)) is None:
        return None
    kid, rule = extern
    if below is not None and _producing_call(ev.engine, below.engine) != kid:
        return None
    output = _leaves_for_boundary(ev.train, t.name)
    state = SideState(dtype=t.dtype, rounds=True, on_grid=True, how=f"the output of {rule.op}, rounded once "
                      "(registry)") if output else SideState(dtype="float32", how=f"FP32 inside {rule.op} (registry)")
    return Decision(**base, engine=state, rule="opaque-registry", site=not output, evidence=Evidence(
        engine_graph=ev.engine.name, kernel=kid, stretch=[above.engine], registry=f"{rule.op}: {rule.rounds} "
        f"({rule.source})", confidence=above.confidence))


def _rule_unmatched(ev: _Evidence, t: Node, base: dict[str, Any]) -> Decision | None:
    """An unmatched value the trainer rounds: decided by the stretch around it ("inside-kernel", then
    "opaque-registry")."""
    if t.name not in ev.unmatched or t.name not in ev.rounded:
        return None
    s = _stretch(ev, t.name)
    return _rule_inside_kernel(ev, base, s) or _rule_opaque_registry(ev, t, base, s)


def _decided(t: Node, v: object) -> bool:
    """A floating computing value (not a view): what the plan decides."""
    return t.op == "call_function" and not is_view(t) and isinstance(v, torch.Tensor) and v.is_floating_point()


def decide(train: Graph, train_values: dict[str, object], changed: dict[str, float], engine: Graph,
           er: EngineRounding, matches: list[Match], unmatched: list[str], device: str = "cpu") -> list[Decision]:
    """One decision per floating trainer value this engine graph says something about (and, with no engine
    evidence, the trainer side alone): the first rule that holds, "matched", "inside-kernel", "opaque-registry",
    else "no-engine-value". `device`: where the engine's kernels ran (only the registry's entries for it decide)."""
    enodes = engine.node_map()
    by_train = {m.train: m for m in matches}
    ev = _Evidence(train=train, engine=engine, er=er, by_train=by_train, anchors=_anchors(train, engine, by_train),
                   unmatched=set(unmatched), rounded={n for n, f in changed.items() if f > 0},
                   kernel_inputs={k.id: {i for n in k.nodes for i in enodes[n].inputs} for k in engine.kernels},
                   replays={r.kernel: r for r in er.replays}, device=device)
    ids = stable_ids(train)
    out: list[Decision] = []
    for t in train.nodes:
        v = train_values.get(t.name)
        if not _decided(t, v) or _compared_after_downcast(ev, t):
            continue
        ts = train_state(t, v, changed)
        base: dict[str, Any] = dict(id=ids[t.name], node=t.name, op=t.target, module=t.module,
                                    layer=layer_of(t.module), train=ts)  # the fields every rule's decision has
        out.append(_rule_matched(ev, t, ts, base) or _rule_unmatched(ev, t, base)
                   or Decision(**base, rule="no-engine-value"))
    return out


def _leaves_for_boundary(train: Graph, name: str) -> bool:
    """Does the value only flow (through exact ops) into matmul/attention-like ops: the end of a stretch?"""
    nodes = train.node_map()

    def boundary(u: str) -> bool:
        return is_heavy(nodes[u].target) or nodes[u].op == "output"

    reached = walk([name], step(train, down=True), through=lambda u: not boundary(u))
    return all(boundary(u) or op_name(nodes[u].target) in EXACT for u in reached)


def _producing_call(engine: Graph, name: str) -> str | None:
    """The kernel call (generated or extern) computing a node, looking through glue."""
    nodes = engine.node_map()
    if nodes[name].kernel:
        return nodes[name].kernel
    return next((nodes[n].kernel for n in walk([name], lambda n: nodes[n].inputs, hops=MAX_HOPS - 1)
                 if nodes[n].kernel), None)


def _fp32_extern_reading(engine: Graph, name: str, device: str = "cpu") -> tuple[str, ExternRule] | None:
    """An opaque op the registry says computes in FP32 inside (rounding once per output) that reads the value of
    `name` (or a view of it): then trainer values between that input and the op's outputs are FP32 in the engine."""
    nodes = engine.node_map()
    for u in walk([name], step(engine, down=True), through=lambda u: is_view(nodes[u])):
        kid = nodes[u].kernel or ""
        rule = extern_rule(kid.split(":")[0], device=device) if kid else None
        if rule is not None and rule.fp32_inside and rule.kind not in ("matmul", "kv-cache") and \
                any(k.id == kid and k.kind == "extern" for k in engine.kernels):
            return kid, rule
    return None


def merge_decisions(train: Graph, per_graph: list[list[Decision]]) -> list[Decision]:
    """One decision per trainer value over all engine graphs, in trainer graph order: evidence beats no evidence,
    a match beats an in-kernel stretch (piecewise engines compile several graphs; each value is computed in one)."""
    rank = {"matched": 0, "opaque-registry": 1, "inside-kernel": 2, "no-engine-value": 3}

    def order(d: Decision) -> int:  # inside an opaque op's module (MoE experts) its registry decides, not a match
        return -1 if d.rule == "opaque-registry" and d.evidence.stretch and d.evidence.stretch[0] == (
            d.module or "")[:len(d.evidence.stretch[0])] else rank[d.rule]

    best: dict[str, Decision] = {}
    for decisions in per_graph:
        for d in decisions:
            if d.node not in best or order(d) < order(best[d.node]):
                best[d.node] = d
    return sorted(best.values(), key=lambda d: train.position(d.node))
