"""The engine's expert choices, read from its recorded kernel buffers: the top-k expert indices its router kernels
take as input (MoE models)."""

from __future__ import annotations

import torch

from graphdiff.ops import op_name
from graphdiff.records import Graph, KernelRecord, layer_of


def has_router(graph: Graph) -> bool:
    """Does the graph choose experts (a top-k the MoE layers' kernels read)?"""
    return any(op_name(n.target) == "topk" for n in graph.nodes)


def engine_routing(graph: Graph, records: dict[str, KernelRecord]) -> dict[int, torch.Tensor]:
    """The top-k expert indices the engine's router kernels read, per layer: a generated kernel fusing a node that
    reads item 1 of a topk takes them as its integer [tokens, k] input."""
    nodes = graph.node_map()
    out: dict[int, torch.Tensor] = {}
    for k in graph.kernels:
        rec = records.get(k.id)
        if k.kind != "generated" or rec is None:
            continue
        reads_ids = any(op_name(nodes[i].target) == "getitem" and nodes[i].call[0][1:] == [1]
                        and op_name(nodes[nodes[i].inputs[0]].target) == "topk"
                        for n in k.nodes if n in nodes for i in nodes[n].inputs if nodes[i].inputs)
        layer = next((layer_of(nodes[n].module) for n in k.nodes if layer_of(nodes[n].module) is not None), None)
        if not reads_ids or layer is None:
            continue
        ids = [t for t in rec["in"].values() if isinstance(t, torch.Tensor) and not t.is_floating_point()
               and t.dim() == 2 and t.dtype in (torch.int64, torch.int32)]
        if len(ids) == 1:  # a grouped router reads its groups' ids first, its experts' later: the last wins
            out[layer] = ids[0]
    return out
