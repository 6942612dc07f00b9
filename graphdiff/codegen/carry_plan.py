"""What a carry splice holds in FP32 and rounds, read from the scan: the module's incoming activation (held FP32, or
read as the engine's stored copy), its child modules' outputs that its own code scales, sums or hands on, and its own
residual sums the engine stores in BF16 (`Carry`, the manifest's carry fields)."""

from __future__ import annotations

import re
from itertools import takewhile

from graphdiff.codegen.fragment import Carry, is_add, within
from graphdiff.ops import ACTIVATIONS, op_name
from graphdiff.records import Graph, Node, Region, ScanResult, Side, layer_of
from graphdiff.replay.kernel_fragment import value_base
from graphdiff.runtime import module_regex


def carry_for(scan: ScanResult, graph: Graph, region: Region, path: str, sites: dict[str, Side],
              layers: list[int] | None) -> tuple[Carry, str]:
    """The carry of the module at `path` for `region`'s sites there (node -> the side that rounds it), and why its
    forward cannot be carried ("" when it can)."""
    nodes = graph.node_map()
    trained = [s for s, side in sites.items() if side == "train"]
    scaled, handed = _scaled_child_outputs(graph, path, trained), scaled_handoffs(graph, path, trained)
    problem = ("the module calls submodules and its sites are not residual adds or scaled child outputs: its forward "
               "cannot be re-emitted" if any(not is_add(nodes[s]) and s not in scaled and s not in handed
                                            for s in sites) else "")
    carry = Carry(fp32_outputs=sorted({c for children in scaled.values() for c in children}),
                  input=not sites or any(s not in handed for s in sites),
                  rounded_sums=rounded_sums(scan, graph, region.module),
                  stored_sums=stored_sums(scan, graph, region.module))
    for source, reader in handed.values():
        carry.fp32_scaled.setdefault(source, []).append(reader)
    carry.rounded, carry.fp32_children, carry.rounded_children = _carry_reads(scan, graph, region, layers)
    return carry, problem


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
        if reader and not within(source, reader) and not within(reader, source):
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
                if m and not within(d.module, m.group(0)) and (not layers or layer_of(m.group(0)) in layers):
                    copy_readers.add((nodes[r].module or "")[m.end() + 1:].split(".")[0])
            continue
        owner = nodes[own[0]].module or ""
        if within(d.module, owner):  # the layer's own sum (`stored_sums`), not its incoming activation
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
