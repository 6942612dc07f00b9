"""The attention region of an engine whose attention op rounds where the trainer's sdpa does.

vLLM CPU's `amx` kernel (CPUs with AMX tiles) stores the softmax probabilities in BF16 itself, as the trainer's
BF16 sdpa does, so the scan finds no rounding site in attention and has no attention region. The op still sums
its keys in its own blocks, an order no rounding location changes: `--attention engine` runs the engine's op there
too, as the splice of a region with no sites that the scan's regions are completed with (`order_regions`).
"""

from __future__ import annotations

from graphdiff.analysis.regions import module_pattern
from graphdiff.records import Graph, Node, Region, ScanResult, layer_of

SDPA_OPS = ("scaled_dot_product",)  # the trainer graph's attention ops (aten sdpa and its CPU flash variant)
ENGINE_BACKENDS = ("CPU_ATTN",)  # the engine attention backends whose op the engine-op splice runs


def order_regions(scan: ScanResult, graph: Graph) -> list[Region]:
    """One attention region per attention module pattern of the trainer graph, where the engine's attention op is
    one the engine-op splice runs and the scan found no attention site; empty otherwise."""
    if any(r.kind == "attention" for r in scan.regions):
        return []
    if scan.engine_attention.get("backend") not in ENGINE_BACKENDS:
        return []
    layers_of: dict[str, list[int | None]] = {}
    for n in _attention_nodes(graph.nodes):
        layers_of.setdefault(module_pattern(n.module), []).append(layer_of(n.module))
    isa = scan.engine_attention.get("isa", "")
    reason = (f"no rounding site: the engine's attention op ({isa or 'its'} kernel) rounds where the trainer's sdpa "
              "does, and sums its keys in its own blocks")
    return [Region(name=f"{pattern}#attention", kind="attention", kind_reason=reason, module=pattern,
                   layers=sorted(set(layers), key=lambda x: -1 if x is None else x), sites=[], rounded_on=[],
                   kernels=[scan.engine_attention.get("impl", "")])
            for pattern, layers in layers_of.items()]



def attention_node(nodes: list[Node], region: Region) -> Node | None:
    """The first trainer attention op in one of the region's modules (where it has no site to name it)."""
    return next((n for n in _attention_nodes(nodes) if module_pattern(n.module) == region.module), None)


def _attention_nodes(nodes: list[Node]) -> list[Node]:
    return [n for n in nodes if n.module and any(op in n.target for op in SDPA_OPS)]
