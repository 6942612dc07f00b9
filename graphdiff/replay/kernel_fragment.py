"""A kernel's FX fragment: the nodes the scheduler fused into one generated kernel that the kernel computes (views a
kernel only passes on, tuple items and aliasing concatenations set apart), and the value a node stands for."""

from __future__ import annotations

from graphdiff.ops import CASTS, UNINITIALIZED, VIEWS, op_name
from graphdiff.records import Graph, Kernel, Node


def is_view(node: Node) -> bool:
    return node.op == "call_function" and op_name(node.target) in VIEWS


def value_base(nodes: dict[str, Node], name: str) -> Node | None:
    """The node computing a value, looking through casts and views (an FP32 copy of a sum is the sum)."""
    n = nodes.get(name)
    while n is not None and n.inputs and (op_name(n.target) in CASTS or is_view(n)):
        n = nodes.get(n.inputs[0])
    return n


def is_tuple_item(n: Node, nodes: dict[str, Node]) -> bool:
    """A getitem of a computed multi-output node (aten.topk, var_mean, an extern returning a tuple); items of a
    view (split, unbind) are views themselves."""
    if op_name(n.target) != "getitem" or not n.inputs:
        return False
    src = nodes[n.inputs[0]]
    return src.dtype is None and src.op == "call_function" and not is_view(src)


def _concat_of(n: Node, members: set[str]) -> bool:
    """A concatenation of this kernel's values that no kernel computes: Inductor writes its inputs in place into
    its buffer (their stores are views of it), so that buffer, recorded when the kernel starts, is stale for a later
    loop nest of the same kernel that reads it (a partial RoPE copies the rotated part into the next cat)."""
    return n.target == "aten.cat.default" and bool(n.inputs) and all(i in members for i in n.inputs)


def _idle_views(k: Kernel, members: set[str], nodes: dict[str, Node]) -> set[str]:
    """Views the kernel lists but does not compute with: views (or views of such views) of an uninitialized
    allocation made outside the kernel that nothing in the kernel reads or stores. Inductor lists the view an extern
    writes its output through (the `out` buffer of vLLM CPU's mutating `_C.weight_packed_linear`) under the kernel
    fusing the extern's neighbours; the allocation has no value, and with it the fragment could not be replayed."""
    stored = {a.node for a in k.args if a.role in ("out", "inout") and a.node}

    def root(name: str) -> Node:
        n = nodes[name]
        while is_view(n) and n.inputs:
            n = nodes[n.inputs[0]]
        return n

    candidates = {m for m in members if is_view(nodes[m]) and m not in stored
                  and root(m).name not in members and op_name(root(m).target) in UNINITIALIZED}
    idle: set[str] = set()
    while True:
        read = {i for m in members - idle for i in nodes[m].inputs}
        more = {m for m in candidates - idle if m not in read}
        if not more:
            return idle
        idle |= more


def kernel_fragment(graph: Graph, k: Kernel, owned: set[str]) -> tuple[list[Node], list[str]]:
    """Kernel nodes in graph order, pulled back through views no kernel computes, and their inputs. An item of a
    tuple computed outside the kernel (an extern's topk) is an input: the tuple has no buffer, its items do."""
    nodes = graph.node_map()
    members = {n for n in k.nodes if nodes[n].op == "call_function"}
    while True:
        ext = {i for m in members for i in nodes[m].inputs if i not in members}
        pull = {e for e in ext if (is_view(nodes[e]) or _concat_of(nodes[e], members)) and e not in owned
                and not (is_tuple_item(nodes[e], nodes) and nodes[e].inputs[0] not in members)}
        if not pull:
            break
        members |= pull
    members -= _idle_views(k, members, nodes)
    frag = [nodes[m] for m in sorted(members, key=graph.position)]
    external = list(dict.fromkeys(i for n in frag for i in n.inputs if i not in members))
    return frag, external
