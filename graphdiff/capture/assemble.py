"""A captured compilation -> the data model's Graph: nodes, kernel calls in order, what each fuses and stores.

Shared by the in-process capture (the engine, or torch.compile of any module) and the dump import: both read
the same wrapper source (output_code.py) for kernel calls and buffers, and take the kernel -> FX-node mapping
from the scheduler (in-process) or from the provenance JSON Inductor writes (dump).
"""

from __future__ import annotations

from collections.abc import Callable

from graphdiff.capture.inductor_code import KernelCall, kernel_args, parse_kernel_calls, parse_kernel_defs
from graphdiff.capture.inductor_hooks import Compiled
from graphdiff.errors import GraphdiffError
from graphdiff.records import BufferArg, Graph, Kernel


def _extern_nodes(call: KernelCall, comp: Compiled, targets: dict[str, str]) -> list[str]:
    """The FX node an extern call computes: Inductor's origin_node, unless that node runs another op while one of
    the call's origins runs this one. (Inductor moves a buffer's origin_node to the last node returning that buffer:
    the out= buffer of `extern_kernels.mm` reduced in place by `_c10d_functional.all_reduce_` gets the all-reduce's
    `wait_tensor` node, where torch.distributed does vLLM CPU's tensor-parallel all-reduce (`_C_AVX2`).)"""
    op = call.name.removeprefix("torch.ops.").removeprefix("extern_kernels.")

    def runs_op(n: str) -> bool:
        return targets.get(n, "").startswith(op) or targets.get(n, "").split(".")[1:2] == [op]

    own = [n for n in comp.origins.get(call.id, []) if runs_op(n)]
    exact = comp.origin_node.get(call.id)
    if exact is not None and (runs_op(exact) or not own):
        return [exact]
    return own


def build_graph(comp: Compiled, names: dict[str, str], root: str, index: int) -> Graph:
    from graphdiff.capture.fx import node_from_fx

    assert comp.gm is not None
    post = [n.name for n in comp.gm.graph.find_nodes(op="placeholder")]
    if len(post) != len(comp.placeholders):
        raise GraphdiffError(
            f"engine graph {index}: {len(post)} post-grad inputs vs {len(comp.placeholders)} compiled inputs; "
            "cannot map parameters (unsupported torch version?)"
        )
    post_names = {p: names.get(d, d) for p, d in zip(post, comp.placeholders)}
    nodes = []
    for fx_node in comp.gm.graph.nodes:
        node = node_from_fx(fx_node, post_names)
        if node.module is not None:  # Dynamo paths are relative to the compiled submodule
            node.module = (root + node.module).rstrip(".")
        nodes.append(node)
    _, src = comp.wrapper()
    return assemble_graph(f"engine_graph_{index}", nodes, src, comp.origins, comp.origin_node, comp.stores,
                          post_names)


def assemble_graph(name: str, nodes: list, src: str, origins: dict[str, list[str]], origin_node: dict[str, str],
                   stores: dict[str, str], inputs: dict[str, str]) -> Graph:
    """Nodes + wrapper source + kernel->FX-node mapping -> Graph (shared with the dump import)."""
    defs = parse_kernel_defs(src)
    calls = parse_kernel_calls(src, defs)
    targets = {n.name: n.target for n in nodes}
    comp = Compiled(placeholders=[], origins=origins, origin_node=origin_node)
    extern_owned: set[str] = set()
    kernels: list[Kernel] = []
    for call in calls:
        if call.extern:
            fused = _extern_nodes(call, comp, targets)
            extern_owned.update(fused)
            # Positional, like the extern FX node's own arguments ("" where no buffer is passed).
            args = [BufferArg(name=a or "", role="inout" if a else "scalar") for a in call.args]
            if call.result:
                args.append(BufferArg(name=call.result, role="out"))
            if out := call.kwargs.get("out"):  # `extern_kernels.addmm(..., out=buf23)`: the node's value is there
                args.append(BufferArg(name=out, role="out"))
            kernels.append(Kernel(id=call.id, name=call.name, kind="extern", nodes=fused, args=args))
        else:
            kdef = defs[call.name]
            args = kernel_args(call, kdef)
            for a in args:
                if a.role in ("out", "inout"):
                    a.node = stores.get(a.name)
            kernels.append(Kernel(id=call.id, name=call.name, kind="generated", nodes=[], args=args,
                                  code=kdef.code))
    for k in kernels:
        if k.kind == "generated":
            k.nodes = [n for n in origins.get(k.id, []) if n not in extern_owned and n in targets]
    computable(kernels, nodes)
    owner: dict[str, str] = {}
    for k in kernels:
        for n in k.nodes:
            owner.setdefault(n, k.id)
    for node in nodes:
        node.kernel = owner.get(node.name)
    return Graph(name=name, nodes=nodes, kernels=kernels, inputs=inputs)


def computable(kernels: list[Kernel], nodes: list) -> None:
    """Each generated kernel's nodes trimmed to what it can compute: a node that reads, directly or through views
    and other kernel-less nodes, a value only a later kernel call computes is not this kernel's. (Inductor lists
    the FX nodes lowered with a buffer as its origins: the copy of a causal mask it makes for one attention call
    (`torch.compile` of an HF model) carries that call's query chain, norm and RoPE of the next layer, into the kernel
    computing the first layer's mask and the second's in one loop.) Nor is a node that reads a graph input the kernel
    is not passed (the next layer's norm epsilon). Kernels in call order."""
    by_name = {n.name: n for n in nodes}
    claimed = {n for k in kernels for n in k.nodes}
    order = {n.name: i for i, n in enumerate(nodes)}
    done: set[str] = set()
    for k in kernels:
        if k.kind == "generated":
            kept: set[str] = set()
            ready = _readiness(by_name, claimed, done, kept, {a.name for a in k.args})
            for n in sorted(k.nodes, key=lambda x: order[x]):  # graph order: what a node reads is decided before it
                if all(i in kept or ready(i) for i in by_name[n].inputs):
                    kept.add(n)
            k.nodes = [n for n in k.nodes if n in kept]
        done.update(k.nodes)


def _readiness(by_name: dict, claimed: set[str], done: set[str], kept: set[str],
               args: set[str]) -> Callable[[str], bool]:
    """Whether a kernel can read a value: computed by an earlier kernel call or by itself (`kept`), a graph input it
    is passed (a size always), or a node no kernel computes whose own inputs it can read (views, getitems)."""
    memo: dict[str, bool] = {}

    def ready(name: str) -> bool:
        if name in done or name in kept:
            return True
        node = by_name.get(name)
        if name in claimed or node is None:
            return False
        if node.op == "placeholder":
            return node.sym is not None or name in args
        if name not in memo:
            memo[name] = all(ready(i) for i in node.inputs)
        return memo[name]

    return ready
