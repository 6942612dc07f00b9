"""A region's fragment cut out of the HF ATen graph: its splice point (a module forward, a function, or a carry),
its nodes and boundary, its rounding plan from the scan's plan, how the engine reads its values; and every region's
fragments cut, merged per splice point and their outputs decided (`cut_fragments`)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

from graphdiff.analysis.regions import OPAQUE_KINDS
from graphdiff.analysis.rounding import is_view
from graphdiff.codegen import carry_plan, copy_reads, math_order, norm_order
from graphdiff.codegen.copy_reads import dotted_module
from graphdiff.codegen.fragment import Fragment, is_boundary, merge
from graphdiff.codegen.layer_groups import layer_groups, representative_sites
from graphdiff.codegen.outputs import decide_outputs
from graphdiff.ops import is_low, op_name
from graphdiff.records import Graph, Node, Region, ScanResult, walk
from graphdiff.replay.inductor_math import INDUCTOR_MATH
from graphdiff.replay.kernel_fragment import value_base
from graphdiff.replay.sum_order import is_row_op


def _mark_reads(scan: ScanResult, graph: Graph, region: Region, frag: Fragment) -> None:
    """How the engine reads the fragment's values otherwise than eager: by Inductor's math, through a stored copy,
    from a low-precision table."""
    frag.inductor_math, (frag.rounded_reads, frag.rounded_values) = (_inductor_math(scan, frag.nodes),
                                                                     _rounded_reads(scan, graph, frag))
    frag.table_inputs = _table_inputs(scan, graph, region, frag.inputs)
    frag.fixed_inputs = fixed_inputs(graph, frag.inputs, set(frag.table_inputs))


def fixed_inputs(graph: Graph, inputs: list[str], skip: set[str]) -> dict[str, str]:
    """The fragment's low-precision inputs made from no activation: no token embedding and no floating-point graph
    input among their producers, only parameters, buffers and positions (a rotary embedding's cos and sin). HF makes
    such a table in its input's dtype, so an FP32 value a patch carries there (Gemma's scaled embedding) makes it FP32
    while the engine's is still the low-precision table: the splice reads it in the dtype the trace recorded."""
    nodes = graph.node_map()

    def activation(name: str) -> bool:
        n = nodes[name]
        if n.param is not None:
            return False
        return op_name(n.target) == "embedding" or (
            n.op == "placeholder" and not (n.dtype or "").startswith(("int", "uint", "bool")))

    out = {}
    for i in inputs:
        n = nodes.get(i)
        if n is None or i in skip or n.param is not None or not is_low(n.dtype):
            continue
        if not activation(i) and not any(activation(x) for x in producers(nodes, i)):  # stops at the first
            out[i] = str(n.dtype)
    return out


def producers(nodes: dict[str, Node], name: str) -> Iterator[str]:
    """Every node `name` is computed from, nearest first (lazy)."""
    return walk([name], lambda n: [x for x in nodes[n].inputs if x in nodes])


def _table_inputs(scan: ScanResult, graph: Graph, region: Region, inputs: list[str]) -> dict[str, str]:
    """The RoPE fragment's FP32 inputs computed by a trainer `cos` or `sin` (scaled or not), where the engine gathers
    cos/sin from a low-precision table (`engine_rope_table`)."""
    if region.kind != "rope" or not scan.engine_rope_table:
        return {}
    nodes = graph.node_map()

    def trig(name: str, depth: int = 0) -> bool:
        n = nodes.get(name)
        if n is None or depth > 3 or n.op != "call_function":
            return False
        return op_name(n.target) in ("cos", "sin") or any(trig(i, depth + 1) for i in n.inputs)

    return {i: scan.engine_rope_table for i in inputs
            if i in nodes and nodes[i].dtype == "float32" and nodes[i].param is None and trig(i)}


def _module_method(file: str, function: str, module_class: str) -> bool:
    """Is `function` a method of the module's class (xIELU's `_xielu_python`, called by its forward) rather than a
    module-level function of its file? Its ops are then the module's own: the splice re-emits the module's forward."""
    dotted = dotted_module(file)
    if dotted is None or not module_class:
        return False
    try:
        owner = importlib.import_module(dotted)
    except ImportError:
        return False
    cls = getattr(owner, module_class, None)
    return not callable(getattr(owner, function, None)) and isinstance(cls, type) and callable(
        getattr(cls, function, None))


