"""A region's own subgraph of the HF ATen graph, where it splices into the model, and its rounding plan.

The runtime replaces Python code, not graph nodes, so each region is cut at a Python boundary the
capture already names: the HF module whose `forward` computes the sites (`Node.module`), or the helper
function named by the sites' source frame (`Source.function`, e.g. `apply_rotary_pos_emb`). A module
whose own nodes only join the outputs of its child modules (a decoder layer's residual adds) cannot be
re-emitted without re-emitting the children; there the patch *carries* FP32 instead: its incoming
activation is upcast, so eager type promotion keeps the sum in FP32 ("carry").

Rounding plan, per node of the fragment, read from the scan's plan (`ScanResult.plan`, decided once in the
analysis): a node is rounded to its low-precision dtype where HF eager rounds it (`Decision.train.rounds`),
except at a trainer-rounded site of an aligned region; at an engine-rounded site of an aligned region it is
rounded where the engine rounds. So with no region aligned the fragment is HF eager, and each region toggles
only its own sites (what ablations need).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any, Literal

from graphdiff.analysis.regions import OPAQUE_KINDS
from graphdiff.analysis.rounding import is_view
from graphdiff.codegen import copy_reads, math_order, norm_order
from graphdiff.codegen.copy_reads import dotted_module
from graphdiff.ops import ACTIVATIONS, CASTS, EXACT, MATMULS, is_heavy, is_low, op_name
from graphdiff.records import Graph, Node, Region, ScanResult, Side, Site, layer_of, walk
from graphdiff.replay.inductor_math import INDUCTOR_MATH
from graphdiff.replay.kernels import value_base
from graphdiff.replay.sum_order import is_row_op
from graphdiff.runtime import module_regex

Target = Literal["module", "function", "carry"]
Rounding = tuple[Literal["always", "unless-aligned", "if-aligned"], str]  # (when, region)


def is_boundary(n: Node) -> bool:
    """A fragment boundary: matmul-like, attention, or a getitem of a multi-output op."""
    return is_heavy(n.target) or n.target == "getitem"


@dataclass
class Fragment:
    """One splice point: the nodes it re-emits, its boundary, and which sites (of which region) it holds."""

    key: str  # module pattern, or the function's dotted path
    target: Target
    module: str  # module pattern (`layers.*`)
    module_class: str
    function: str = ""  # dotted path of the replaced function (target == "function")
    nodes: list[Node] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # boundary inputs, first-use order
    params: dict[str, str] = field(default_factory=dict)  # input placeholder -> module attribute
    outputs: list[str] = field(default_factory=list)
    sites: dict[str, str] = field(default_factory=dict)  # trainer-rounded site node (representative layer) -> region
    engine_sites: dict[str, str] = field(default_factory=dict)  # engine-rounded site node -> region
    rounds: set[str] = field(default_factory=set)  # nodes HF eager rounds (from the scan's plan)
    keep_fp32: dict[str, bool] = field(default_factory=dict)  # output -> may leave the fragment in FP32
    # output -> the regions it leaves in FP32 only while they are aligned too: the attention regions it reaches (their
    # splice, the engine's op, rounds its inputs as the engine stores them; HF's sdpa refuses mixed dtypes) and the
    # carry regions whose residual add sums it (in FP32 only with the residual carried)
    fp32_with: dict[str, list[str]] = field(default_factory=dict)
    # carry: the module's own ops read its incoming activation rounded (the engine's low-precision copy at a
    # piecewise graph split), these child modules read it in FP32
    carry_rounded: bool = False
    fp32_children: list[str] = field(default_factory=list)
    rounded_children: list[str] = field(default_factory=list)  # children reading the stored copy (carry_rounded_child)
    fp32_outputs: list[str] = field(default_factory=list)  # carry: children whose scaled or summed output stays FP32
    # carry: child whose output the module's own code scales -> the children reading the product, handed it in FP32
    fp32_scaled: dict[str, list[str]] = field(default_factory=dict)
    carry_input: bool = True  # carry: its incoming activation is held FP32 (not where its only sites are handoffs)
    # carry: child module -> the decoder layers where the module's own residual add reading that child's output is
    # stored by the engine in BF16 (the patch may hold the child's output in FP32: the sum is then rounded there)
    rounded_sums: dict[str, list[int]] = field(default_factory=dict)
    # carry: child module -> the decoder layers where the module's own residual add of that child's output is stored
    # by the engine in BF16 for later kernels while its own kernel reads it in FP32: later adds read it rounded
    stored_sums: dict[str, list[int]] = field(default_factory=dict)
    regions: list[str] = field(default_factory=list)
    # row sums/means the engine sums in its own order when their region is aligned (node -> region), and that
    # order's lanes per HF module (Region.reduction_lanes; the runtime passes each module's)
    ordered: dict[str, str] = field(default_factory=dict)
    lanes: dict[str, int] = field(default_factory=dict)
    # its layer norms' engine kernels read the input back from their BF16 store after the mean (norm_order)
    reads_store: bool = False
    # its layer norms' engine kernels read the input from their BF16 store in every pass, the mean too (norm_order)
    stored_input: bool = False
    # nodes of INDUCTOR_MATH the engine computes in a kernel Inductor generated: computed by Inductor when aligned
    inductor_math: list[str] = field(default_factory=list)
    # FP32 inputs (cos/sin) the engine gathers from a low-precision table instead (ScanResult.engine_rope_table):
    # input -> that dtype, rounded to it when the fragment's regions are aligned
    table_inputs: dict[str, str] = field(default_factory=dict)
    # nodes whose engine op reads an input of the fragment as its stored low-precision copy while another reader
    # gets it in FP32 (`evidence.read_rounded_by` of a value made outside): they read it rounded (a no-op unless a
    # patch holds it FP32)
    rounded_reads: list[str] = field(default_factory=list)
    rounded_values: list[str] = field(default_factory=list)  # the ops computing the values they read so
    # the scanned decoder layers this splice serves (a group of layers sharing one rounding plan); [] = every layer
    layers: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # the emitted PyTorch function, once emitted (codegen uses it to verify bindings)
    compiled: Callable[..., Any] | None = None


def _mark_reads(scan: ScanResult, graph: Graph, region: Region, frag: Fragment) -> None:
    """How the engine reads the fragment's values otherwise than eager: by Inductor's math, through a stored copy,
    from a low-precision table."""
    frag.inductor_math, (frag.rounded_reads, frag.rounded_values) = (_inductor_math(scan, frag.nodes),
                                                                     _rounded_reads(scan, graph, frag))
    frag.table_inputs = _table_inputs(scan, graph, region, frag.inputs)


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
            if layer is None or not rx.fullmatch(owner) or _within(t.module, owner) or u not in by_node:
                continue
            (rounded if by_node[u].id in t.evidence.read_rounded_by else fp32).add(layer)
    if not rounded or not fp32:
        return [[]]
    rest = [ly for ly in region.layers if ly is not None and ly not in rounded]
    return [g for g in (rest, sorted(rounded)) if g]


def _within(module: str | None, owner: str) -> bool:
    """Is `module` the module `owner` or one of its descendants?"""
    return module == owner or (module or "").startswith(owner + ".")


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


def _representative_sites(scan: ScanResult, graph: Graph, region: Region,
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
    sides, problems, notes = _representative_sites(scan, graph, region, layers)
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
            trained = [s for s in site_nodes if sides[s] == "train"]
            scaled, handed = _scaled_child_outputs(graph, path, trained), scaled_handoffs(graph, path, trained)
            if any(not is_add(nodes[s]) and s not in scaled and s not in handed for s in site_nodes):
                frag.problems.append("the module calls submodules and its sites are not residual adds or scaled "
                                     "child outputs: its forward cannot be re-emitted")
            frag.fp32_outputs = sorted({c for children in scaled.values() for c in children})
            for source, reader in handed.values():
                frag.fp32_scaled.setdefault(source, []).append(reader)
            frag.carry_input = not site_nodes or any(s not in handed for s in site_nodes)
            frag.carry_rounded, frag.fp32_children, frag.rounded_children = _carry_reads(scan, graph, region,
                                                                                         layers)
            frag.rounded_sums = rounded_sums(scan, graph, region.module)
            frag.stored_sums = stored_sums(scan, graph, region.module)
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


def is_add(n: Node) -> bool:
    """An add, in place or not (a parallel block's `mlp_output += attention_output`)."""
    return op_name(n.target) in ("add", "add_")


def _scaled_child_outputs(graph: Graph, path: str, sites: list[str]) -> dict[str, list[str]]:
    """The sites that combine child modules' outputs before a residual add of the module's own, each with the
    children (paths relative to `path`) whose outputs the patch holds in FP32: a child's output scaled by a constant
    (`residual + hidden_states * residual_multiplier`), two children's outputs summed (a parallel block's
    `attn_output + mlp_output + residual`), or a child's output gated by an activation of another child's output
    (`sigmoid(gate(x)) * shared_expert(x)`, before the MoE block's own add). The trainer rounds the product or sum,
    the engine computes it in FP32 inside the kernel that adds it; with the children's outputs in FP32 the module's
    own code computes as the engine does. The gate's child is held in FP32 only where its activation is a site too
    (else both sides round the activation, as eager does on the child's BF16 output). Only where each child's output
    feeds nothing but such sites, and the site nothing but the module's own adds, or, for a sum, nothing but one child
    module that runs code of its own (GPT-2's and OPT's `inputs_embeds + position_embeds`, read by the first decoder
    layer, whose kernels sum the two embeddings in FP32)."""
    nodes, users = graph.node_map(), graph.users()
    prefix = path + "."

    def child(name: str) -> str | None:  # the child module whose output `name` is, read by nothing but the sites
        src = nodes[name]
        only_sites = not set(users.get(name, [])) - set(sites)
        return (src.module or "").removeprefix(prefix).split(".")[0] if (
            (src.module or "").startswith(prefix) and only_sites) else None

    found: dict[str, list[str]] = {}
    for s in sites:
        n = nodes[s]
        if op_name(n.target) == "mul" and len(n.inputs) == 2:  # a child's output times an activation of another's
            held = [child(i) or _gate_child(nodes, users, path, i, s, sites) for i in n.inputs]
        elif (op_name(n.target) == "mul" and len(n.inputs) == 1) or (is_add(n) and len(n.inputs) == 2):
            held = [child(i) for i in n.inputs]
        else:
            continue
        if not all(held) or not any(h and h != "-" for h in held):
            continue
        readers = users.get(s, [])
        own_adds = all(is_add(nodes[u]) and nodes[u].module == path for u in readers)
        if own_adds or (is_add(n) and _one_reader(graph, path, readers)):
            found[s] = sorted({h for h in held if h and h != "-"})
            found.update({i: found[s] for i in n.inputs if i in sites and i not in found})  # the activation site
    return found


def _one_reader(graph: Graph, path: str, readers: list[str]) -> str | None:
    """The one child module (path relative to `path`) inside which every one of `readers` lies, where that child runs
    code of its own (not a list of layers); None otherwise."""
    nodes, prefix = graph.node_map(), path + "."
    modules = [nodes[u].module or "" for u in readers]
    if not modules or not all(m.startswith(prefix) for m in modules):
        return None
    parts = [m.removeprefix(prefix).split(".") for m in modules]
    reader = ".".join(p[0] for p in takewhile(lambda p: len(set(p)) == 1, zip(*parts)))
    return reader if reader and any(m.module == prefix + reader for m in graph.nodes) else None


def scaled_handoffs(graph: Graph, path: str, sites: list[str]) -> dict[str, tuple[str, str]]:
    """The sites that scale a child module's output by a constant in the module's own code and hand the product to
    another child module (`inputs_embeds * embedding_multiplier`, read by the first decoder layer), each with that
    source child and the reading child (paths relative to `path`). The trainer rounds the product, the engine computes
    it in FP32 inside the kernel of its reader (the first layer's norm, and its residual add) and hands it on
    unrounded; held in FP32 into the reader, its own code computes as the engine does. Only where the source child's
    output feeds nothing but the site, and every value reader of the product lies inside one child module that runs
    code of its own (not a list of layers) (a reader of its dtype alone, a rotary embedding, leaves no node and keeps
    the trainer's value)."""
    nodes, users = graph.node_map(), graph.users()
    prefix = path + "."
    found: dict[str, tuple[str, str]] = {}
    for s in sites:
        n = nodes[s]
        if op_name(n.target) != "mul" or len(n.inputs) != 1:  # one activation times a constant
            continue
        src = nodes[n.inputs[0]]
        if not (src.module or "").startswith(prefix) or set(users.get(src.name, [])) != {s}:
            continue
        source, reader = (src.module or "").removeprefix(prefix), _one_reader(graph, path, users.get(s, []))
        if reader and not _within(source, reader) and not _within(reader, source):
            found[s] = (source, reader)
    return found


def _gate_child(nodes: dict[str, Node], users: dict[str, list[str]], path: str, name: str, site: str,
                sites: list[str]) -> str | None:
    """An operand of the gating product `site` computed by the module's own activation (ACTIVATIONS) of one child's
    output, each read only on this way: that child where the trainer rounds the activation and the engine does not
    (a site: the child's BF16 output held in FP32 is the same value, the activation then runs in FP32), "-" where
    both round it (nothing held); None for anything else."""
    act = nodes[name]
    if (act.module != path or op_name(act.target) not in ACTIVATIONS or len(act.inputs) != 1
            or users.get(name, []) != [site]):
        return None
    src = nodes[act.inputs[0]]
    if not (src.module or "").startswith(path + ".") or users.get(src.name, []) != [name]:
        return None
    return (src.module or "").removeprefix(path + ".").split(".")[0] if name in sites else "-"


def _carry_reads(scan: ScanResult, graph: Graph, region: Region, layers: list[int] | None = None
                 ) -> tuple[bool, list[str], list[str]]:
    """How the carry module reads its incoming activation where the engine holds it in FP32 and stores a BF16 copy
    (the plan's `read_rounded_by`): does its own code read the copy, which of its child modules read the FP32 value
    then, and which children read the copy while its own code reads FP32? A piecewise engine stores the residual
    stream in BF16 where it is live across a graph split (attention): the layer's residual add reads that copy, its
    input norm the FP32 sum in the graph that computed it. OLMo 2's engine recomputes the last layer's sum in FP32 for
    the next layer's residual add and feeds its attention projections the stored copy."""
    nodes, users = graph.node_map(), graph.users()
    node_of = {d.id: d.node for d in scan.plan}
    pattern = module_regex(region.module)
    inside = re.compile(pattern.pattern.removesuffix("$") + r"(?=\.)")  # a child module of a carried one
    rounded, children, copy_readers = False, set(), set()
    for d in scan.plan:
        readers = {node_of[i] for i in d.evidence.read_rounded_by if i in node_of}
        own = sorted(r for r in readers if pattern.match(nodes[r].module or "")
                     and (not layers or layer_of(nodes[r].module) in layers))
        if not own:
            for r in readers:
                m = inside.match(nodes[r].module or "")
                if m and not _within(d.module, m.group(0)) and (not layers or layer_of(m.group(0)) in layers):
                    copy_readers.add((nodes[r].module or "")[m.end() + 1:].split(".")[0])
            continue
        owner = nodes[own[0]].module or ""
        if _within(d.module, owner):  # the layer's own sum (`stored_sums`), not its incoming activation
            continue
        rounded = True
        for u in users.get(d.node, []):
            module = nodes[u].module or ""
            if u not in readers and module.startswith(owner + "."):
                children.add(module[len(owner) + 1:].split(".")[0])
    return rounded, sorted(children), sorted(copy_readers)


def rounded_sums(scan: ScanResult, graph: Graph, pattern: str) -> dict[str, list[int]]:
    """Per child module of the carried modules (`pattern`), the layers whose own residual add of that child's
    output the engine rounds: it stores the sum in BF16 (a post-norm's output added in FP32, the sum stored for the
    next add and the next layer). Where the patch holds the child's output in FP32, eager type promotion would keep
    that sum FP32 across the layer; the carry rounds it where the engine does."""
    return _sums_by_child(graph, pattern, set(scan.rounded_sums))


def stored_sums(scan: ScanResult, graph: Graph, pattern: str) -> dict[str, list[int]]:
    """Per child module of the carried modules, the layers whose own residual add of that child's output the engine
    computes in FP32 for the norm beside it but stores in BF16 for the kernels after it (`ScanResult.stored_sums`):
    the layer's later residual adds read that sum rounded."""
    return _sums_by_child(graph, pattern, set(scan.stored_sums))


def _sums_by_child(graph: Graph, pattern: str, adds: set[str]) -> dict[str, list[int]]:
    """child module -> layers, for the adds of `adds` in a carried module's own code that sum a child's output (or its
    scale by a constant)."""
    nodes, rx = graph.node_map(), module_regex(pattern)
    out: dict[str, set[int]] = {}
    for n in graph.nodes:
        owner, layer = n.module or "", layer_of(n.module)
        if not is_add(n) or n.name not in adds or not rx.fullmatch(owner) or layer is None:
            continue
        for i in n.inputs:
            p, scaled = value_base(nodes, i), False
            if p is not None and p.module == owner and op_name(p.target) == "mul" and len(p.inputs) == 1:
                # the child's output scaled by a constant (Granite's multiplier): the direct child, whose output the
                # carry may hold FP32 (`fp32_outputs`) and the scale reads
                p, scaled = value_base(nodes, p.inputs[0]), True
            if p is not None and (p.module or "").startswith(owner + "."):
                child = (p.module or "")[len(owner) + 1:]
                out.setdefault(child.split(".")[0] if scaled else child, set()).add(layer)
    return {child: sorted(layers) for child, layers in sorted(out.items())}


def merge(frags: list[Fragment]) -> list[Fragment]:
    """Regions whose sites sit in the same module forward or function share one splice point. A region that cannot
    be generated stays on its own: it must not take a region that can (Granite's residual scale, a multiply the
    carry cannot keep FP32, beside its residual adds, which the carry does) down with it."""
    by_key: dict[str, Fragment] = {}
    refused: list[Fragment] = []
    for f in frags:
        g = by_key.get(f.key)
        if f.problems:
            refused.append(f)
        elif g is not None:
            g.sites.update(f.sites)
            g.engine_sites.update(f.engine_sites)
            g.regions += f.regions
            g.fp32_outputs = sorted({*g.fp32_outputs, *f.fp32_outputs})  # a carry's children held FP32, any region's
            g.table_inputs.update(f.table_inputs)
            g.ordered.update({n: r for n, r in f.ordered.items() if n not in g.ordered})
            g.lanes.update({m: n for m, n in f.lanes.items() if m not in g.lanes})
            for source, readers in f.fp32_scaled.items():
                g.fp32_scaled[source] = sorted({*g.fp32_scaled.get(source, []), *readers})
            g.carry_input = g.carry_input or f.carry_input
            g.rounded_reads = sorted({*g.rounded_reads, *f.rounded_reads})
            g.rounded_values = sorted({*g.rounded_values, *f.rounded_values})
        else:
            by_key[f.key] = f
    return [*by_key.values(), *refused]


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
    decide_outputs(graph, frags, {s.train.node: s.region for s in scan.sites if s.region in fp32_attention},
                   replaced)
    return frags


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


def rounding(frag: Fragment, node: str) -> Rounding | None:
    """Where the generated code rounds `node`: always (HF and the engine both store it), unless its region is
    aligned (HF rounds, the engine keeps FP32), only if its region is aligned (the engine rounds, HF not)."""
    if node in frag.rounds:
        return ("unless-aligned", frag.sites[node]) if node in frag.sites else ("always", "")
    if node in frag.engine_sites:
        return "if-aligned", frag.engine_sites[node]
    return None


def rounding_points(frag: Fragment, align: frozenset[str]) -> set[str]:
    """The nodes the generated code rounds when the regions in `align` are aligned (with the outputs it rounds as it
    returns them that no node of the fragment reads)."""
    out = set()
    for n in frag.nodes:
        r = rounding(frag, n.name)
        if r is not None and (r[0] == "always" or (r[0] == "unless-aligned") != (r[1] in align)):
            out.add(n.name)
    read = {i for n in frag.nodes for i in n.inputs}
    low = {n.name for n in frag.nodes if is_low(n.dtype)}
    return out | {o for o in frag.outputs if o in low and o not in read and not leaves_fp32(frag, o, align)}


def leaves_fp32(frag: Fragment, output: str, align: frozenset[str]) -> bool:
    """Does the generated code return `output` in FP32 when the regions in `align` are aligned? Its site's region
    aligned, and it may cross the boundary so (with the attention regions it reaches aligned too, `fp32_with`)."""
    region = frag.sites.get(output)
    return (region in align and frag.keep_fp32.get(output, False)
            and set(frag.fp32_with.get(output, [])) <= align)


def ordered_points(frag: Fragment, align: frozenset[str], lanes: int) -> dict[str, int]:
    """The row reductions the generated code sums in the engine's order (node -> lanes) when the regions in
    `align` are aligned and the module's kernel sums in `lanes` lanes (0: none)."""
    return {n: lanes for n, r in frag.ordered.items() if r in align} if lanes else {}


def decide_outputs(graph: Graph, frags: list[Fragment], attention: dict[str, str] | None = None,
                   replaced: dict[str, str] | None = None) -> None:
    """May an output that an aligned site leaves in FP32 cross the splice boundary unrounded?

    Yes when every consumer is re-emitted by the patch (it reads FP32 and rounds where the engine
    stores), a matmul (the runtime rounds nn.Linear inputs to the weight dtype: the engine stores
    matmul inputs in BF16), or plain elementwise code whose results only reach matmuls (SwiGLU's
    `act(gate) * up` stays FP32 by type promotion, as it does in the engine's fused kernel).
    Also, while the attention regions it reaches are aligned, when the unpatched code it feeds only reaches
    matmuls and the attention ops in `attention` (op node -> region; their splice rounds its inputs to BF16 as the
    engine stores them): a rotary embedding's FP32 cos/sin, which the engine's RoPE kernel reads in FP32 and HF's
    `q * cos + rotate_half(q) * sin` then computes in FP32 by type promotion, rounded once by the engine's op.
    Also, while the carry regions are aligned, when it feeds a carried module's own residual add (a post-norm's
    output: the engine's fused add reads it unrounded, the carried FP32 residual sums it in FP32); and while the
    experts regions of `replaced` are aligned, when it feeds their modules (the splice reads it rounded, as the
    engine's fused-MoE op loads its BF16 store).
    Otherwise (attention, unpatched code) the value is rounded at the boundary.
    """
    r = _Reach(graph, frags, attention or {})
    within = [(module_regex(m), region) for m, region in (replaced or {}).items()]
    for f in frags:
        for o in f.outputs:
            ok, carried = True, set()
            for u in r.through_views(o):
                if u in r.patched:  # re-emitted: it reads FP32 as the engine does while its own regions are aligned
                    carried.update(r.patched[u])
                    continue
                if r.matmul(u):
                    continue
                if (regions := r.carried_add(u)) is not None:
                    carried.update(regions)
                    continue
                if (region := next((g for rx, g in within if rx.fullmatch(r.nodes[u].module or "")), None)):
                    carried.add(region)
                    continue
                n = r.nodes[u]
                if not is_boundary(n) and n.op == "call_function" and all(r.matmul(w) for w in r.through_views(u)):
                    continue
                ok = False
            reached = None if ok or not attention else r.reached_attention(o)
            f.keep_fp32[o] = ok or bool(reached)
            if f.keep_fp32[o] and (reached or carried):
                f.fp32_with[o] = sorted(set(reached or []) | carried)


def served_nodes(graph: Graph, frags: list[Fragment]) -> dict[str, list[str]]:
    """The nodes the splices of `frags` re-emit in every layer they serve, each with its splice's regions: a fragment
    is cut at its representative layer, and its splice runs that code in each layer whose module its pattern matches
    (of its group, `layers`); a function splice only the nodes of its own frames (the caller's forward is not
    replaced)."""
    out: dict[str, list[str]] = {}
    for f in frags:
        out.update({n.name: f.regions for n in f.nodes})
        rx = module_regex(f.module)
        frames = {n.source.function for n in f.nodes if n.source is not None}
        for n in graph.nodes:
            if n.op != "call_function" or not rx.fullmatch(n.module or ""):
                continue
            if f.layers and layer_of(n.module) not in f.layers:
                continue
            if f.target == "function" and (n.source is None or n.source.function == "forward"
                                           or n.source.function not in frames):
                continue
            out[n.name] = f.regions
    return out


class _Reach:
    """What the consumers of a fragment's output are (decide_outputs): re-emitted code, matmuls, a carried
    module's residual add, or the attention ops of `attention` (op node -> region)."""

    def __init__(self, graph: Graph, frags: list[Fragment], attention: dict[str, str]) -> None:
        self.nodes, self.users, self.attention = graph.node_map(), graph.users(), attention
        self.patched = served_nodes(graph, [f for f in frags if not f.problems and f.target != "carry"])
        self.carries = [(module_regex(f.module), f.regions) for f in frags if not f.problems and f.target == "carry"]

    def matmul(self, u: str) -> bool:
        return op_name(self.nodes[u].target) in MATMULS

    def through_views(self, name: str) -> list[str]:
        out = []
        for u in self.users.get(name, []):
            if op_name(self.nodes[u].target) in ("view", "_unsafe_view", "reshape", "transpose", "t", "permute") \
                    and u not in self.patched:
                out += self.through_views(u)
            else:
                out.append(u)
        return out

    def carried_add(self, u: str) -> list[str] | None:
        """The carry regions of the module whose own residual add `u` is: with them aligned it sums in FP32 (the
        residual carried in FP32, type promotion), as the engine's fused add reads a norm's unrounded output."""
        if not is_add(self.nodes[u]):
            return None
        return next((regions for rx, regions in self.carries if rx.match(self.nodes[u].module or "")), None)

    def reached_attention(self, name: str) -> list[str] | None:
        """The attention regions the unpatched code fed by `name` reaches, if it reaches only them and matmuls and
        computes on the way (through data movement alone, rounding at the boundary is the attention op's rounding)."""
        def readers(u: str) -> list[str]:  # re-emitted code reads FP32, rounds as the engine: the walk stops there
            return [w for w in self.users.get(u, []) if not self.matmul(w) and w not in self.patched]

        regions: set[str] = set()
        computes = False
        for w in walk([name], readers, through=lambda w: w not in self.attention):
            if w in self.attention:
                regions.add(self.attention[w])
            elif is_boundary(self.nodes[w]) or self.nodes[w].op != "call_function":
                return None
            else:
                computes = computes or op_name(self.nodes[w].target) not in EXACT | CASTS
        return sorted(regions) if computes else None


def region_slug(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z]+", "_", name.replace("*", "N")).strip("_")
