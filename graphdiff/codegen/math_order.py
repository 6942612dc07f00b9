"""Regions for ops that round where the engine does but compute with Inductor's math, not ATen's.

The scan records, per HF module, the trainer ops whose engine values equal Inductor's one-op form and not ATen's
eager op (`ScanResult.inductor_math`, analysis.math_ops: GPT-NeoX's MLP GELU). A module that no region already
re-emits becomes a region of kind `math` with no sites, one per module pattern, whose splice is the module's forward
with those ops computed by `inductor_math` (Inductor's one-op function, the eager gradient) and HF's rounding
otherwise.
"""

from __future__ import annotations

from graphdiff.analysis.regions import module_pattern
from graphdiff.codegen.norm_order import calls_children
from graphdiff.records import Graph, Node, Region, ScanResult, layer_of
from graphdiff.runtime import module_regex

KIND = "math"


def math_regions(scan: ScanResult, graph: Graph) -> list[Region]:
    """One `math` region per module pattern whose modules' recorded ops no scanned region re-emits already (its
    splice computes them by Inductor's math itself, `fragment._inductor_math`)."""
    covered = [module_regex(r.module) for r in scan.regions]
    nodes = graph.node_map()
    by_pattern: dict[str, dict[str, list[str]]] = {}
    for module, names in scan.inductor_math.items():
        if any(rx.fullmatch(module) for rx in covered) or calls_children(graph, module):
            continue
        by_pattern.setdefault(module_pattern(module), {})[module] = names
    regions = []
    for pattern, modules in by_pattern.items():
        ops = sorted({str(nodes[n].target) for names in modules.values() for n in names if n in nodes})
        regions.append(Region(
            name=f"{pattern}#{KIND}", kind=KIND, module=pattern,
            kind_reason=f"no rounding site: the engine's Inductor kernel computes {', '.join(ops)} with Inductor's "
                        "math (its values equal Inductor's one-op form on the engine's input, not ATen's)",
            layers=sorted({layer_of(m) for m in modules}, key=lambda x: -1 if x is None else x),
            sites=[], rounded_on=[]))
    return regions


def with_math_regions(scan: ScanResult, graph: Graph) -> ScanResult:
    """The scan with its `math` regions added (what codegen cuts and verifies)."""
    more = math_regions(scan, graph)
    return scan.model_copy(update={"regions": [*scan.regions, *more]}) if more else scan


def seed_node(scan: ScanResult, graph: Graph, region: Region, layers: list[int] | None = None) -> Node | None:
    """The first recorded op of the region's representative module (its first layer, or the first of `layers`)."""
    nodes = graph.node_map()
    rx = module_regex(region.module)
    found = [nodes[n] for m, names in scan.inductor_math.items() if rx.fullmatch(m) for n in names if n in nodes]
    if layers:
        found = [n for n in found if layer_of(n.module) in layers] or found
    return min(found, key=lambda n: graph.position(n.name)) if found else None


def recorded(scan: ScanResult) -> set[str]:
    """Every trainer node the scan found computed by Inductor's math (`ScanResult.inductor_math`)."""
    return {n for names in scan.inductor_math.values() for n in names}