def _grow(graph: Graph, seeds: list[str], keep) -> list[str]:  # noqa: ANN001 - predicate over Node
    nodes, users = graph.node_map(), graph.users()

    def step(name: str) -> list[str]:
        return [o for o in [*nodes[name].inputs, *users.get(name, [])]
                if nodes[o].op == "call_function" and not is_boundary(nodes[o]) and keep(nodes[o])]

    seen = {*seeds, *walk(seeds, step)}
    return [n.name for n in graph.nodes if n.name in seen]


def _boundary(graph: Graph, names: list[str]) -> tuple[list[str], list[str]]:
    nodes, users, inside = graph.node_map(), graph.users(), set(names)
    inputs: list[str] = []
    for name in names:
        for i in nodes[name].inputs:
            if i not in inside and i not in inputs:
                inputs.append(i)
    outputs = [n for n in names if any(u not in inside for u in users.get(n, []))]
    return inputs, outputs


def fragment_for(scan: ScanResult, graph: Graph, region: Region, layers: list[int] | None = None) -> Fragment:
    """Cut the region's splice point out of the HF graph (representative layer: the region's first, or the first of
    `layers`, a group of layers sharing one rounding plan, which the splice then serves alone)."""
    nodes = graph.node_map()
    sides, problems, notes = representative_sites(scan, graph, region, layers)
    site_nodes = [n for n in sides if n in nodes]
    seed = _seed(scan, graph, region, layers)
    first = nodes[site_nodes[0]] if site_nodes else seed
    if first is None:
        return Fragment(key=region.name, target="module", module=region.module, module_class="",
                        problems=["no site of the region is in the training graph"])
    src = first.source
    path = first.module or ""
    module_class = first.module_type or ""
    own_frame = region.kind == copy_reads.KIND  # the helper the seed is in, alone
    if src is not None and src.function != "forward" and (seed is None or own_frame) and not _module_method(
            src.file, src.function, module_class):
        frag = _function_fragment(graph, region, first, site_nodes or [first.name], own_frame)
    else:
        frag = Fragment(key=region.module, target="module", module=region.module, module_class=module_class)
        frag.nodes = [n for n in graph.nodes if n.op == "call_function" and n.module == path]
        if any((m.module or "").startswith(path + ".") for m in graph.nodes):
            frag.target = "carry"
            frag.carry, problem = carry_plan.carry_for(scan, graph, region, path, {s: sides[s] for s in site_nodes},
                                                       layers)
            frag.problems += [problem] if problem else []
    frag.inputs, frag.outputs = _boundary(graph, [n.name for n in frag.nodes])
    _mark_reads(scan, graph, region, frag)
    frag.sites = {s: region.name for s in site_nodes if sides[s] == "train"}
    frag.sites.update(_viewed_sites(frag, nodes))
    frag.engine_sites = {s: region.name for s in site_nodes if sides[s] == "engine"}
    trainer_rounds = {d.node for d in scan.plan if d.train.rounds}
    frag.rounds = {n.name for n in frag.nodes if n.name in trainer_rounds}
    frag.regions = [region.name]
    if region.reduction_lanes and frag.target != "carry":
        frag.ordered = {n.name: region.name for n in frag.nodes if is_row_op(n, nodes)}
        frag.lanes = dict(region.reduction_lanes) if frag.ordered else {}
        frag.reads_store, frag.stored_input = norm_order.store_reads(scan, region, layers)
    if frag.target == "module":
        _bind_params(frag, nodes, path)
    if region.kind == norm_order.KIND:  # after its parameters are known: the one other input is the activation
        frag.input_rounds = norm_order.input_rounds(frag, nodes)
    frag.problems += problems
    frag.notes += notes
    if layers:
        frag.key, frag.layers = f"{frag.key}@layers {','.join(map(str, layers))}", list(layers)
    return frag


