"""The rounding plan (one decision per trainer value, by named rules) and the sites in it.

A site is a training-graph value that one side rounds to low precision and the other does not.
Matched values compare the two sides' rounding directly. A training value with no engine
counterpart (the engine decomposes that computation differently) is a site when the trainer
rounds it and the engine computes the whole stretch around it inside one fused kernel —
in FP32 registers — which the replay of that kernel has verified.

Each decision carries a stable id (module path, source line, the op's position on that line), the
rule that made it and its evidence as fields. A site's kind is decided from the dataflow around it (no
model names, see `classify`); `graphdiff.analysis.regions` groups the sites into regions.
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
from graphdiff.ops import ACTIVATIONS, CASTS, EXACT, ROUTING, is_attention, is_heavy, is_low, op_name
from graphdiff.records import (
    Decision,
    Evidence,
    Graph,
    KernelEvidence,
    Node,
    RegionKind,
    SideRef,
    SideState,
    Site,
    layer_of,
    walk,
)
from graphdiff.replay.interpreter import LOW
from graphdiff.replay.kernels import value_base
from graphdiff.replay.sum_order import cpp_rereads_store

MAX_HOPS = 12
NORMS = frozenset({"rsqrt", "native_layer_norm"})  # where a normalization shows in an ATen graph (RMSNorm, LayerNorm)


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

def _closure(graph: Graph, start: str, down: bool) -> tuple[set[str], set[str]]:
    """Nodes reachable from `start` without crossing a matmul/attention/embedding/expert op, and the ops of those
    boundary nodes it reaches ("attention", "embedding", "mm", ...; the graph output as "output")."""
    nodes = graph.node_map()

    def boundary(name: str) -> bool:
        return is_heavy(nodes[name].target) or nodes[name].op == "output"

    seen, edges = {start}, set()
    for other in walk([start], _step(graph, down), hops=MAX_HOPS,
                      through=lambda o: not boundary(o) and nodes[o].op == "call_function"):
        n = nodes[other]
        if boundary(other):
            edges.add("attention" if is_attention(n.target) else "output" if n.op == "output" else op_name(n.target))
        elif n.op == "call_function":
            seen.add(other)
    return seen, edges


def _step(graph: Graph, down: bool) -> Callable[[str], list[str]]:
    """A node's users (`down`) or inputs: the step of a walk along the dataflow."""
    nodes, users = graph.node_map(), graph.users()
    return (lambda name: users.get(name, [])) if down else (lambda name: nodes[name].inputs)


def _scaled_by_constant(n: Node, nodes: dict[str, Node]) -> bool:
    """A multiply or divide by a constant (a config number, or a 0-d tensor such as Gemma's sqrt(hidden)), not by
    another activation."""
    if op_name(n.target) not in ("mul", "div"):
        return False
    for a in n.call[0][:2]:
        if isinstance(a, int | float) and not isinstance(a, bool):
            return True
        if isinstance(a, dict) and "node" in a and nodes[a["node"]].shape == []:
            return True
    return False


def _from_parameters(n: Node, nodes: dict[str, Node]) -> bool:
    """Computed from parameters and constants only (a weight offset such as LayerNorm1P's `weight + 1`)."""
    ins = [nodes[i] for i in n.inputs]
    return bool(ins) and all(i.op == "placeholder" and i.param is not None for i in ins)


