"""Regions for norms that round where the engine does but sum their rows in another order.

An RMS norm that HF computes in FP32 and rounds once at its output (Gemma's `(1 + weight)` norm) has no rounding
site: the scan finds nothing to align. The engine's Inductor kernel still sums the row's squares in its own lane
order (`replay.sum_order`), ATen's `mean` in another, and the rare row whose FP32 sum differs in its last bit flips
a BF16 output; everything downstream departs from there. The scan records, per HF module, the lanes its engine
kernels sum in (`ScanResult.ordered_sums`); a module whose row reductions no region already orders becomes a region
of kind `sum_order` with no sites, one per module pattern, whose splice is the module's forward with its row sums
in the engine's order and HF's rounding otherwise. HF's rounding there is its cast back to the input's dtype
(`.to(input_dtype)`): a final norm whose input the patch carries in FP32 rounds nothing before its weight, as the
engine's kernel on its FP32 residual does not, so the splice rounds there only while its input is low precision
(`input_rounds`).
"""

from __future__ import annotations

from graphdiff.analysis.regions import module_pattern
from graphdiff.codegen.fragment import Fragment
from graphdiff.ops import is_low, op_name
from graphdiff.records import Graph, Node, Region, ScanResult, layer_of, walk
from graphdiff.replay.sum_order import is_row_op
from graphdiff.runtime import module_regex

KIND = "sum_order"


def order_regions(scan: ScanResult, graph: Graph) -> list[Region]:
    """One `sum_order` region per module pattern whose modules' row sums the engine orders and no scanned region
    orders already (that region's splice sums them in the engine's order itself)."""
    ordered_by_region = {m for r in scan.regions for m in r.reduction_lanes}
    nodes = graph.node_map()
    with_rows = {n.module for n in graph.nodes if n.module and is_row_op(n, nodes)}
    by_pattern: dict[str, dict[str, int]] = {}
    for module, lanes in scan.ordered_sums.items():
        if module in ordered_by_region or module not in with_rows or calls_children(graph, module):
            continue
        by_pattern.setdefault(module_pattern(module), {})[module] = lanes
    return [Region(name=f"{pattern}#{KIND}", kind=KIND, module=pattern,
                   kind_reason="no rounding site: the engine's kernel sums the row in its own lane order "
                               f"({', '.join(sorted({str(v) for v in lanes.values()}))} lanes), the trainer in ATen's",
                   layers=sorted({layer_of(m) for m in lanes}, key=lambda x: -1 if x is None else x),
                   sites=[], rounded_on=[], reduction_lanes=lanes)
            for pattern, lanes in by_pattern.items()]


def layer_groups(scan: ScanResult, region: Region) -> list[list[int]]:
    """The region's layers split by how their norm kernel reads its input: back from its BF16 store after the mean
    (`ScanResult.norm_rereads`), from the store in every pass (`norm_reads_stored`), or not; [[]] when they all do
    alike."""
    layers = [ly for ly in region.layers if ly is not None]
    rx = module_regex(region.module)
    rereads = {layer_of(m) for m in scan.norm_rereads if rx.match(m)}
    stored = {layer_of(m) for m in scan.norm_reads_stored if rx.match(m)}
    groups = [[ly for ly in layers if ly in rereads], [ly for ly in layers if ly in stored],
              [ly for ly in layers if ly not in rereads | stored]]
    groups = [g for g in groups if g]
    return groups if len(groups) > 1 else [[]]


def store_reads(scan: ScanResult, region: Region, layers: list[int] | None) -> tuple[bool, bool]:
    """Do the region's modules (of `layers`, default all) read their input back from the engine's BF16 store after
    the mean (`norm_rereads`), and do they read it from the store in every pass, the mean too (`norm_reads_stored`)?"""
    rx = module_regex(region.module)

    def reads(modules: list[str]) -> bool:
        return any(rx.match(m) and (not layers or layer_of(m) in layers) for m in modules)

    return reads(scan.norm_rereads), reads(scan.norm_reads_stored)


def with_order_regions(scan: ScanResult, graph: Graph) -> ScanResult:
    """The scan with its `sum_order` regions added (what codegen cuts and verifies)."""
    more = order_regions(scan, graph)
    return scan.model_copy(update={"regions": [*scan.regions, *more]}) if more else scan


def seed_node(graph: Graph, region: Region, layers: list[int] | None = None) -> Node | None:
    """The first row reduction of the region's representative module (its first layer, or the first of `layers`)."""
    nodes = graph.node_map()
    rx = module_regex(region.module)
    found = [n for n in graph.nodes if n.module and rx.match(n.module) and is_row_op(n, nodes)]
    if layers:
        found = [n for n in found if layer_of(n.module) in layers] or found
    return found[0] if found else None


def calls_children(graph: Graph, module: str) -> bool:
    """Does the module call submodules (its forward then cannot be re-emitted as one leaf's)?"""
    return any((n.module or "").startswith(module + ".") for n in graph.nodes)


def input_rounds(frag: Fragment, nodes: dict[str, Node]) -> dict[str, str]:
    """The fragment's casts of an FP32 value back to its activation input's dtype before its output (HF's
    `.to(input_dtype)`): node -> that input. Its output's rounding stays (the engine stores the norm's output)."""
    inputs = [i for i in frag.inputs if i not in frag.params and is_low(nodes[i].dtype)]
    if len(inputs) != 1:
        return {}
    x = inputs[0]
    inside = {n.name for n in frag.nodes}
    found = {}
    for n in frag.nodes:
        if (n.name in frag.rounds and n.name not in frag.outputs and n.dtype == nodes[x].dtype and n.inputs
                and op_name(n.target) in ("_to_copy", "convert_element_type")
                and nodes[n.inputs[0]].dtype == "float32"
                and x in walk([n.name], lambda m: [i for i in nodes[m].inputs if i in inside or i == x])):
            found[n.name] = x
    return found
