"""The all-reduces of a tensor-parallel engine graph, each with the matmul that wrote the partial it reduces.

Which extern calls are all-reduces and matmuls is the capture's knowledge of vLLM CPU's ops (the tensor-parallel
worker records exactly these calls); what each computes is the registry's (analysis.opaque: kinds `allreduce` and
`matmul`, the same op names, tested to agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphdiff.ops import op_name
from graphdiff.records import Graph
from graphdiff.replay.kernel_fragment import value_base

# vLLM CPU's all-reduces: its shared-memory op, and torch.distributed's (gloo) where its ops build has none (`_C_AVX2`)
ALLREDUCE_EXTERNS = ("_C.shm_allreduce", "_c10d_functional.all_reduce")
# the GEMM externs that can write a row-parallel partial
MATMUL_EXTERNS = ("onednn_mm", "weight_packed_linear", "extern_kernels.mm", "extern_kernels.addmm",
                  "extern_kernels.bmm")


@dataclass
class AllReduce:
    graph: str
    kernel: str  # the all-reduce extern's kernel id
    buffer: str  # the engine node whose buffer it reduces (in place) or its own output node (out of place)
    matmul: str  # the matmul extern that wrote the partial product ("" when none did: no site)


def _in_place(target: str) -> bool:
    """An in-place all-reduce: `_C.shm_allreduce` (no result) or `_c10d_functional.all_reduce_` (returns its input)."""
    return op_name(target).endswith("_")


def _node_args(call: list) -> list[str]:
    args = call[0] if call else []
    return [a["node"] for a in args if isinstance(a, dict) and "node" in a]


def buffer_base(graph: Graph, name: str) -> str:
    """The node whose buffer holds this value: up through views and casts (same values)."""
    base = value_base(graph.node_map(), name)
    return name if base is None else base.name


def allreduces(graph: Graph) -> list[AllReduce]:
    """The graph's all-reduce externs, in execution order, each with the matmul extern that wrote the buffer it
    reduces."""
    nodes = graph.node_map()
    externs = [k for k in graph.kernels if k.kind == "extern" and k.nodes]
    out = []
    for i, k in enumerate(externs):
        if not any(op in k.name for op in ALLREDUCE_EXTERNS):
            continue
        node = nodes[k.nodes[0]]
        reduced = _node_args(node.call)
        buf = reduced[0] if reduced and (not node.dtype or _in_place(node.target)) else node.name  # in place or not
        source = reduced[0] if reduced else buf
        writer = ""
        for m in reversed(externs[:i]):
            written = _node_args(nodes[m.nodes[0]].call)[:1]  # an out= buffer, or a view of one
            if any(op in m.name for op in MATMUL_EXTERNS) and (
                    m.nodes[0] == source or (written and buffer_base(graph, written[0]) == buffer_base(graph, source))):
                writer = m.id
                break
        out.append(AllReduce(graph.name, k.id, buf, writer))
    return out
