"""Where each side really rounds to BF16, and the replay evidence for the engine side.

Trainer (eager): every op materializes its output in its dtype, so a low-precision node is
rounded — unless the op cannot change values (views, copies, concatenation, negation,
embedding lookup); that is decided from the numbers (is the FP32 result of the op on the
same inputs already representable?), not from a list of ops. Ops that compute internally
in FP32 (reductions, softmax, matmul accumulation) are atomic: one rounding, at the output.

Engine (compiled): a value is rounded where a kernel stores it in low precision, where an
opaque extern kernel (matmul, attention) returns it in low precision, or where the kernel
code really converts it (found by replay); everything else inside a fused kernel is FP32.
Every generated kernel is replayed on its real recorded inputs under that model ("predicted")
and under "round after every op" ("naive"), and both are compared bit-for-bit with its real
recorded outputs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from graphdiff.model import Graph, Kernel, Node, op_name
from graphdiff.replay import DATA_MOVEMENT, LOW, bits_equal_fraction, run_fragment, to_dtype

# Ops that move or reinterpret data without computing (no rounding can happen in them).
VIEW_OPS = {
    "getitem", "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "split", "split_with_sizes", "slice",
    "permute", "expand", "alias", "t", "transpose", "select", "clone", "contiguous", "detach", "as_strided",
    "_reshape_alias", "unbind", "chunk", "lift_fresh_copy",
}
MAX_PERMUTATIONS = 120



def is_view(node: Node) -> bool:
    return node.op == "call_function" and op_name(node.target) in VIEW_OPS


def is_low(dtype: str | None) -> bool:
    return to_dtype(dtype) in LOW


# --- engine side ---------------------------------------------------------------------------

@dataclass
class KernelReplay:
    kernel: str
    predicted_bitexact: float
    naive_bitexact: float
    elements: int  # low-precision elements compared
    fp32_max_rel_error: float = 0.0  # FP32 stores: accumulation-order differences only
    outputs: dict[str, str] = field(default_factory=dict)  # stored buffer -> FX node
    explicit: list[str] = field(default_factory=list)  # in-register roundings the code really does
    error: str = ""


@dataclass
class EngineRounding:
    rounded: dict[str, str]  # node -> how it is rounded ("store bufN (bfloat16)", "extern output", ...)
    fp32: set[str]  # nodes computed in FP32 inside a kernel and never rounded
    replays: list[KernelReplay]
    values: dict[str, torch.Tensor]  # node -> value the engine computes (FP32 where it keeps FP32)


def buffer_nodes(graph: Graph) -> dict[str, str]:
    """Wrapper buffer name -> FX node, from what the capture states for certain."""
    out = {n.name: n.name for n in graph.nodes if n.op == "placeholder"}
    nodes = graph.node_map()
    for k in graph.kernels:
        if k.kind == "extern" and k.nodes:
            fx = nodes.get(k.nodes[0])
            fx_args = fx.call[0] if fx else []
            for a, fa in zip(k.args, fx_args):
                if a.name and isinstance(fa, dict) and "node" in fa:
                    out.setdefault(a.name, fa["node"])
            for a in k.args:
                if a.role == "out" and fx is not None:
                    out.setdefault(a.name, fx.name)
        for a in k.args:
            if a.node:
                out.setdefault(a.name, a.node)
    return out


def _fragment(graph: Graph, k: Kernel, owned: set[str]) -> tuple[list[Node], list[str]]:
    """Kernel nodes in graph order, pulled back through views no kernel computes, and their inputs."""
    nodes = graph.node_map()
    members = {n for n in k.nodes if nodes[n].op == "call_function"}
    while True:
        ext = {i for m in members for i in nodes[m].inputs if i not in members}
        pull = {e for e in ext if is_view(nodes[e]) and e not in owned}
        if not pull:
            break
        members |= pull
    frag = [nodes[m] for m in sorted(members, key=graph.position)]
    external = list(dict.fromkeys(i for n in frag for i in n.inputs if i not in members))
    return frag, external


def _numel(shape: list[int | str] | None, syms: dict[str, int]) -> int | None:
    if shape is None:
        return None
    total = 1
    for d in shape:
        if isinstance(d, str):
            if d not in syms:
                return None
            d = syms[d]
        total *= int(d)
    return total


class _Declared:
    """Node dtypes by name, read through the graph's index (no per-kernel copy)."""

    def __init__(self, graph: Graph) -> None:
        self.nodes = graph.node_map()

    def get(self, name: str, default: str | None = None) -> str | None:
        node = self.nodes.get(name)
        return node.dtype if node is not None else default


