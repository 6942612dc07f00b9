"""Rounding sites (values rounded on one side only) and the regions they form.

A site is a training-graph value that one side rounds to low precision and the other does
not. Matched values compare the two sides' rounding directly. A training value with no engine
counterpart (the engine decomposes that computation differently) is a site when the trainer
rounds it and the engine computes the whole stretch around it inside one fused kernel —
in FP32 registers — which the replay of that kernel has verified.

Sites are grouped by the HF module that computes them and a kind from REGION_KINDS, decided
from the dataflow around the site (no model names):
  rope           depends elementwise on a cos/sin table (rotary embedding)
  qk_norm        inside a normalization (rsqrt) whose output flows into attention
  gated_act      an activation (silu, gelu, ...) or elementwise on its output before a matmul
  residual_norm  an add (the residual stream) that flows into a normalization
  norm_weight    inside a normalization, e.g. the cast before the weight multiply
  other          anything else
Regions identical across layers are collapsed (module path `layers.*`, with the layer list).
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from graphdiff.match import Match
from graphdiff.model import Graph, Node, Region, Side, SideRef, Site, is_heavy, layer_of, op_name
from graphdiff.replay import LOW
from graphdiff.rounding import EngineRounding, is_view

ACTIVATIONS = {"silu", "gelu", "sigmoid", "tanh", "relu", "softplus", "mish", "elu", "leaky_relu", "hardswish",
               "gelu_tanh"}
MAX_HOPS = 12


def _closure(graph: Graph, start: str, users: dict[str, list[str]], down: bool) -> tuple[set[str], bool]:
    """Nodes reachable elementwise from `start` (not crossing matmul/attention/embedding), and
    whether an attention op is reached at the boundary (downwards only)."""
    nodes = graph.node_map()
    seen, frontier, attention = {start}, [start], False
    for _ in range(MAX_HOPS):
        nxt = []
        for name in frontier:
            for other in (users.get(name, []) if down else nodes[name].inputs):
                n = nodes[other]
                if is_heavy(n):
                    attention |= down and ("attention" in n.target or "scaled_dot_product" in n.target)
                    continue
                if other not in seen and n.op == "call_function":
                    seen.add(other)
                    nxt.append(other)
        frontier = nxt
    return seen, attention


def classify(graph: Graph, name: str, users: dict[str, list[str]]) -> str:
    nodes = graph.node_map()
    up, _ = _closure(graph, name, users, down=False)
    down, to_attention = _closure(graph, name, users, down=True)
    up_ops = {op_name(nodes[n].target) for n in up}
    down_ops = {op_name(nodes[n].target) for n in down}
    if up_ops & {"cos", "sin"}:
        return "rope"
    if "rsqrt" in up_ops and to_attention:
        return "qk_norm"
    if up_ops & ACTIVATIONS:
        return "gated_act"
    if op_name(nodes[name].target) == "add" and "rsqrt" in down_ops and "rsqrt" not in up_ops:
        return "residual_norm"
    if "rsqrt" in up_ops:
        return "norm_weight"
    return "other"


def users_of(graph: Graph) -> dict[str, list[str]]:
    return graph.users()


def _low(dtype: str | None) -> bool:
    return dtype in ("bfloat16", "float16")


def _representable(v: object) -> bool:
    """Does this value already sit on the BF16 grid (was it rounded here or upstream)?"""
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        return False
    return v.dtype in LOW or torch.equal(v.to(torch.bfloat16).to(v.dtype), v)


def _same_value_chain(graph: Graph, start: str) -> list[str]:
    users = users_of(graph)
    nodes = graph.node_map()
    chain, frontier = [start], [start]
    while frontier:
        nxt = [u for n in frontier for u in users.get(n, [])
               if is_view(nodes[u]) or op_name(nodes[u].target) in ("convert_element_type", "_to_copy")]
        nxt = [u for u in nxt if u not in chain]
        chain += nxt
        frontier = nxt
    return chain


def _engine_state(e: str, engine: Graph, er: EngineRounding) -> tuple[bool, bool, str]:
    """(holds a BF16-grid value, rounds it at this node, how) for an engine node."""
    nodes = engine.node_map()
    base = e
    while is_view(nodes[base]) and nodes[base].inputs:
        base = nodes[base].inputs[0]
    kernel = nodes[base].kernel
    # The value is rounded right after it is computed if it, or a cast/view of it that carries the
    # same value, is what a kernel stores in low precision.
    for same in _same_value_chain(engine, base):
        if same in er.rounded:
            return True, True, f"rounded: {er.rounded[same]}"
    if _representable(er.values.get(e)):
        return True, False, "already on the BF16 grid here (loaded or rounded upstream)"
    return False, False, f"FP32 in {kernel.split(':')[0]}" if kernel else "not rounded"


def _ref(n: Node, how: str) -> SideRef:
    return SideRef(node=n.name, op=n.target, dtype=n.dtype, module=n.module, source=n.source, kernel=n.kernel, how=how)


def _nearest_matched(graph: Graph, start: str, users: dict[str, list[str]], matched: dict[str, Match],
                     down: bool) -> str | None:
    nodes = graph.node_map()
    frontier, seen = [start], {start}
    for _ in range(MAX_HOPS):
        nxt = []
        for name in frontier:
            for other in (users.get(name, []) if down else nodes[name].inputs):
                if other in matched:
                    return other
                if other not in seen and nodes[other].op == "call_function" and not is_heavy(nodes[other]):
                    seen.add(other)
                    nxt.append(other)
        frontier = nxt
    return None


def _producing_kernel(engine: Graph, name: str) -> str | None:
    """The generated kernel computing a node, looking through glue (views, aliasing concatenation)."""
    nodes = engine.node_map()
    generated = {k.id for k in engine.kernels if k.kind == "generated"}
    frontier = [name]
    for _ in range(MAX_HOPS):
        for n in frontier:
            if nodes[n].kernel in generated:
                return nodes[n].kernel
        frontier = [i for n in frontier if not nodes[n].kernel for i in nodes[n].inputs]
        if not frontier:
            return None
    return None


def find_sites(train: Graph, train_values: dict[str, object], train_rounded: dict[str, float], engine: Graph,
               er: EngineRounding, matches: list[Match], unmatched: list[str]) -> list[Site]:
    enodes, tnodes = engine.node_map(), train.node_map()
    by_train = {m.train: m for m in matches}
    users = users_of(train)
    kernel_inputs = {k.id: {i for n in k.nodes for i in enodes[n].inputs} for k in engine.kernels}
    # Graph inputs (weights, activations) anchor in-kernel sites from above like matched values do.
    by_param = {name: node for node, name in engine.inputs.items()}
    anchors: dict[str, Match] = dict(by_train)
    for node, name in train.inputs.items():
        if name in by_param:
            anchors[node] = Match(node, by_param[name], 0.0, 1.0, "same graph input")
    sites: list[Site] = []
    for t in train.nodes:
        m = by_train.get(t.name)
        t_rounds = t.name in train_rounded
        if m is not None and not _low(t.dtype) and any(_low(tnodes[c].dtype) and not is_view(tnodes[c])
                                                        for c in _same_value_chain(train, t.name)[1:]):
            continue  # a downcast of this value follows: compare the two sides there, after it
        if m is not None:
            # A site is where exactly one side's value is on the BF16 grid, and that side's op at
            # this node is what put it there (otherwise the site is upstream).
            t_low = _representable(train_values.get(t.name))
            e_low, e_rounds, how = _engine_state(m.engine, engine, er)
            if t_low == e_low or (t_low and not t_rounds) or (e_low and not e_rounds):
                continue
            side: Side = "train" if t_low else "engine"
            t_how = f"rounded to {t.dtype} (changes {train_rounded.get(t.name, 0):.0%} of elements)" if t_rounds \
                else f"kept in {t.dtype}"
            sites.append(Site(id="", region="", kind="", layer=layer_of(t.module), rounded_on=side,
                              train=_ref(t, t_how), engine=_ref(enodes[m.engine], how), matched=True,
                              confidence=m.confidence, changed_fraction=train_rounded.get(t.name, 1.0),
                              evidence=m.evidence))
        elif t.name in unmatched and t_rounds:
            below = _nearest_matched(train, t.name, users, by_train, down=True)
            above = _nearest_matched(train, t.name, users, anchors, down=False)
            if below is None or above is None:
                continue
            kb = _producing_kernel(engine, by_train[below].engine)
            ea = anchors[above].engine
            if kb is None or not (enodes[ea].kernel == kb or ea in kernel_inputs.get(kb, ())):
                continue
            evidence = (f"no engine node computes this value (other decomposition); the engine computes "
                        f"{ea} -> {by_train[below].engine} inside {kb.split(':')[0]} in FP32 (replay-verified)")
            sites.append(Site(id="", region="", kind="", layer=layer_of(t.module), rounded_on="train",
                              train=_ref(t, f"rounded to {t.dtype} (changes {train_rounded[t.name]:.0%})"),
                              engine=SideRef(node="", op="", kernel=kb, how=f"FP32 inside {kb.split(':')[0]}"),
                              matched=False, confidence=min(by_train[below].confidence, anchors[above].confidence),
                              changed_fraction=train_rounded[t.name], evidence=evidence))
    for s in sites:
        s.kind = classify(train, s.train.node, users)
    return sites


def module_pattern(module: str | None) -> str:
    return re.sub(r"\.(layers|h|blocks|layer)\.\d+(?=\.|$)", r".\1.*", module or "<root>")


def group_regions(sites: list[Site]) -> list[Region]:
    groups: dict[tuple[str, str], list[Site]] = defaultdict(list)
    for s in sites:
        groups[(module_pattern(s.train.module), s.kind)].append(s)
    patterns = defaultdict(int)
    for pattern, kind in groups:
        patterns[pattern] += kind != "attention"  # an attention region never renames the module's other region
    regions = []
    for (pattern, kind), members in groups.items():
        name = pattern if patterns[pattern] == 1 and kind != "attention" else f"{pattern}#{kind}"
        by_layer: dict[int | None, list[Site]] = defaultdict(list)
        for s in members:
            by_layer[s.layer].append(s)
        layers = sorted(by_layer, key=lambda x: -1 if x is None else x)

        def signature(ss: list[Site]) -> list[tuple]:
            return sorted((op_name(s.train.op), s.rounded_on, s.matched) for s in ss)

        first = signature(by_layer[layers[0]])
        differing = [ly for ly in layers[1:] if ly is not None and signature(by_layer[ly]) != first]
        kernels = sorted({(s.engine.kernel if s.engine and s.engine.kernel else "").split(":")[0]
                          for s in members} - {""})
        for s in members:
            s.region = name
            s.id = f"{name}/L{s.layer}/{s.train.node}" if s.layer is not None else f"{name}/{s.train.node}"
        regions.append(Region(name=name, kind=kind, module=pattern, layers=layers, sites=[s.id for s in members],
                              rounded_on=sorted({s.rounded_on for s in members}), kernels=kernels,
                              differing_layers=differing))
    order = {k: i for i, k in enumerate(("rope", "qk_norm", "attention", "gated_act", "residual_norm", "norm_weight",
                                         "other"))}
    regions.sort(key=lambda r: (order.get(r.kind, 9), r.name))
    return regions
