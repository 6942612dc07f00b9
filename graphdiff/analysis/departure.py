"""Where the trainer's values first part from the engine's, on the scan's tokens.

A scan of the patched trainer (`scan --manifest`) that finds no site says the two sides round in the same
places; their values can still differ, from a summation order (attention's, a reduction the patch does not
order) or a kernel the model does not explain. The first matched value, in the trainer's graph order, that is
not bit-identical to its engine counterpart is where a user looks: everything upstream of it is equal. Only
values both graphs hold in low precision are compared (matmul inputs and outputs, norm outputs, attention's
output: what both sides store), in that dtype; a value held in FP32 on a side is matched only within the
matcher's tolerance, which does not make it the same value (a mean and the mean plus eps).

The first differing value need not be where the difference arises: an op whose values are not compared (attention,
whose output both sides may hold otherwise) can part first and hand the difference on to a GEMM downstream. So the
departure also walks up from that value to the compared values it reads: where those agree, the cause lies in the
trainer ops between them and it (`cause_ops`, the first that computes rather than moves data named as the cause);
where one of them differs too, that is reported instead.

A value whose matched engine value differs from it but is bit-identical to another trainer value matched to it is
paired with another quantity (the matcher paired Falcon's value heads with the engine's key heads, both slices of one
agreeing qkv GEMM; and with one K/V head of 128, the value projection's GEMM with the key's, whose values the sorted
fingerprints do not tell apart): it counts as not compared, and a departure downstream walks through it. Without
that second value it stays a departure: the engine can move another copy of an agreeing value (OLMo 2's rotate_half
reads its own stored halves of the q norm's output, one element apart). Values of the same shape in other
layouts are compared in the engine's layout, the trainer's dims permuted where the shapes allow; the share reported
is that of one element order, never of sorted values (which shifts every element after a changed one).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch

from graphdiff.analysis.match import Match
from graphdiff.ops import ALLOCATIONS, EXACT, VIEWS, op_name
from graphdiff.records import Departure, Graph, Node, layer_of, walk

LOW = ("bfloat16", "float16")

LAYOUT_GUESS = 0.5  # more differing elements than this: the layouts may differ (a transpose), other orders are tried
MOST_PERMUTED = 5  # the most non-unit dims whose orders are tried (5! = 120)


def differing(t: torch.Tensor, e: torch.Tensor) -> tuple[float, int | None]:
    """(fraction of elements that differ, first differing row of the trainer's value) for two values of one
    dtype. Where more than LAYOUT_GUESS differ in the trainer's element order, the same values in another order
    (sorted values equal) are equal, and the trainer's dims are permuted into each order the engine's shape allows
    (`_orders`): the fewest differing there, without a row, where that is fewer than in the trainer's order."""
    a, b = t.detach().reshape(-1), e.detach().reshape(-1)
    ne = a != b
    frac = float(ne.float().mean())
    if not frac:
        return 0.0, None
    if frac > LAYOUT_GUESS:
        if torch.equal(a.sort().values, b.sort().values):
            return 0.0, None
        other = min((float((p.reshape(-1) != b).float().mean()) for p in _orders(t.detach(), list(e.shape))),
                    default=frac)
        if other < frac:
            return other, None
    rows = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
    row = int(ne.reshape(rows.shape).any(-1).nonzero()[0, 0])
    return frac, row


def _orders(t: torch.Tensor, shape: list[int]) -> Iterator[torch.Tensor]:
    """`t` with its non-unit dims in each other order whose element order `shape` (the engine's) can be: the
    running products of the two shapes' non-unit sizes, one a subset of the other (a reshape that only merges or
    splits adjacent dims)."""
    dims = [d for d in range(t.dim()) if t.shape[d] != 1]
    if len(dims) > MOST_PERMUTED:
        return
    squeezed = t.reshape([t.shape[d] for d in dims])
    target = _prefixes([s for s in shape if s != 1])
    for order in itertools.permutations(range(len(dims))):
        if order == tuple(range(len(dims))):
            continue
        mine = _prefixes([squeezed.shape[i] for i in order])
        if mine <= target or target <= mine:
            yield squeezed.permute(order)


def _prefixes(sizes: list[int]) -> set[int]:
    return {math.prod(sizes[:i + 1]) for i in range(len(sizes))}


def activation_values(graph: Graph) -> set[str]:
    """The nodes that depend on the model's inputs (token ids, positions), not only on its weights: a weight's own
    transform (a splice padding and packing expert weights) is no value of the forward to compare."""
    reached: set[str] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.param is None) or any(i in reached for i in n.inputs):
            reached.add(n.name)
    return reached


def _writers(graph: Graph) -> dict[str, str]:
    """Allocations (`aten.empty`) -> the kernel of the extern op that writes into it, its first argument (vLLM
    CPU's `_C.onednn_mm(out, x, weight, bias)`): the engine value a matched GEMM output is, whatever generated kernel
    Inductor lists the allocation under."""
    nodes = graph.node_map()
    return {n.inputs[0]: n.kernel for n in graph.nodes if n.kernel and n.inputs and n.inputs[0] in nodes
            and nodes[n.inputs[0]].target.startswith("aten.empty")}


