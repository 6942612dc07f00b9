"""Ops a C++ Inductor kernel computes in another form than ATen's eager kernel, rewritten in a fragment before it
is replayed.

`var_mean` over a small static row (LayerNorm): Inductor lowers it to two passes, the mean first and then the sum
of squared deviations from it (`lowering.var_mean_sum_`, chosen by `use_two_step_variance` below
`config.cpp.use_two_step_variance_threshold`; a kernel that does not shows `welford` in its code). As one ATen
node the replay can neither compute it that way nor say that the second pass reads a value re-loaded from its
rounded store while the first read the FP32 register (Nemotron's residual + LayerNorm kernel: 97.8% replayed as
one node). Written as the two passes, the re-loaded-store rule (graphdiff.replay.reload) applies to the second.
"""

from __future__ import annotations

from graphdiff.ops import op_name
from graphdiff.records import Node

SUFFIX = "__form"  # names of the nodes a rewrite adds (not values of the captured graph)


def _node(name: str, target: str, args: list, inputs: list[str], like: Node, shape: list | None) -> Node:
    return Node(name=name + SUFFIX, op="call_function", target=target, inputs=inputs, call=[args, {}],
                dtype=like.dtype, shape=shape, module=like.module)


def two_step_variance(frag: list[Node], nodes: dict[str, Node]) -> list[Node]:
    """Every `var_mean` over static sizes as Inductor's two passes; its getitems read the new mean and variance."""
    out: list[Node] = []
    swapped: dict[str, tuple[str, str, bool, list[int]]] = {}  # var_mean node -> (var, mean, keepdim, dims)
    for n in frag:
        if op_name(n.target) == "var_mean" and n.target.endswith("correction") and n.inputs:
            x = nodes.get(n.inputs[0]) or next((m for m in frag if m.name == n.inputs[0]), None)
            args, kwargs = n.call[0], n.call[1]
            dims: list[int] | None = args[1] if len(args) > 1 and isinstance(args[1], list) else None
            xshape = x.shape if x is not None else None
            sizes = [xshape[d] for d in dims] if xshape and dims else []
            static = [s for s in sizes if isinstance(s, int)]
            if x is None or not xshape or not dims or not sizes or len(static) != len(sizes):
                out.append(n)
                continue
            count = 1
            for s in static:
                count *= s
            keep = bool(kwargs.get("keepdim", False))
            shape = [1 if i in [d % len(xshape) for d in dims] else s for i, s in enumerate(xshape)]
            reduced = shape if keep else [s for i, s in enumerate(xshape) if i not in [d % len(xshape) for d in dims]]
            xin, m, f32 = {"node": x.name}, f"{n.name}_mean", x
            out += [
                _node(m, "aten.mean.dim", [xin, dims, True], [x.name], f32, shape),
                _node(f"{n.name}_diff", "aten.sub.Tensor", [xin, {"node": m + SUFFIX}], [x.name, m + SUFFIX], f32,
                      list(xshape)),
                _node(f"{n.name}_sq", "aten.mul.Tensor", [{"node": f"{n.name}_diff{SUFFIX}"}] * 2,
                      [f"{n.name}_diff{SUFFIX}"] * 2, f32, list(xshape)),
                _node(f"{n.name}_sum", "aten.sum.dim_IntList", [{"node": f"{n.name}_sq{SUFFIX}"}, dims, keep],
                      [f"{n.name}_sq{SUFFIX}"], f32, reduced),
                _node(f"{n.name}_var", "aten.div.Tensor",
                      [{"node": f"{n.name}_sum{SUFFIX}"}, float(max(count - int(kwargs.get("correction", 1)), 0))],
                      [f"{n.name}_sum{SUFFIX}"], f32, reduced),
            ]
            swapped[n.name] = (f"{n.name}_var{SUFFIX}", m + SUFFIX, keep, dims)
            continue
        if op_name(n.target) == "getitem" and n.inputs and n.inputs[0] in swapped:
            var, mean, keep, dims = swapped[n.inputs[0]]
            src = var if n.call[0][1] == 0 else mean
            target, args = ("aten.alias.default", [{"node": src}]) if src == var or keep else \
                ("aten.squeeze.dims", [{"node": src}, dims])
            out.append(n.model_copy(update=dict(target=target, inputs=[src], call=[args, {}])))
            continue
        out.append(n)
    return out
