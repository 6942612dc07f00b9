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

from dataclasses import dataclass
from typing import Any

import torch

from graphdiff.ops import EXACT, UNINITIALIZED, is_low, op_name
from graphdiff.records import Graph, Kernel, KernelEvidence, KernelRecord
from graphdiff.replay.interpreter import LOW, run_fragment
from graphdiff.replay.kernel_fragment import is_view
from graphdiff.replay.kernels import Declared, replay_kernel

__all__ = ["EngineRounding", "buffer_nodes", "engine_rounding", "eager_values", "is_view",
           "rerun_fp32", "train_rounding"]


# --- engine side ---------------------------------------------------------------------------


@dataclass
class EngineRounding:
    rounded: dict[str, str]  # node -> how it is rounded ("stored by K as bfloat16", "output of extern E", ...)
    replays: list[KernelEvidence]
    values: dict[str, torch.Tensor]  # node -> value the engine computes (FP32 where it keeps FP32)


def buffer_nodes(graph: Graph) -> dict[str, str]:
    """Wrapper buffer name -> FX node, from what the capture states for certain. An extern's result buffer (its
    return value, its `out=`) that a generated kernel later writes in place holds other values after that write: it
    is not certain for the whole graph (`engine_rounding` binds it from the extern call to that write)."""
    out = {n.name: n.name for n in graph.nodes if n.op == "placeholder"}
    nodes = graph.node_map()
    rewritten = {a.name for k in graph.kernels if k.kind == "generated" for a in k.args if a.role in ("out", "inout")}
    for k in graph.kernels:
        if k.kind == "extern" and k.nodes:
            fx = nodes.get(k.nodes[0])
            fx_args = fx.call[0] if fx else []
            for a, fa in zip(k.args, fx_args):
                if a.name and isinstance(fa, dict) and "node" in fa:
                    out.setdefault(a.name, fa["node"])
            for a in k.args:
                if a.role == "out" and fx is not None and a.name not in rewritten:
                    out.setdefault(a.name, fx.name)
        for a in k.args:
            if a.node:
                out.setdefault(a.name, a.node)
    return out


def extern_roundings(graph: Graph, k: Kernel) -> dict[str, str]:
    """What an opaque extern rounds: its low-precision results, and the low-precision buffers it writes."""
    nodes = graph.node_map()
    rounded = {n: f"output of extern {k.name}" for n in k.nodes if is_low(nodes[n].dtype)}
    # a mutating extern (out= buffer) rounds what it writes
    for a, fa in zip(k.args, nodes[k.nodes[0]].call[0] if k.nodes else []):
        if isinstance(fa, dict) and "node" in fa and a.name and is_low(nodes[fa["node"]].dtype) \
                and nodes[fa["node"]].op == "call_function" and op_name(nodes[fa["node"]].target) == "empty":
            rounded[fa["node"]] = f"written by extern {k.name}"
    return rounded


def store_roundings(k: Kernel, rep: KernelEvidence) -> dict[str, str]:
    """What a replayed generated kernel rounds: its low-precision stores and its in-register conversions."""
    name = k.id.split(":")[0]
    dtypes = {a.name: a.dtype for a in k.args}
    rounded = {node: f"stored by {name} as {dtypes.get(buf)}" for buf, node in rep.outputs.items()
               if is_low(dtypes.get(buf))}
    rounded.update({node: f"converted in registers by {name}" for node in rep.explicit_roundings})
    return rounded