def first_departure(tgraph: Graph, train_values: dict, matched: dict[str, tuple[list[Match], list[str]]],
                    engine_graphs: list[Graph], engine_values: dict[str, dict]) -> Departure | None:
    """The first matched trainer value (graph order) not bit-identical to its engine value; None if all are.
    `matched` and `engine_values` are per engine graph (node names repeat across a piecewise engine's graphs)."""
    kernel_of = {(g.name, n.name): n.kernel or "" for g in engine_graphs for n in g.nodes}
    kernel_of.update({(g.name, out): k for g in engine_graphs for out, k in _writers(g).items()})
    declared = {(g.name, n.name): n.dtype for g in engine_graphs for n in g.nodes}
    pairs = sorted(((m, g) for g, (ms, _) in matched.items() for m in ms), key=lambda p: tgraph.position(p[0].train))
    nodes = tgraph.node_map()
    forward = activation_values(tgraph)
    forward_pairs = [p for p in pairs if p[0].train in forward]  # a weight's own transform is no forward value
    equal, compared = 0, set()  # compared: the values found bit-identical so far
    for m, g in forward_pairs:
        t, e = train_values.get(m.train), engine_values.get(g, {}).get(m.engine)
        if not (isinstance(t, torch.Tensor) and isinstance(e, torch.Tensor)) or t.numel() != e.numel() \
                or not (t.is_floating_point() and e.is_floating_point()):
            continue
        low = nodes[m.train].dtype
        if low not in LOW or declared.get((g, m.engine)) != low:  # held in FP32 on a side: a match within the
            continue  # matcher's tolerance need not be the same value (a mean and the mean plus eps)
        frac, row = differing(t.to(getattr(torch, low)), e.to(getattr(torch, low)))
        if not frac:
            equal += 1
            compared.add(m.train)
            continue
        inputs, between = _upstream(tgraph, m.train, compared, forward)
        if _held_by_another(m, g, forward_pairs, train_values, e, low):
            continue  # paired with an engine value that is another trainer value: another quantity
        n = nodes[m.train]
        kernel, graph = kernel_of.get((g, m.engine), ""), g
        return Departure(node=m.train, op=n.target, module=n.module, layer=layer_of(n.module), dtype=str(n.dtype),
                         engine_node=m.engine, engine_graph=graph, kernel=kernel, differing=frac, first_row=row,
                         equal_before=equal, source=_line(n), inputs_agree=inputs, cause_ops=between,
                         cause=_computing(nodes, between),
                         engine_cause=_engine_cause(engine_graphs, g, m.engine, pairs, inputs) if inputs else "")
    return None


def _held_by_another(m: Match, graph: str, pairs: list[tuple[Match, str]], train_values: dict, e: torch.Tensor,
                     low: str) -> bool:
    """Is the engine value `m` matched bit-identical to another trainer value of `pairs` matched to it (Falcon's key
    heads, where the matcher paired the value heads with them too)? Then it is that value, not `m.train`."""
    dtype = getattr(torch, low)
    for other, g in pairs:
        t = train_values.get(other.train)
        if g == graph and other.engine == m.engine and other.train != m.train and isinstance(t, torch.Tensor) \
                and t.is_floating_point() and t.numel() == e.numel() and not differing(t.to(dtype), e.to(dtype))[0]:
            return True
    return False


def _computing(nodes: dict[str, Node], between: list[str], most: int = 8) -> str:
    """The ops of `between` that compute (not views nor other data movement; where none does, those that are not
    views: the engine moved another copy), by module and op, in graph order: `self_attn: sdpa; o_proj: mm`."""
    ops = [b for b in between if op_name(nodes[b].target) not in EXACT | VIEWS] \
        or [b for b in between if op_name(nodes[b].target) not in VIEWS]
    by: dict[str, list[str]] = {}
    for b in ops:
        op, module = op_name(nodes[b].target), (nodes[b].module or "").rsplit(".", 1)[-1] or "-"
        if op not in by.get(module, []):
            by.setdefault(module, []).append(op)
    parts = [f"{m}: {', '.join(ops)}" for m, ops in by.items()]
    return "; ".join(parts[:most]) + ("; ..." if len(parts) > most else "")


def _engine_cause(engine_graphs: list[Graph], g: str, name: str, pairs: list[tuple[Match, str]],
                  inputs: list[str]) -> str:
    """The engine's ops from the values paired with the agreeing trainer `inputs` to its value `name` in graph `g`,
    named as `cause` is: what the engine computes where the trainer computes `cause_ops` (its addmm where HF adds a
    GEMM's output)."""
    graph = next(eg for eg in engine_graphs if eg.name == g)
    agreeing = {p.engine for p, pg in pairs if pg == g and p.train in inputs}
    nodes = graph.node_map()
    reached = walk([name], lambda f: [i for i in nodes[f].inputs if i in nodes],
                   through=lambda i: i not in agreeing and nodes[i].op == "call_function")
    between = {i for i in reached if i not in agreeing and nodes[i].op == "call_function"
               and op_name(nodes[i].target) not in ALLOCATIONS} | {name}  # an op's output buffer computes nothing
    return _computing(nodes, sorted(between, key=graph.position))


def _line(n: Node) -> str:
    return f"{n.source.file.rsplit('/', 1)[-1]}:{n.source.line} {n.source.code}" if n.source else ""


def _upstream(graph: Graph, name: str, compared: set[str], forward: set[str]) -> tuple[list[str], list[str]]:
    """The compared values `name` reads, through ops whose values were not compared, and those ops (graph order):
    everything between the last values known equal and the first that differs (`forward`: activation_values)."""
    nodes = graph.node_map()

    def uncompared(i: str) -> bool:
        return i not in compared and nodes[i].op == "call_function"

    reached = set(walk([name], lambda f: [i for i in nodes[f].inputs if i in nodes and i in forward],
                       through=uncompared))
    between = {i for i in reached if uncompared(i)}
    inputs = sorted(reached & compared, key=graph.position)
    return inputs, sorted(between | {name}, key=graph.position)
