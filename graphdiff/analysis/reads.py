"""How the engine's readers read a trainer value where the plan's decision alone does not say: through a BF16
copy the engine stored while it holds the value in FP32 (`Evidence.read_rounded_by`), in FP32 where a kernel reads
the unrounded value beside its store, through a reloaded cast, or recomputed in a later kernel (the `mark_*` passes
over the plan)."""

from __future__ import annotations

from collections.abc import Callable

from graphdiff.analysis.rounding import is_view
from graphdiff.ops import CASTS, EXACT, is_low, op_name
from graphdiff.records import Decision, Graph, Node
from graphdiff.replay.kernel_fragment import value_base
from graphdiff.replay.sum_order import cpp_rereads_store


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
