"""Regions for activations that round where the engine does but compute in another form.

ATen's GELU (`aten.gelu`, the erf form) is one kernel with its own vectorized erf; Inductor decomposes it into
`x * 0.5 * (erf(x * sqrt(1/2)) + 1)` and computes the erf with its C++ math library (`replay.inductor_math`). Both
round the output once, so the scan finds no rounding site, yet about 0.2% of the BF16 outputs differ (tiny Falcon's
MLP, every recorded shape). A leaf module holding such an op, matched to a value of an Inductor-generated engine
kernel and covered by no scanned region, becomes a region of kind `inductor_math` with no sites; its splice is the
module's forward with the op in Inductor's form while the region is aligned (`fragment.inductor_math`), HF's
otherwise.
"""

from __future__ import annotations

from graphdiff.analysis.regions import module_pattern
from graphdiff.ops import op_name
from graphdiff.records import Graph, Node, Region, ScanResult, layer_of
from graphdiff.runtime import module_regex

KIND = "inductor_math"
ERF_GELU = "gelu"  # aten.gelu without `approximate`: Inductor's erf form


def engine_math(scan: ScanResult) -> set[str]:
    """The trainer nodes matched to a value an Inductor-generated engine kernel computes."""
    generated = {r.kernel for r in scan.replay} | {k.split(" @ ")[0] for k in scan.not_replayed}
    return {d.node for d in scan.plan if d.rule == "matched" and d.evidence.kernel in generated}


def is_erf_gelu(n: Node) -> bool:
    """An exact (erf) GELU, the form whose Inductor decomposition is `x * 0.5 * (erf(x * sqrt(1/2)) + 1)`."""
    return op_name(n.target) == ERF_GELU and n.call[1].get("approximate", "none") == "none"


def math_regions(scan: ScanResult, graph: Graph) -> list[Region]:
    """One `inductor_math` region per module pattern of leaf modules whose erf GELU the engine computes in an
    Inductor kernel and no scanned region covers."""
    covered = [module_regex(r.module) for r in scan.regions]
    computed = engine_math(scan)
    layers: dict[str, set[int | None]] = {}
    for n in graph.nodes:
        if n.name not in computed or not is_erf_gelu(n) or not n.module or _calls_children(graph, n.module):
            continue
        if not any(rx.fullmatch(n.module) for rx in covered):
            layers.setdefault(module_pattern(n.module), set()).add(layer_of(n.module))
    return [Region(name=f"{pattern}#{KIND}", kind=KIND, module=pattern,
                   kind_reason="no rounding site: the engine's kernel computes GELU as Inductor decomposes it, its "
                               "erf by Inductor's math library; the trainer by ATen's GELU kernel",
                   layers=sorted(found, key=lambda x: -1 if x is None else x), sites=[], rounded_on=[])
            for pattern, found in layers.items()]


def with_math_regions(scan: ScanResult, graph: Graph) -> ScanResult:
    """The scan with its `inductor_math` regions added (what codegen cuts and verifies)."""
    more = math_regions(scan, graph)
    return scan.model_copy(update={"regions": [*scan.regions, *more]}) if more else scan


def seed_node(graph: Graph, region: Region, layers: list[int] | None = None) -> Node | None:
    """The first erf GELU of the region's representative module (its first layer, or the first of `layers`)."""
    rx = module_regex(region.module)
    found = [n for n in graph.nodes if n.module and rx.fullmatch(n.module) and is_erf_gelu(n)]
    if layers:
        found = [n for n in found if layer_of(n.module) in layers] or found
    return found[0] if found else None


def _calls_children(graph: Graph, module: str) -> bool:
    return any((n.module or "").startswith(module + ".") for n in graph.nodes)