def values_seen_outside(graph: Graph, buffers: dict[str, KernelRecord], known: dict[str, str],
                        replays: dict[str, KernelEvidence]) -> dict[str, torch.Tensor]:
    """Values as stored (rounded), as other kernels see them: every recorded load and replayed store."""
    nodes = graph.node_map()
    seen: dict[str, torch.Tensor] = {}
    for k in graph.kernels:
        rec = buffers.get(k.id)
        if not rec:
            continue
        for buf, t in rec["in"].items():
            node = known.get(buf)
            # Graph inputs (weights) are not computed values; upcasting an embedding table is gigabytes.
            if node and node not in seen and nodes[node].op != "placeholder" and isinstance(t, torch.Tensor) \
                    and t.is_floating_point():
                seen[node] = t.float()
        if k.id in replays:
            for buf, node in replays[k.id].outputs.items():
                stored = rec["out"].get(buf)
                if isinstance(stored, torch.Tensor) and stored.is_floating_point():
                    seen[node] = stored.float()
    return seen


def engine_rounding(graph: Graph, buffers: dict[str, KernelRecord]) -> EngineRounding:
    """Where the engine rounds in one compiled graph, every generated kernel replayed on its real buffers."""
    known = buffer_nodes(graph)
    owned = {n for k in graph.kernels if k.kind == "generated" for n in k.nodes}
    replays: list[KernelEvidence] = []
    values: dict[str, torch.Tensor] = {}
    rounded: dict[str, str] = {}
    # input buffers an extern wrote (its result) or a replay placed for certain (an extern's output the capture names
    # no node for): a later kernel reading the same buffer reads the same value, until a kernel writes it
    placed: dict[str, str] = {}
    for k in graph.kernels:
        for a in k.args:
            if a.role in ("out", "inout"):
                placed.pop(a.name, None)
        if k.kind == "extern":
            rounded.update(extern_roundings(graph, k))
            placed.update({a.name: k.nodes[0] for a in k.args if a.role == "out" and k.nodes})
            continue
        record = buffers.get(k.id)
        if record is None:
            replays.append(KernelEvidence(kernel=k.id, predicted_bitexact=0.0, naive_bitexact=0.0, elements=0,
                                          error="no recorded buffers"))
            continue
        rep, vals, certain = replay_kernel(graph, k, record, {**placed, **known}, owned)
        replays.append(rep)
        values.update({n: v for n, v in vals.items() if isinstance(v, torch.Tensor)})
        for buf, node in rep.outputs.items():
            known.setdefault(buf, node)  # later kernels load what this one stored
        placed.update({buf: node for buf, node in certain.items() if buf not in known})
        rounded.update(store_roundings(k, rep))
    # Values the engine reads from opaque kernels: whatever downstream kernels loaded.
    seen = values_seen_outside(graph, buffers, known, {r.kernel: r for r in replays})
    for node, t in seen.items():
        values.setdefault(node, t)
    _evaluate_glue(graph, owned, values, seen, buffers)
    return EngineRounding(rounded=rounded, replays=replays, values=values)


def _evaluate_glue(graph: Graph, owned: set[str], values: dict[str, torch.Tensor],
                   seen_outside: dict[str, torch.Tensor], buffers: dict[str, KernelRecord]) -> None:
    """Values of nodes no kernel computes (views, concatenations realized as buffer aliasing),
    from the stored values of their inputs. An uninitialized allocation no recorded load gave a value (the buffer an
    extern writes its output into: attention's) has none: evaluated, it would be whatever memory `torch.empty`
    returns, and its views candidates of the matcher that differ from run to run."""
    extern_nodes = {n for k in graph.kernels if k.kind == "extern" for n in k.nodes}
    syms: dict[str, int] = {}
    for rec in buffers.values():
        syms.update({k: v for k, v in rec.get("scalars", {}).items() if isinstance(v, int)})
    declared = Declared(graph)
    nodes = graph.node_map()
    groups: dict[str, object] = {}  # a split's tuple of views: not a value, but what its getitems index
    for n in graph.nodes:
        if n.op != "call_function" or n.name in values or n.name in owned or n.name in extern_nodes \
                or op_name(n.target) in UNINITIALIZED:
            continue
        ins: dict[str, object] = {}
        for i in dict.fromkeys(n.inputs):
            node_i = nodes[i]
            if node_i is not None and node_i.sym in syms:
                ins[i] = syms[node_i.sym]
            elif i in seen_outside or i in values or i in groups:
                ins[i] = seen_outside.get(i, values.get(i, groups.get(i)))
        if len(ins) != len(set(n.inputs)):
            continue
        run = run_fragment([n], ins, declared, "fp32", syms)
        v = run.values.get(n.name)
        if isinstance(v, torch.Tensor):
            values[n.name] = v
            seen_outside[n.name] = v
        elif isinstance(v, (tuple, list)):
            groups[n.name] = v