def _declared(graph: Graph) -> _Declared:
    return _Declared(graph)


def _bind_syms(graph: Graph, record: dict[str, Any]) -> dict[str, int]:
    syms = {name: int(v) for name, v in record.get("scalars", {}).items() if isinstance(v, int)}
    # Symbols also appear in shapes of inputs that were recorded by name (graph inputs).
    nodes = graph.node_map()
    for n in (nodes[b] for b in record["in"] if b in nodes):
        t = record["in"].get(n.name)
        if n.shape and isinstance(t, torch.Tensor) and len(n.shape) == t.dim():
            for d, real in zip(n.shape, t.shape):
                if isinstance(d, str):
                    syms.setdefault(d, int(real))
    return syms


def _score(run_vals: dict[str, Any], outputs: dict[str, str], record: dict[str, Any]) -> tuple[float, int]:
    """Bit-identical fraction over the kernel's low-precision stores (the rounding claim).

    FP32 stores (e.g. a reduction's partial result) are compared by `_fp32_error` instead:
    their last bits depend on accumulation order, which is not what this model predicts."""
    total, good = 0, 0.0
    for buf, node in outputs.items():
        real = record["out"].get(buf)
        pred = run_vals.get(node)
        if not isinstance(real, torch.Tensor) or not isinstance(pred, torch.Tensor) or real.dtype not in LOW:
            continue
        good += bits_equal_fraction(pred, real) * real.numel()
        total += real.numel()
    return (good / total if total else 0.0), total


def _closeness(pred: torch.Tensor, real: torch.Tensor) -> float:
    """Higher is closer: bit agreement for low-precision stores, -relative error for FP32 ones."""
    if pred.numel() != real.numel():
        return float("-inf")
    if real.dtype in LOW:
        return bits_equal_fraction(pred, real)
    diff = (pred.double().reshape(-1) - real.double().reshape(-1)).norm()
    return -float(diff / real.double().norm().clamp_min(1e-30))


def _fp32_error(run_vals: dict[str, Any], outputs: dict[str, str], record: dict[str, Any]) -> float:
    worst = 0.0
    for buf, node in outputs.items():
        real, pred = record["out"].get(buf), run_vals.get(node)
        if isinstance(real, torch.Tensor) and isinstance(pred, torch.Tensor) and real.dtype == torch.float32 \
                and pred.numel() == real.numel():
            diff = (pred.double().reshape(-1) - real.double().reshape(-1)).abs()
            worst = max(worst, float((diff / real.double().reshape(-1).abs().clamp_min(1e-30)).max()))
    return worst