def _function_fragment(graph: Graph, region: Region, first: Node, seeds: list[str], own_frame: bool) -> Fragment:
    """The helper function `first` is computed in, grown from `seeds`: with the helpers it calls (rotate_half) in the
    same module instance, any frame but the caller's forward; or, `own_frame`, that function's own ops alone."""
    src, nodes, path = first.source, graph.node_map(), first.module or ""
    assert src is not None
    dotted = dotted_module(src.file)
    frag = Fragment(key=f"{dotted}.{src.function}", target="function", module=region.module,
                    module_class=first.module_type or "", function=f"{dotted}.{src.function}")
    if dotted is None:
        frag.problems.append(f"{src.function} is not defined in a transformers module ({src.file})")
    frag.nodes = [nodes[n] for n in _grow(graph, seeds, lambda n: (
        n.module == path and n.source is not None and n.source.function != "forward"
        and (not own_frame or n.source.function == src.function)))]
    return frag


def _seed(scan: ScanResult, graph: Graph, region: Region, layers: list[int] | None) -> Node | None:
    """Where a region with no sites is cut: a norm the engine sums in its own order at its first row reduction's
    module, one whose engine computes an op with Inductor's math at that op's module."""
    if region.kind == norm_order.KIND:
        return norm_order.seed_node(graph, region, layers)
    if region.kind == copy_reads.KIND:
        return copy_reads.seed_node(scan, graph, region, layers)
    return math_order.seed_node(scan, graph, region, layers) if region.kind == math_order.KIND else None


def _inductor_math(scan: ScanResult, frag_nodes: list[Node]) -> list[str]:
    """The nodes of INDUCTOR_MATH (tanh, exp, sin, cos, ...) whose engine twin is computed in a kernel Inductor
    generated (its math library, not ATen's), not those the engine runs in an extern or custom op; and the ops the scan
    found computed by Inductor's math (`ScanResult.inductor_math`: a GELU, which Inductor lowers through erf)."""
    generated = {r.kernel for r in scan.replay} | {k.split(" @ ")[0] for k in scan.not_replayed}
    kernel_of = {d.node: d.evidence.kernel for d in scan.plan if d.rule == "matched"}
    found = math_order.recorded(scan)
    return [n.name for n in frag_nodes if n.name in found or (
        op_name(n.target) in INDUCTOR_MATH and kernel_of.get(n.name) in generated)]


def _viewed_sites(frag: Fragment, nodes: dict[str, Node]) -> dict[str, str]:
    """Outputs that are views of a site inside the fragment (a linear's `mm` reshaped back to [batch, seq, out]), each
    with the site's region: they leave the fragment in FP32 as the site does."""
    inside, out = {n.name for n in frag.nodes}, {}
    for o in frag.outputs:
        n = nodes[o]
        while n.name not in frag.sites and is_view(n) and n.inputs and n.inputs[0] in inside:
            n = nodes[n.inputs[0]]
        if n.name != o and n.name in frag.sites:
            out[o] = frag.sites[n.name]
    return out


def _rounded_reads(scan: ScanResult, graph: Graph, frag: Fragment) -> tuple[list[str], list[str]]:
    """The fragment's non-carry nodes that read a value from outside it through the engine's stored copy while the
    engine's other readers hold it in FP32 (`read_rounded_by`), and the ops computing those values (`value_base`: a
    reader's other inputs it reads as they are: Falcon's last residual add reads the residual rounded, the block's sum
    in FP32; OLMo 2's `rotate_half` reads the q norm's product through its cast)."""
    if frag.target == "carry":
        return [], []
    node_of = {d.id: d.node for d in scan.plan}
    inside = {n.name for n in frag.nodes}
    pairs = [(node_of[i], d.node) for d in scan.plan if d.node not in inside for i in d.evidence.read_rounded_by
             if i in node_of]
    readers = {r for r, _ in pairs if r in inside}
    nodes = graph.node_map()
    values = {b.name for r, v in pairs if r in inside and (b := value_base(nodes, v)) is not None}
    return [n.name for n in frag.nodes if n.name in readers], sorted(values)


