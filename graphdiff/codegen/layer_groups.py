"""A region's layers in groups sharing one rounding plan, and the sites of a group's representative layer: what one
splice's code must hold for every layer it serves."""

from __future__ import annotations

from graphdiff.codegen import copy_reads, math_order, norm_order
from graphdiff.codegen.fragment import within
from graphdiff.ops import op_name
from graphdiff.records import Graph, Node, Region, ScanResult, Side, Site, layer_of
from graphdiff.runtime import module_regex


def _layer_nodes(graph: Graph, module: str) -> list[Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.module == module]


def _plan_signature(sites: list[Site]) -> tuple:
    """What the generated code of one layer depends on: which ops round, on which side (not how the scan found
    them: a value matched in one layer and computed inside a kernel in another is rounded alike)."""
    return tuple(sorted((op_name(s.train.op), s.rounded_on) for s in sites))


def layer_groups(scan: ScanResult, region: Region, graph: Graph | None = None) -> list[list[int]]:
    """The region's layers in groups that share one rounding plan, first layer first; [[]] when one code serves every
    layer: its layers do not differ, or one engine kernel code serves them all (then a site seen in only some layers
    is weak evidence, and the union is generated; `_representative_sites`)."""
    if region.kind in (math_order.KIND, copy_reads.KIND):  # one splice serves every layer alike
        return [[]]
    rereads = norm_order.layer_groups(scan, region)  # a norm kernel that reads its input back from its store
    if region.kind == norm_order.KIND:
        return rereads
    groups = _site_groups(scan, region)
    for cut in (rereads, _incoming_read_groups(scan, graph, region) if graph is not None else [[]]):
        if cut != [[]]:
            groups = cut if groups == [[]] else [g for g in ([ly for ly in s if ly in c] for s in groups for c in cut)
                                                 if g]
    return groups


def _incoming_read_groups(scan: ScanResult, graph: Graph, region: Region) -> list[list[int]]:
    """The region's layers split by how the layer's own code (its residual add) reads the incoming activation the
    engine holds in FP32: through a BF16 copy the engine stored (`read_rounded_by`: the last layer, whose sum the
    final norm's kernel loads) or in FP32 (recomputed in the kernel). [[]] unless both occur; layers whose incoming
    activation is BF16 on both sides (the embedding) go with either."""
    nodes, users = graph.node_map(), graph.users()
    rx = module_regex(region.module)
    by_node = {d.node: d for d in scan.plan}
    rounded: set[int] = set()
    fp32: set[int] = set()
    for t in scan.plan:
        if t.rule != "matched" or t.engine is None or (t.engine.on_grid and not t.evidence.read_rounded_by):
            continue
        for u in users.get(t.node, []):
            owner = nodes[u].module or ""
            layer = layer_of(owner)
            if layer is None or not rx.fullmatch(owner) or within(t.module, owner) or u not in by_node:
                continue
            (rounded if by_node[u].id in t.evidence.read_rounded_by else fp32).add(layer)
    if not rounded or not fp32:
        return [[]]
    rest = [ly for ly in region.layers if ly is not None and ly not in rounded]
    return [g for g in (rest, sorted(rounded)) if g]


def _site_groups(scan: ScanResult, region: Region) -> list[list[int]]:
    """The region's layers in groups whose sites share one rounding plan; [[]] when one code serves every layer."""
    layers = [ly for ly in region.layers if ly is not None]
    if not region.differing_layers or len(region.kernels) == 1 or not layers:
        return [[]]
    sites = {s.id: s for s in scan.sites}
    by_layer: dict[int, list[Site]] = {ly: [] for ly in layers}
    for i in region.sites:
        if i in sites and (ly := sites[i].layer) is not None and ly in by_layer:
            by_layer[ly].append(sites[i])
    groups: dict[tuple, list[int]] = {}
    for ly in layers:
        groups.setdefault(_plan_signature(by_layer[ly]), []).append(ly)
    return [[]] if len(groups) == 1 else list(groups.values())


def representative_sites(scan: ScanResult, graph: Graph, region: Region,
                          layers: list[int] | None = None) -> tuple[dict[str, Side], list[str], list[str]]:
    """The region's site nodes in its first layer, or in the first of `layers` (a group sharing one rounding plan)
    (node -> the side that rounds it), problems (why they cannot stand for every layer), notes.

    Layers whose sites differ from the first: when the engine runs one kernel code for the region in every
    layer (and HF runs one module code), the rounding plan is the same in every layer, and a site seen in
    only some layers is one the scan could not confirm elsewhere (weak evidence). Those sites are mapped to
    the first layer by their position in the layer's module and the union is generated. Layers whose sites
    differ only in how the scan found them (matched or inside a kernel) share one plan. Otherwise refused
    (`layer_groups` splits such a region into groups first)."""
    sites = {s.id: s for s in scan.sites}
    members = [sites[i] for i in region.sites if i in sites and (not layers or sites[i].layer in layers)]
    layer = (next((ly for ly in layers if ly in region.layers), layers[0]) if layers
             else region.layers[0] if region.layers else None)
    first = [s for s in members if s.layer == layer]
    names = {s.train.node: s.rounded_on for s in first}
    by_layer: dict[int | None, list[Site]] = {}
    for s in members:
        by_layer.setdefault(s.layer, []).append(s)
    if layers or not region.differing_layers or len({_plan_signature(v) for v in by_layer.values()}) == 1:
        return names, [], []
    if len(region.kernels) != 1 or not first:
        return names, [f"layers {region.differing_layers} differ from layer {layer} and run other engine "
                       "kernels: one code for all layers would be wrong"], []
    base = _layer_nodes(graph, first[0].train.module or "")
    added: list[str] = []
    for s in members:
        if s.layer == layer:
            continue
        here = _layer_nodes(graph, s.train.module or "")
        pos = next((k for k, n in enumerate(here) if n.name == s.train.node), None)
        if pos is None or len(here) != len(base) or any(op_name(a.target) != op_name(b.target)
                                                        for a, b in zip(here, base)):
            return names, [f"layer {s.layer}'s module {s.train.module} is not laid out like layer {layer}'s"], []
        if base[pos].name not in names:
            names[base[pos].name] = s.rounded_on
            added.append(f"{base[pos].name} (seen at layer {s.layer} as {s.train.node})")
    extra = f": added {', '.join(added)}" if added else f" (layer {layer} holds them all)"
    return names, [], [f"{region.name}: the sites of layers {region.differing_layers} differ from layer {layer}'s; "
                       f"one engine kernel ({region.kernels[0]}) serves every layer, so the union of the sites is "
                       f"generated{extra}"]