# --- training side ---------------------------------------------------------------------------

def eager_values(gm: torch.fx.GraphModule, inputs: list[Any]) -> dict[str, Any]:
    """Every node's value in an eager run of an fx graph."""
    values: dict[str, Any] = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            _keep_before_write(n, self.env, values)
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.no_grad():
        Keep(gm).run(*inputs)
    return values


def _keep_before_write(n: torch.fx.Node, env: dict[torch.fx.Node, Any], values: dict[str, Any]) -> None:
    """Before an in-place op (Falcon's `mlp_output += attention_output`) writes a tensor, the values kept so far that
    share its memory are copied: each node's value is what it computed, not what a later op wrote over it."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None:
        return
    written = [a for a, arg in zip(n.args, schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]
    memory = {env[a].untyped_storage().data_ptr() for a in written
              if isinstance(a, torch.fx.Node) and isinstance(env.get(a), torch.Tensor)}
    for name, v in values.items():
        if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in memory:
            values[name] = v.clone()


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
        if n.target is torch.ops.aten.mm.default and not n.kwargs:
            a, b = (values[x.name] if isinstance(x, torch.fx.Node) else x for x in n.args)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.numel() > FP32_CHUNK:
                return mm_fp32_chunked(a, b)
        assert callable(n.target)  # a call_function node: its target is the op
        return n.target(*torch.fx.node.map_aggregate(n.args, up), **torch.fx.node.map_aggregate(n.kwargs, up))


FP32_CHUNK = 1 << 25  # elements of a matmul operand upcast at once (128 MiB in FP32)


def mm_fp32_chunked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in FP32 without an FP32 copy of a large b (the LM head's weight is 2.5 GB in FP32 at Qwen3-8B's
    vocabulary): b's columns upcast a block at a time; every output element is the same K-long dot product."""
    cols = max(1, FP32_CHUNK // max(1, b.shape[0]))
    a32 = a.float()
    return torch.cat([a32 @ b[:, i:i + cols].float() for i in range(0, b.shape[1], cols)], dim=1)


def train_rounding(gm: torch.fx.GraphModule, values: dict[str, Any],
                   fp32: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """For each computing low-precision node of an eager graph, the fraction of its elements that eager's
    store changes (its op re-run in FP32 on the same inputs, compared with the stored result); 1.0 where the
    op cannot be re-run in FP32 (treated as one atomic rounding). `fp32`, when given, collects those FP32
    results (the values each rounding acts on)."""
    changed: dict[str, float] = {}
    for n in gm.graph.nodes:
        out = values.get(n.name)
        if n.op != "call_function" or not isinstance(out, torch.Tensor) or out.dtype not in LOW:
            continue
        if op_name(str(n.target)) in EXACT:
            continue  # moves data, cannot round (and re-running a gather in FP32 upcasts a whole table)
        try:
            exact = rerun_fp32(n, values)
        except Exception:
            changed[n.name] = 1.0  # cannot re-run it in FP32: treat as rounding (atomic op)
            continue
        if not isinstance(exact, torch.Tensor) or exact.shape != out.shape:
            changed[n.name] = 1.0
            continue
        changed[n.name] = float((exact.to(out.dtype).float() != exact).float().mean())
        if fp32 is not None:
            fp32[n.name] = exact
    return changed