def _bind_params(frag: Fragment, nodes: dict[str, Node], path: str) -> None:
    """A module fragment's parameter inputs as attributes of the module at `path`; one activation input."""
    for i in frag.inputs:
        param = nodes[i].param
        if param is not None:
            attr = param.removeprefix(path + ".")
            if "." in attr:
                frag.problems.append(f"parameter {param} is not an attribute of {path}")
            frag.params[i] = attr
    acts = [i for i in frag.inputs if i not in frag.params]
    if len(acts) != 1 or not frag.outputs:  # several outputs: a tuple, bound to the return statement (generate)
        frag.problems.append(f"module forward with {len(acts)} activation inputs and {len(frag.outputs)} "
                             "outputs: only module forwards of one activation input are re-emitted")


def cut_fragments(scan: ScanResult, graph: Graph, regions: list[str] | None = None,
                  fp32_attention: frozenset[str] = frozenset(), replaced: dict[str, str] | None = None
                  ) -> list[Fragment]:
    """The splice points of `regions` (default all; attention regions are one opaque op, no fragment): cut per
    group of layers sharing one rounding plan, merged per splice, boundary outputs decided (`fp32_attention`: the
    attention regions whose splice takes FP32 inputs, rounding them as the engine stores them: the engine's own op;
    `replaced`: module pattern -> region of the modules an experts splice replaces, which reads its input in its
    weights' dtype). Generation and verification both cut them here."""
    wanted = [r for r in scan.regions if (regions is None or r.name in regions) and r.kind not in OPAQUE_KINDS]
    cuts = [(r, g, fragment_for(scan, graph, r, g)) for r in wanted for g in layer_groups(scan, r, graph)]
    frags = merge(_common_groups(scan, graph, cuts))
    _keep_spliced_inputs(graph, frags)
    decide_outputs(graph, frags, {s.train.node: s.region for s in scan.sites if s.region in fp32_attention},
                   replaced)
    return frags


def _keep_spliced_inputs(graph: Graph, frags: list[Fragment]) -> None:
    """No fixed input is one another splice makes: a rotary module that is a region of its own (Phi through vLLM's
    Transformers backend) hands its cos/sin on in FP32 on purpose, as the engine computes them."""
    made = {n.name for f in frags for n in f.nodes}
    nodes = graph.node_map()
    for f in frags:
        f.fixed_inputs = {i: dtype for i, dtype in f.fixed_inputs.items()
                          if i not in made and not any(x in made for x in producers(nodes, i))}


def _common_groups(scan: ScanResult, graph: Graph,
                   cuts: list[tuple[Region, list[int], Fragment]]) -> list[Fragment]:
    """Regions that share a splice point but group their layers differently are cut again on the groups common to
    all of them (a module forward serves each layer with one function, which must hold every region's plan there)."""
    base = {id(f): f.key.split("@", 1)[0] for _, _, f in cuts}
    by_base: dict[str, list[tuple[Region, list[int], Fragment]]] = {}
    for cut in cuts:
        by_base.setdefault(base[id(cut[2])], []).append(cut)
    out: list[Fragment] = []
    for group in by_base.values():
        names = list(dict.fromkeys(r.name for r, _, _ in group))
        groups_of = {n: [g for r, g, _ in group if r.name == n] for n in names}
        if len({tuple(map(tuple, gs)) for gs in groups_of.values()}) == 1:  # every region groups its layers alike
            out += [f for _, _, f in group]
            continue
        layers = sorted({ly for r, _, _ in group for ly in r.layers if ly is not None})
        # each layer's groups, one per region: layers with the same ones share one plan for all of them
        key_of = {ly: tuple(next((k for k, g in enumerate(groups_of[n]) if not g or ly in g), -1) for n in names)
                  for ly in layers}
        parts: dict[tuple, list[int]] = {}
        for ly in layers:
            parts.setdefault(key_of[ly], []).append(ly)
        regions = {r.name: r for r, _, _ in group}
        out += [fragment_for(scan, graph, r, part) for r in regions.values() for part in parts.values()
                if any(ly in r.layers for ly in part)]
    return out