def classify(graph: Graph, name: str, experts: set[str] | frozenset[str] = frozenset()) -> tuple[RegionKind, str]:
    """(kind, the dataflow fact that decided it), first rule that holds; `experts`: the nodes inside MoE experts
    modules (moe.experts_nodes)."""
    nodes = graph.node_map()
    n = nodes[name]
    up, up_edges = _closure(graph, name, down=False)
    down, down_edges = _closure(graph, name, down=True)
    up_ops = {op_name(nodes[x].target) for x in up}
    down_ops = {op_name(nodes[x].target) for x in down}
    norm_up, norm_down = bool(up_ops & NORMS), bool(down_ops & NORMS)
    norm_near = norm_up or norm_down
    if up_ops & {"cos", "sin"}:
        return "rope", "depends elementwise on a cos/sin table"
    if norm_up and "attention" in down_edges:
        return "qk_norm", "inside a normalization (rsqrt, layer_norm) whose output flows into attention"
    if name in experts:
        return "expert_combine", "inside an MoE experts module: the experts' GEMMs, activation and weighted sum"
    if up_ops & ROUTING and not (up & experts):
        return "router", f"from the {'/'.join(sorted(up_ops & ROUTING))} of router logits, before the experts"
    if (acts := up_ops & ACTIVATIONS) and not norm_near:
        return "gated_act", f"elementwise on the output of {', '.join(sorted(acts))}, no normalization in reach"
    if _scaled_by_constant(n, nodes) and "embedding" in up_edges:
        return "embedding_scale", "the embedding lookup scaled by a constant"
    if norm_down and not norm_up and _from_parameters(n, nodes):
        return "norm_weight", "a normalization's weight computed from its parameter (w + 1) before it normalizes"
    if _scaled_by_constant(n, nodes) and norm_down and not norm_up:
        return "residual_scale", "a matmul output scaled by a constant before the residual add and a normalization"
    if op_name(n.target) == "add" and norm_down and not norm_up:
        return "residual_norm", "an add whose result flows into a normalization (rsqrt, layer_norm)"
    if norm_up:
        return "norm_weight", "inside a normalization, after its rsqrt"
    if (_scaled_by_constant(n, nodes) or op_name(n.target) == "tanh") and "output" in down_edges and not norm_near:
        return "logit_scale", "the logits scaled (or soft-capped) by a constant on their way out"
    return "other", "no known pattern in its elementwise neighbourhood"


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
    reached = walk([start], _step(graph, down), hops=MAX_HOPS,
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

    reached = walk([name], _step(train, down=True), through=lambda u: not boundary(u))
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
    for u in walk([name], _step(engine, down=True), through=lambda u: is_view(nodes[u])):
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


def _read_path(engine: Graph, name: str) -> list[Node]:
    """The engine nodes an input is read through, back over views and casts, to a placeholder or the first
    computing node."""
    nodes = engine.node_map()
    path = [nodes[name]]
    while path[-1].inputs and (is_view(path[-1]) or op_name(path[-1].target) in CASTS):
        path.append(nodes[path[-1].inputs[0]])
    return path


def _one_kernel_store(t: Decision, graph: Graph) -> tuple[Node, set[str]] | None:
    """`t`'s engine value where one kernel computes it and its buffer is low precision: (its node, that kernel)."""
    base = value_base(graph.node_map(), t.evidence.engine_node)
    own = graph.computed_in().get(base.name, set()) if base is not None else set()
    return (base, own) if base is not None and is_low(base.dtype) and len(own) == 1 else None


def _reads_rounded(t: Decision, u: Decision, graphs: dict[str, Graph]) -> bool:
    """Does the engine op matched to consumer `u` read the value of `t` through a low-precision copy in memory?
    Across graphs (a piecewise engine): `t`'s value enters `u`'s graph as an input, and does when every activation
    input the op reads is low precision (a graph input's dtype is how it was stored). Inside one graph: one kernel
    computes `t`'s value (in FP32, for its own readers) and stores its low-precision buffer, and `u`'s op runs in
    other kernels, which load that buffer (Inductor realizes a sum it otherwise recomputes in each consumer)."""
    ug = graphs.get(u.evidence.engine_graph)
    if ug is None or u.evidence.engine_node not in ug.node_map():
        return False
    unodes = ug.node_map()
    if t.evidence.engine_graph == u.evidence.engine_graph:
        stored = _one_kernel_store(t, ug)
        here = ug.computed_in().get(u.evidence.engine_node, set())
        return stored is not None and bool(here) and not here & stored[1] and any(
            (b := value_base(unodes, i)) is not None and b.name == stored[0].name
            for i in unodes[u.evidence.engine_node].inputs)
    reads = [_read_path(ug, i) for i in unodes[u.evidence.engine_node].inputs]
    acts = [p[-1] for p in reads if p[-1].op == "placeholder" and p[-1].dtype
            and "." not in ug.inputs.get(p[-1].name, "")]  # not a weight
    return bool(acts) and all(is_low(n.dtype) for n in acts)


def _loads_store(t: Decision, u: Decision, graphs: dict[str, Graph]) -> bool:
    """Does the kernel computing the unmatched consumer `u` inside it ("inside-kernel") load the low-precision copy
    of `t`'s value that another kernel stored? (vLLM's Cohere sums `residual + (attn + mlp)`: the next layer's
    kernel adds the block's two outputs to the residual its previous kernel stored in BF16, so the trainer's
    `residual + attn` has no engine value of its own.)"""
    graph = graphs.get(u.evidence.engine_graph)
    if graph is None or t.evidence.engine_graph != graph.name or not u.evidence.kernel:
        return False
    stored = _one_kernel_store(t, graph)
    kernel = next((k for k in graph.kernels if k.id == u.evidence.kernel), None)
    if stored is None or kernel is None or kernel.id in stored[1]:
        return False
    nodes = graph.node_map()
    return any(stored[0].name in nodes[n].inputs for n in kernel.nodes if n in nodes)


def _read_beside_store(t: Decision, graphs: dict[str, Graph]) -> bool:
    """Is `t`'s engine value, stored in low precision by the one kernel computing it, also read inside that kernel
    (in FP32, before the store)?"""
    graph = graphs.get(t.evidence.engine_graph)
    stored = _one_kernel_store(t, graph) if graph is not None else None
    return graph is not None and stored is not None and any(
        graph.computed_in().get(u, set()) & stored[1] for u in graph.users().get(stored[0].name, []))


def _matched_consumers(train: Graph, plan: list[Decision]) -> tuple[dict[str, Decision], Callable[[str], list[str]]]:
    """The matched decisions by trainer node, and a trainer node's consumers looking through views."""
    nodes, users = train.node_map(), train.users()

    def consumers(name: str) -> list[str]:
        return [c for u in users.get(name, []) for c in (consumers(u) if is_view(nodes[u]) else [u])]

    return {d.node: d for d in plan if d.rule == "matched"}, consumers


def mark_rounded_reads(train: Graph, plan: list[Decision], engine_graphs: list[Graph]) -> None:
    """Values the engine holds in FP32 but feeds some consumers as a low-precision copy: the consumers are listed
    in `evidence.read_rounded_by`. Where the trainer holds such a value in FP32 (a patch made it so) the copy is a
    rounding on the engine side only: a site. A value the engine state calls rounded (stored) is one too where the
    kernel storing it also reads it in FP32 (the norm beside a layer's last residual sum, whose store the final
    norm's kernel loads)."""
    graphs = {g.name: g for g in engine_graphs}
    by_node, consumers = _matched_consumers(train, plan)
    nodes = train.node_map()
    inside = {d.node: d for d in plan if d.rule == "inside-kernel"}
    for t in plan:
        if t.rule != "matched" or t.engine is None:
            continue
        if t.engine.on_grid and not _read_beside_store(t, graphs):
            continue
        matched = [u for u in consumers(t.node) if u in by_node and _reads_rounded(t, by_node[u], graphs)]
        loads = [u for u in consumers(t.node) if u in inside and _loads_store(t, inside[u], graphs)]
        readers = matched + loads
        if readers:
            t.evidence.read_rounded_by = [by_node[u].id for u in matched] + [inside[u].id for u in loads]
            t.engine.how += f"; read through a low-precision copy by {', '.join(t.evidence.read_rounded_by[:3])}"
            # a reader that is the trainer's own downcast reads it rounded as the engine does (a patch's rounded read)
            unrounded = [u for u in readers if not (op_name(nodes[u].target) in CASTS and is_low(nodes[u].dtype))]
            t.site = t.site or (not t.train.on_grid and bool(unrounded))


def mark_fp32_reads(train: Graph, plan: list[Decision], engine_graphs: list[Graph]) -> None:
    """Values the engine stores in low precision but also hands an FP32 consumer unrounded: the kernel computing
    the value converts it to FP32 itself, so the store's rounding never reaches that consumer (vLLM's router GEMM
    in FP32 reads a norm's product this way, the experts and the other GEMMs its BF16 store). Where the trainer
    rounds the value and its own consumer upcasts it to FP32, the engine holds it in FP32: a site on the trainer's
    side (the other consumers read it rounded, `read_rounded_by`, as the engine's GEMMs and fused-MoE op load it)."""
    graphs = {g.name: g for g in engine_graphs}
    by_node, consumers = _matched_consumers(train, plan)
    nodes = train.node_map()
    for t in plan:
        if t.rule != "matched" or t.engine is None or not t.engine.rounds or not t.train.rounds:
            continue
        graph = graphs.get(t.evidence.engine_graph)
        stored = _one_kernel_store(t, graph) if graph is not None else None
        if graph is None or stored is None:
            continue
        enodes, computed = graph.node_map(), graph.computed_in()
        readers = [by_node[u].id for u in consumers(t.node)
                   if u in by_node and op_name(nodes[u].target) in CASTS and not is_low(nodes[u].dtype)
                   and by_node[u].evidence.engine_graph == graph.name
                   and (e := enodes.get(by_node[u].evidence.engine_node)) is not None and not is_low(e.dtype)
                   and computed.get(e.name, set()) & stored[1]
                   and any(b is not None and b.name == stored[0].name for b in [value_base(enodes, e.name)])]
        if readers:
            kernel = next(iter(stored[1])).split(":")[0]
            t.engine = t.engine.model_copy(update=dict(
                dtype="float32", rounds=False, on_grid=False,
                how=f"FP32 for {', '.join(readers[:3])} in {kernel} (a BF16 copy is stored for the other readers)"))
            t.site = True


def mark_reads(train: Graph, plan: list[Decision], engine_graphs: list[Graph]) -> None:
    """Where the engine reads a value otherwise than its state says, for some of its consumers: through a stored
    low-precision copy (`mark_rounded_reads`), in FP32 beside its store (`mark_fp32_reads`), recomputed in FP32 by
    another kernel (`mark_recomputed_reads`)."""
    mark_rounded_reads(train, plan, engine_graphs)
    mark_fp32_reads(train, plan, engine_graphs)
    mark_recomputed_reads(train, plan, engine_graphs)
    mark_reloaded_casts(train, plan, engine_graphs)


def mark_reloaded_casts(train: Graph, plan: list[Decision], engine_graphs: list[Graph]) -> None:
    """A trainer downcast of an FP32 value (a patch's rounded read) matched to the engine's FP32 copy of a value its
    kernel stores in low precision and reads back in a later loop (a norm whose kernel reloads the residual sum it
    stored): the engine rounds there too, for the readers after the reload. Not a site."""
    graphs = {g.name: g for g in engine_graphs}
    nodes = train.node_map()
    for t in plan:
        n = nodes.get(t.node)
        graph = graphs.get(t.evidence.engine_graph)
        if (t.rule != "matched" or t.engine is None or t.engine.rounds or graph is None or n is None
                or op_name(n.target) not in CASTS or not is_low(n.dtype) or not n.inputs
                or is_low(nodes[n.inputs[0]].dtype)):
            continue
        stored = _one_kernel_store(t, graph)
        kernel = next((k for k in graph.kernels if stored is not None and k.id in stored[1]), None)
        if (kernel is not None and stored is not None and cpp_rereads_store(kernel.code)
                and any(a.node == stored[0].name and a.role in ("out", "inout") for a in kernel.args)):
            t.engine = t.engine.model_copy(update=dict(
                dtype=stored[0].dtype, rounds=True, on_grid=True,
                how=f"rounded: stored by {kernel.name} and read back by its later loop"))
            t.site = False


def mark_recomputed_reads(train: Graph, plan: list[Decision], engine_graphs: list[Graph]) -> None:
    """Values the engine stores in low precision (or stores only what exact ops make of them) while a kernel that
    recomputes them reads them in FP32: Inductor inlines a pointwise value into every kernel consuming it, so the
    RoPE kernel's `q * cos` reads a q/k norm's output unrounded while the kernel storing the rotate-half copy rounds
    it. Those consumers read it in FP32 in the engine: where the trainer rounds the value, a site on the trainer's
    side (where it holds it in FP32, a patched trainer, none); the consumers reading the stored copy (or an exact
    op of it that is stored) are `read_rounded_by`. One kernel reads it so too where it stores only part of the
    value or exact ops of it (OLMo 2's RoPE: the k norm's rotate-half halves stored, `k * cos` in a later loop)."""
    graphs = {g.name: g for g in engine_graphs}
    by_node, consumers = _matched_consumers(train, plan)
    for t in plan:
        if t.rule != "matched" or t.engine is None or not t.engine.rounds:
            continue
        graph = graphs.get(t.evidence.engine_graph)
        base = value_base(graph.node_map(), t.evidence.engine_node) if graph is not None else None
        if graph is None or base is None or not is_low(base.dtype) or not (
                len(graph.computed_in().get(base.name, ())) > 1 or _stored_only_in_part(graph, base)):
            continue
        fp32, rounded = _recomputed_readers(graph, base, [by_node[u] for u in consumers(t.node) if u in by_node])
        if fp32:
            computed = graph.computed_in()
            kernels = sorted({k.split(":")[0] for d in fp32 for k in computed.get(d.evidence.engine_node, ())})
            t.engine = t.engine.model_copy(update=dict(
                dtype="float32", rounds=False, on_grid=False,
                how=f"FP32 for {', '.join(d.id for d in fp32[:3])}, recomputed in {', '.join(kernels)} (a BF16 copy "
                    "is stored for the other readers)"))
            t.evidence.read_rounded_by = [d.id for d in rounded]
            t.site = t.train.rounds


def _stored_only_in_part(graph: Graph, base: Node) -> bool:
    """Is `base` computed in one generated kernel that stores none of it whole, only views of parts or exact ops of it
    (a concatenation's halves)? Its other readers in that kernel then read it in registers, in FP32."""
    kernels = graph.computed_in().get(base.name, set())
    if len(kernels) != 1 or not any(k.id in kernels and k.kind == "generated" for k in graph.kernels):
        return False
    nodes = graph.node_map()
    for k in graph.kernels:
        for a in k.args:
            stored = value_base(nodes, a.node) if a.node and a.role in ("out", "inout") else None
            if stored is not None and stored.name == base.name:
                return False
    return True


def _recomputed_readers(graph: Graph, base: Node, readers: list[Decision]) -> tuple[list[Decision], list[Decision]]:
    """The matched consumers of `base`'s value split: those whose engine op computes (not an exact op) in a kernel
    that recomputes `base` and reads it there directly, unrounded (whether it rounds its own result or not: OLMo 2's
    next residual sum); and the others (they read a stored copy)."""
    enodes, computed = graph.node_map(), graph.computed_in()
    own = computed.get(base.name, set())
    fp32, rounded = [], []
    for d in readers:
        e = enodes.get(d.evidence.engine_node) if d.evidence.engine_graph == graph.name else None
        direct = e is not None and any((b := value_base(enodes, i)) is not None and b.name == base.name
                                       for i in e.inputs)
        if (direct and e is not None and d.engine is not None and (d.engine.rounds or not d.engine.on_grid)
                and computed.get(e.name, set()) & own
                and op_name(e.target) not in EXACT | CASTS):
            fp32.append(d)
        else:
            rounded.append(d)
    return fp32, rounded


def find_sites(train: Graph, train_values: dict[str, object], changed: dict[str, float], engine: Graph,
               er: EngineRounding, matches: list[Match], unmatched: list[str]) -> list[Site]:
    """The sites of one engine graph (the decisions' one-sided part), kinds set: for single-graph callers."""
    sites = sites_of(decide(train, train_values, changed, engine, er, matches, unmatched), train, [engine])
    for s in sites:
        s.kind = classify(train, s.train.node)[0]
    return sites


# --- sites ----------------------------------------------------------------------------------------

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
