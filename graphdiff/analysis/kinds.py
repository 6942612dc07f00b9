"""What a site computes (its region kind), decided from the dataflow around it: the ops within reach before a matmul,
attention, embedding or expert op, and which of those boundaries it reaches (no model names)."""

from __future__ import annotations

from graphdiff.analysis.plan import MAX_HOPS, step
from graphdiff.ops import ACTIVATIONS, ROUTING, is_attention, is_heavy, op_name
from graphdiff.records import Graph, Node, RegionKind, walk

NORMS = frozenset({"rsqrt", "native_layer_norm"})  # where a normalization shows in an ATen graph (RMSNorm, LayerNorm)


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


def _closure(graph: Graph, start: str, down: bool) -> tuple[set[str], set[str]]:
    """Nodes reachable from `start` without crossing a matmul/attention/embedding/expert op, and the ops of those
    boundary nodes it reaches ("attention", "embedding", "mm", ...; the graph output as "output")."""
    nodes = graph.node_map()

    def boundary(name: str) -> bool:
        return is_heavy(nodes[name].target) or nodes[name].op == "output"

    seen, edges = {start}, set()
    for other in walk([start], step(graph, down), hops=MAX_HOPS,
                      through=lambda o: not boundary(o) and nodes[o].op == "call_function"):
        n = nodes[other]
        if boundary(other):
            edges.add("attention" if is_attention(n.target) else "output" if n.op == "output" else op_name(n.target))
        elif n.op == "call_function":
            seen.add(other)
    return seen, edges


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