def replay_kernel(graph: Graph, k: Kernel, record: dict[str, Any], known: dict[str, str], owned: set[str],
                  compute: torch.dtype = torch.float32) -> tuple[KernelReplay, dict[str, Any]]:
    nodes = graph.node_map()
    frag, external = _fragment(graph, k, owned)
    frag_names = {n.name for n in frag}
    declared = _declared(graph)
    syms = _bind_syms(graph, record)
    node_buf = {v: b for b, v in known.items()}
    inputs: dict[str, Any] = {}
    loose: list[str] = []
    for e in external:
        n = nodes[e]
        if n.sym is not None:
            if n.sym in syms:
                inputs[e] = syms[n.sym]
                continue
        buf = node_buf.get(e)
        if buf is not None and buf in record["in"]:
            inputs[e] = record["in"][buf]
        else:
            loose.append(e)
    free = [b for b in record["in"] if b not in {node_buf.get(e) for e in inputs}]
    # Outputs: stored buffers and the fragment values they hold.
    users = graph.users()
    sinks = [n.name for n in frag if not is_view(n) and any(u not in frag_names for u in users.get(n.name, []))]
    # Stores the capture names a node for (buffers whose size disagrees hold a part of it, e.g. one
    # input of a concatenation written in place; those are placed by value below, or left out).
    outputs = {a.name: a.node for a in k.args if a.role in ("out", "inout") and a.node in frag_names
               and isinstance(record["out"].get(a.name), torch.Tensor)
               and _numel(nodes[a.node].shape, syms) == record["out"][a.name].numel()}
    open_bufs = [a.name for a in k.args if a.role in ("out", "inout") and a.name not in outputs
                 and a.name in record["out"]]

    def candidates_in(e: str) -> list[str]:
        want = _numel(nodes[e].shape, syms)
        return [b for b in free if isinstance(record["in"][b], torch.Tensor) and record["in"][b].numel() == want]

    def candidates_out(b: str) -> list[str | None]:
        real = record["out"][b]
        found = [n.name for n in frag if not is_view(n) and n.name not in outputs.values()
                 and _numel(n.shape, syms) == real.numel() and to_dtype(n.dtype) is not None
                 and (to_dtype(n.dtype) == real.dtype or n.name in sinks)]
        return found or [None]  # a buffer we cannot place is left out of the comparison

    in_options = [candidates_in(e) for e in loose]
    best: tuple[float, dict, dict, dict] | None = None
    error = "inputs could not be resolved"
    # Only the input assignment changes the computation; outputs are placed after each run.
    for ins in itertools.islice(itertools.product(*in_options), MAX_PERMUTATIONS):
        if len(set(ins)) != len(ins):
            continue
        trial_inputs = {**inputs, **{e: record["in"][b] for e, b in zip(loose, ins)}}
        run = run_fragment(frag, {e: trial_inputs[e] for e in external if e in trial_inputs}, declared, "fp32",
                           syms, compute=compute)
        if not run.ok:
            error = run.error
            continue
        trial_outputs = dict(outputs)
        for b in open_bufs:
            options = [c for c in candidates_out(b) if c is not None and c not in trial_outputs.values()
                       and isinstance(run.values.get(c), torch.Tensor)]
            if options:
                trial_outputs[b] = max(options, key=lambda c: _closeness(run.values[c], record["out"][b]))
        score, _ = _score(run.values, trial_outputs, record)
        if best is None or score > best[0]:
            best = (score, trial_inputs, trial_outputs, run.values)
    if best is None:
        return KernelReplay(k.id, 0.0, 0.0, 0, error=error), {}
    _, inputs, outputs, values = best
    ext_inputs = {e: inputs[e] for e in external if e in inputs}
    explicit: list[str] = []
    predicted, elements = _score(values, outputs, record)
    # Conversions the kernel really performs in registers: add one at a time while replay improves.
    convert_candidates = [n.name for n in frag if is_low(n.dtype) and "convert_element_type" in n.target]
    while predicted < 1.0 and convert_candidates:
        trials = []
        for c in convert_candidates:
            run = run_fragment(frag, ext_inputs, declared, "fp32", syms, rounded={*explicit, c}, compute=compute)
            if run.ok:
                trials.append((_score(run.values, outputs, record)[0], c, run.values))
        if not trials or max(trials)[0] <= predicted:
            break
        predicted, c, values = max(trials, key=lambda t: t[0])
        explicit.append(c)
        convert_candidates.remove(c)
    naive_run = run_fragment(frag, ext_inputs, declared, "eager", syms)
    naive = _score(naive_run.values, outputs, record)[0] if naive_run.ok else 0.0
    fp32 = _fp32_error(values, outputs, record)
    return KernelReplay(k.id, predicted, naive, elements, fp32, outputs, explicit), values


def engine_rounding(graph: Graph, buffers: dict[str, dict[str, Any]]) -> EngineRounding:
    known = buffer_nodes(graph)
    owned = {n for k in graph.kernels if k.kind == "generated" for n in k.nodes}
    nodes = graph.node_map()
    replays: list[KernelReplay] = []
    values: dict[str, torch.Tensor] = {}
    rounded: dict[str, str] = {}
    for k in graph.kernels:
        if k.kind == "extern":
            for n in k.nodes:
                if is_low(nodes[n].dtype):
                    rounded[n] = f"output of extern {k.name}"
            # a mutating extern (out= buffer) rounds what it writes
            for a, fa in zip(k.args, nodes[k.nodes[0]].call[0] if k.nodes else []):
                if isinstance(fa, dict) and "node" in fa and a.name and is_low(nodes[fa["node"]].dtype) \
                        and nodes[fa["node"]].op == "call_function" and op_name(nodes[fa["node"]].target) == "empty":
                    rounded[fa["node"]] = f"written by extern {k.name}"
            continue
        record = buffers.get(k.id)
        if record is None:
            replays.append(KernelReplay(k.id, 0.0, 0.0, 0, error="no recorded buffers"))
            continue
        rep, vals = replay_kernel(graph, k, record, known, owned)
        replays.append(rep)
        values.update({n: v for n, v in vals.items() if isinstance(v, torch.Tensor)})
        for buf, node in rep.outputs.items():
            known.setdefault(buf, node)
            dt = next((a.dtype for a in k.args if a.name == buf), None)
            if is_low(dt):
                rounded[node] = f"stored by {k.id.split(':')[0]} as {dt}"
        for node in rep.explicit:
            rounded[node] = f"converted in registers by {k.id.split(':')[0]}"
    # Values the engine reads from opaque kernels: whatever downstream kernels loaded.
    seen_outside: dict[str, torch.Tensor] = {}  # values as stored (rounded), as other kernels see them
    replayed = {r.kernel: r for r in replays}
    for k in graph.kernels:
        rec = buffers.get(k.id)
        if rec:
            for buf, t in rec["in"].items():
                node = known.get(buf)
                # Graph inputs (weights) are not computed values; upcasting an embedding table is gigabytes.
                if not node or node in seen_outside or nodes[node].op == "placeholder":
                    continue
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    seen_outside[node] = t.float()
                    values.setdefault(node, seen_outside[node])
            if k.id in replayed:
                for buf, node in replayed[k.id].outputs.items():
                    t = rec["out"].get(buf)
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        seen_outside[node] = t.float()
    _evaluate_glue(graph, owned, values, seen_outside, buffers)
    fp32 = {n for n in owned if n not in rounded and not is_view(nodes[n]) and nodes[n].dtype is not None}
    return EngineRounding(rounded=rounded, fp32=fp32, replays=replays, values=values)


def _evaluate_glue(graph: Graph, owned: set[str], values: dict[str, torch.Tensor],
                   seen_outside: dict[str, torch.Tensor], buffers: dict[str, Any]) -> None:
    """Values of nodes no kernel computes (views, concatenations realized as buffer aliasing),
    from the stored values of their inputs."""
    extern_nodes = {n for k in graph.kernels if k.kind == "extern" for n in k.nodes}
    syms: dict[str, int] = {}
    for rec in buffers.values():
        syms.update({k: v for k, v in rec.get("scalars", {}).items() if isinstance(v, int)})
    declared = _declared(graph)
    for n in graph.nodes:
        if n.op != "call_function" or n.name in values or n.name in owned or n.name in extern_nodes:
            continue
        ins = {}
        nodes = graph.node_map()
        for i in dict.fromkeys(n.inputs):
            node_i = nodes[i]
            if node_i is not None and node_i.sym in syms:
                ins[i] = syms[node_i.sym]
            elif i in seen_outside or i in values:
                ins[i] = seen_outside.get(i, values.get(i))
        if len(ins) != len(set(n.inputs)):
            continue
        run = run_fragment([n], ins, declared, "fp32", syms)
        v = run.values.get(n.name)
        if isinstance(v, torch.Tensor):
            values[n.name] = v
            seen_outside[n.name] = v


# --- training side ---------------------------------------------------------------------------

def eager_values(gm: torch.fx.GraphModule, inputs: list[Any]) -> dict[str, Any]:
    """Every node's value in an eager run of an fx graph."""
    values: dict[str, Any] = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.no_grad():
        Keep(gm).run(*inputs)
    return values


def rerun_fp32(n: torch.fx.Node, values: dict[str, Any]) -> Any:
    """Re-run one eager node's op in FP32 on the same (stored) inputs: the value before rounding."""

    def up(x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            x = values[x.name]
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.float()
        if isinstance(x, torch.dtype) and x.is_floating_point:
            return torch.float32
        return x

    with torch.no_grad():
        return n.target(*torch.fx.node.map_aggregate(n.args, up), **torch.fx.node.map_aggregate(n.kwargs, up))


def train_rounding(gm: torch.fx.GraphModule, values: dict[str, Any],
                   fp32: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Low-precision nodes of an eager graph whose op really rounds, with the fraction of elements
    it changes (the op re-run in FP32 on the same inputs differs from its stored result).
    `fp32`, when given, collects those FP32 results (the values each rounding acts on)."""
    rounded: dict[str, float] = {}
    for n in gm.graph.nodes:
        out = values.get(n.name)
        if n.op != "call_function" or not isinstance(out, torch.Tensor) or out.dtype not in LOW:
            continue
        if op_name(str(n.target)) in VIEW_OPS | DATA_MOVEMENT:
            continue  # moves data, cannot round (and re-running a gather in FP32 upcasts a whole table)
        try:
            exact = rerun_fp32(n, values)
        except Exception:
            rounded[n.name] = 1.0  # cannot re-run it in FP32: treat as rounding (atomic op)
            continue
        if not isinstance(exact, torch.Tensor) or exact.shape != out.shape:
            rounded[n.name] = 1.0
            continue
        changed = float((exact.to(out.dtype).float() != exact).float().mean())
        if changed > 0:
            rounded[n.name] = changed
        if fp32 is not None:
            fp32[n.name] = exact
    return rounded
