"""Mixture-of-experts: the engine's routing and expert combine, the trainer's, and what the patch runs instead.

vLLM CPU (compiled) routes with the top-k of the BF16 router logits and a softmax over those k in FP32 (or, not
renormalized, their share of all), and keeps the routing weights FP32 (Inductor drops the softmax's BF16 round
trip); its fused-MoE op (`_C.cpu_fused_moe`) keeps the gate/up GEMM and SiLU in FP32, rounds silu(gate) * up to
BF16 once, keeps the down GEMM and the weighted sum over the k experts in FP32 and rounds the output once.
transformers' experts round every GEMM, the activation, each weighted expert output and each partial sum. That
engine computation is analysis.moe_engine, the functions a router or experts splice runs (the generated patch
carries their source); the scan runs it here for its numeric check of the trainer's experts.

Routing agreement: per layer, the fraction of tokens whose set of chosen experts differs between the engine
(the top-k indices its router kernel reads) and the trainer (its router's top-k), on the same tokens.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch

from graphdiff.analysis.moe_engine import moe_experts_like_engine
from graphdiff.analysis.regions import module_pattern
from graphdiff.analysis.rounding import is_view
from graphdiff.ops import CASTS, EXACT, is_heavy, is_low, op_name
from graphdiff.records import Decision, Evidence, Graph, Node, RoutingAgreement, SideState, layer_of, walk
from graphdiff.replay.sum_order import cpp_sum_lanes
from graphdiff.runtime import module_regex

_ACTS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu, "relu": torch.relu}


class _Experts(torch.nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: Any) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up, down, act


def engine_experts_op(graphs: list[Graph]) -> dict[str, str]:
    """How the engine ran its experts, from its first fused-MoE call (`_C.cpu_fused_moe`): the op, its activation
    and ISA, the intermediate size its packed gate/up weight is padded to, the lanes its router kernel sums a
    logsumexp's exps in (a router that does not renormalize its top-k: OLMoE, Qwen2-MoE) and, `router_exp`
    "scalar", where that kernel computes the weights' exp unvectorized (`router_logsumexp`: the logsumexp too, in
    one unrolled loop, `router_logsumexp_form`), the engine's own GEMM op where it computes
    the router logits from an FP32 input (`router_gemm`: vLLM's FP32 gate on oneDNN, whose sums run in another order
    than ATen's), and the constant it scales the op's output by (`output_scale`: vLLM applies a routed scaling factor
    to the experts' sum, where transformers scales the routing weights), `router_topk` "unsorted" where its router
    takes the top-k unsorted, `one_output_gemm` where it runs a one-output linear (a shared expert's gate) as its
    own GEMM op, and `addmm_combine` where it adds the op's (scaled) output to a GEMM inside ATen's addmm (a shared
    expert's down projection); {} where no such call was captured."""
    for graph in graphs:
        nodes = graph.node_map()
        for n in graph.nodes:
            if n.target != "_C.cpu_fused_moe.default" or len(n.call[0]) < 11:
                continue
            args = n.call[0]
            w13 = nodes.get(args[2]["node"]) if isinstance(args[2], dict) else None
            if w13 is None or not w13.shape or not isinstance(w13.shape[1], int):
                continue
            router = next((k for k in graph.kernels if k.kind == "generated" and "logsumexp" in k.id), None)
            lanes = cpp_sum_lanes(router.code or "") if router is not None else 0
            found = {"op": "_C.cpu_fused_moe", "activation": str(args[9]), "isa": str(args[10]),
                     "padded_intermediate": str(w13.shape[1] // 2), "router_lanes": str(lanes)}
            weights = args[6]["node"] if isinstance(args[6], dict) else None
            gemm = _router_gemm(graph, weights) if weights else None
            if gemm is not None:
                found["router_gemm"] = gemm.target.removesuffix(".default")
            if any(_one_output(graph, g) for g in graph.nodes if g.target in ENGINE_GEMMS):
                found["one_output_gemm"] = "_C.onednn_mm"
            if weights and _router_topk_unsorted(graph, weights):
                found["router_topk"] = "unsorted"
            scale = _output_scale(graph, n)
            if scale is not None:
                found["output_scale"] = repr(scale)
            if _addmm_combine(graph, n):
                found["addmm_combine"] = "extern_kernels.addmm"
            if router is not None and router_exp_scalar(router.code or ""):
                found["router_exp"] = "scalar"
            if router is not None and (form := router_logsumexp_form(router.code or "")):
                found["router_logsumexp"] = form
            return found
    return {}


def _output_scale(graph: Graph, op: Node) -> float | None:
    """The constant the fused-MoE op's output (its first argument, written in place) is multiplied by, where the
    engine scales it before anything else reads it; None where it is read unscaled."""
    if not op.inputs:
        return None
    nodes, out = graph.node_map(), op.inputs[0]
    readers = [nodes[u] for u in graph.users().get(out, []) if u != op.name]
    if len(readers) != 1 or op_name(readers[0].target) != "mul" or readers[0].inputs != [out]:
        return None
    args = readers[0].call[0] if readers[0].call else []
    consts = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return float(consts[0]) if len(consts) == 1 else None


def _addmm_combine(graph: Graph, op: Node) -> bool:
    """Is the fused-MoE op's output (its first argument), or its scaled copy, the bias an ATen addmm adds its GEMM
    to (Inductor's `add(mm(a, b), c) -> addmm(c, a, b)` where the engine's GEMM is ATen's)?"""
    if not op.inputs:
        return False
    nodes, users = graph.node_map(), graph.users()
    out = op.inputs[0]
    read = [out] + [u for u in users.get(out, []) if u != op.name and op_name(nodes[u].target) == "mul"]
    return any(op_name(nodes[u].target) == "addmm" and nodes[u].inputs[:1] == [r]
               for r in read for u in users.get(r, []))


def addmm_folds(graphs: list[Graph]) -> dict[str, list[str]]:
    """Where the engine adds a bias-free linear's GEMM to another value inside one ATen addmm (Inductor's post-grad
    `add(mm(a, b), c) -> addmm(c, a, b)`, taken where the engine's GEMMs are ATen's: vLLM CPU's `_C_AVX2` build):
    the module pattern the addmm is tagged with (whose forward adds) -> the module patterns of the linears it folds
    ([] where the weight is read through a handle whose module is not named). An addmm whose bias is a parameter (a
    linear's own bias) is none; nor is one adding the fused-MoE op's output (`engine_experts.addmm_combine`)."""
    folds: dict[str, list[str]] = {}
    for graph in graphs:
        nodes, params = graph.node_map(), graph.inputs
        moe_out = {n.inputs[0] for n in graph.nodes if n.target == "_C.cpu_fused_moe.default" and n.inputs}
        for n in graph.nodes:
            if op_name(n.target) != "addmm" or len(n.inputs) < 3 or not n.module:
                continue
            bias = nodes.get(n.inputs[0])
            if bias is None or bias.name in params or len(bias.shape or []) < 2 or bias.name in moe_out \
                    or any(i in moe_out for i in bias.inputs):
                continue
            linears = folds.setdefault(module_pattern(n.module), [])
            linear = _linear_of(graph, n.inputs[2], params)
            if linear and linear not in linears:
                linears.append(linear)
    return folds


def addmm_biases(graphs: list[Graph]) -> dict[str, str]:
    """For a fold whose added value is another linear's GEMM output (vLLM's parallel block: `attn + mlp` as one addmm
    of the MLP's down projection with the attention's output projection as its bias): the folded linear's pattern ->
    that linear's pattern. HF sums `residual + attn + mlp` left to right; the patch sums `attn + mlp` first there."""
    found: dict[str, str] = {}
    for graph in graphs:
        nodes, params = graph.node_map(), graph.inputs
        for n in graph.nodes:
            bias = nodes.get(n.inputs[0]) if op_name(n.target) == "addmm" and len(n.inputs) >= 3 else None
            if bias is None or op_name(bias.target) != "mm" or len(bias.inputs) < 2:
                continue
            folded, added = (_linear_of(graph, i, params) for i in (n.inputs[2], bias.inputs[1]))
            if folded and added:
                found[folded] = added
    return found


def _linear_of(graph: Graph, weight_input: str, params: dict[str, str]) -> str:
    """The module pattern of the named linear whose weight a GEMM reads (through views), or ""."""
    weight = _walk_back(graph, weight_input, functools.partial(_is_input, params))
    name = params.get(weight.name, "") if weight is not None else ""
    return module_pattern(name.removesuffix(".weight")) if name.endswith(".weight") and "#" not in name else ""


def trainer_folds(folds: dict[str, list[str]], graph: Graph) -> dict[str, list[str]]:
    """`addmm_folds` keyed by the trainer module whose forward adds each linear's output: vLLM's fused add-norm
    adds the residual in the norm after it (the addmm tagged `post_attention_layernorm`, the next layer's
    `input_layernorm`, `model.norm`), HF in the decoder layer. A linear inside its key's module keeps that key."""
    out: dict[str, list[str]] = {}
    for key, linears in folds.items():
        for linear in linears or [""]:
            module = key if not linear or linear.startswith(key + ".") else _adding_module(graph, linear) or key
            kept = out.setdefault(module, [])
            if linear and linear not in kept:
                kept.append(linear)
    return out


def _adding_module(graph: Graph, linear: str) -> str:
    """The module pattern of the trainer's add reading the output of a linear of pattern `linear` (through views), or
    "" where none does."""
    nodes, users = graph.node_map(), graph.users()
    inside = module_regex(linear)
    for n in graph.nodes:
        if not (n.module and inside.match(n.module)) or all(inside.match(nodes[u].module or "") for u in
                                                               users.get(n.name, [])):
            continue
        for u in walk([n.name], lambda m: users.get(m, []), through=lambda m: is_view(nodes[m])):
            if not is_view(nodes[u]):
                return module_pattern(nodes[u].module or "") if op_name(nodes[u].target) == "add" else ""
    return ""


def _is_input(inputs: dict[str, str], node: Node) -> bool:
    return node.name in inputs


ENGINE_GEMMS = frozenset({"_C.onednn_mm.default"})  # the engine's own GEMM ops, writing into their first argument


def _router_gemm(graph: Graph, weights: str) -> Node | None:
    """The engine's own GEMM op computing the router logits that the routing `weights` derive from, where it reads
    an FP32 activation (the first GEMM met walking back from the weights); None where the logits come from ATen's
    GEMM or a BF16 input."""
    nodes, users = graph.node_map(), graph.users()

    def writer(name: str) -> Node | None:
        return next((nodes[u] for u in users.get(name, []) if nodes[u].target in ENGINE_GEMMS
                     and nodes[u].inputs[:1] == [name]), None)

    gemm = _walk_back(graph, weights, lambda n: writer(n.name) is not None)
    found = writer(gemm.name) if gemm is not None else None
    x = nodes.get(found.inputs[1]) if found is not None and len(found.inputs) > 1 else None
    return found if x is not None and x.dtype == "float32" else None


def _one_output(graph: Graph, gemm: Node) -> bool:
    """Does the engine's GEMM op `gemm` write one output column per token (a shared expert's gate)?"""
    out = graph.node_map().get(gemm.inputs[0]) if gemm.inputs else None
    return out is not None and out.shape is not None and len(out.shape) > 0 and out.shape[-1] == 1


def _router_topk_unsorted(graph: Graph, weights: str) -> bool:
    """Does the engine take the router's top-k unsorted (`torch.topk(..., sorted=False)`, vLLM CPU's router): the
    experts then come in the order the CPU's top-k leaves them, which decides the order the weights and the experts'
    outputs are summed in."""
    topk = _walk_back(graph, weights, lambda n: op_name(n.target) == "topk")
    args = topk.call[0] if topk is not None and topk.call else []
    return len(args) > 4 and args[4] is False


def _walk_back(graph: Graph, start: str, match: Callable[[Node], bool]) -> Node | None:
    """The first node, walking back from `start` breadth first over inputs, that `match`es; None where a matmul
    or the graph's inputs come first."""
    nodes = graph.node_map()
    if start not in nodes:
        return None
    back = walk([start], lambda name: [i for i in nodes[name].inputs if i in nodes],
                through=lambda name: not is_heavy(nodes[name].target))
    for name in itertools.chain([start], back):
        if match(nodes[name]):
            return nodes[name]
        if is_heavy(nodes[name].target):
            return None
    return None


def router_exp_scalar(code: str) -> bool:
    """Does a router kernel (C++) compute its last exp, the routing weights', in a loop Inductor did not vectorize
    (`std::exp(tmp)`, the C library's; a two-wide top-k row) rather than with `.exp()` on a vector (SLEEF's)? The
    two differ in the last bit on about 9% of weights."""
    scalar, vector = code.rfind("std::exp("), code.rfind(".exp()")
    return scalar > vector


def router_logsumexp_form(code: str) -> str:
    """How a router kernel (C++) computes its logsumexp where Inductor unrolled it into one loop it did not vectorize
    (a small row): `std::exp` of each logit less the max, summed left to right, `std::log`, the max added; then
    "scalar" where the kernel stores that sum in BF16 for the weights' loop (top-2 of 6), "scalar-fp32" where it
    keeps it in a register (top-1: the weight in the same loop). "" for the vectorized form (lanes, a BF16 store)."""
    at = code.find("std::log(")
    if at < 0 or ".log()" in code:
        return ""
    return "scalar" if "convert<at::BFloat16>" in code[at:] else "scalar-fp32"


def experts_modules(graph: Graph) -> dict[str, dict[str, str]]:
    """Experts modules of the trainer graph, found by their stacked weights: path -> {"gate_up_proj": node,
    "down_proj": node} (transformers' MoE experts hold [E, 2I, H] and [E, H, I] parameters)."""
    out: dict[str, dict[str, str]] = {}
    for node, name in graph.inputs.items():
        path, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj"):
            out.setdefault(path, {})[leaf] = node
    return {p: v for p, v in out.items() if len(v) == 2}


def _module_io(graph: Graph, path: str) -> tuple[list[str], str | None]:
    """A module's activation inputs (first-use order) and its output node."""
    nodes = graph.node_map()
    inside = [n for n in graph.nodes if n.op == "call_function" and (n.module or "").startswith(path)]
    names = {n.name for n in inside}
    ins = list(dict.fromkeys(i for n in inside for i in n.inputs if i not in names and nodes[i].param is None))
    users = graph.users()
    outs = [n.name for n in inside if any(u not in names for u in users.get(n.name, []))]
    return ins, (outs[-1] if outs else None)


def experts_nodes(graph: Graph) -> set[str]:
    """Every computing node inside the trainer's experts modules."""
    paths = tuple(p + "." for p in experts_modules(graph))
    return {n.name for n in graph.nodes if n.op == "call_function" and paths and ((n.module or "") + ".").startswith(
        paths)}


def _down_gemm_inputs(graph: Graph, inside: list[Node], down_proj: str) -> set[str]:
    """The computed values the down-projection GEMMs read (back through views and casts): the one value inside the
    fused op the engine stores in BF16."""
    nodes = graph.node_map()
    from_weight: set[str] = {down_proj}
    for n in inside:  # views, selections and casts of the down_proj weight
        if any(i in from_weight for i in n.inputs) and (is_view(n) or op_name(n.target) in EXACT | CASTS):
            from_weight.add(n.name)
    return {x for n in inside if is_heavy(n.target) and any(i in from_weight for i in n.inputs)
            for x in _computed_operands(nodes, n, from_weight)}


def _computed_operands(nodes: dict[str, Node], gemm: Node, weight: set[str]) -> set[str]:
    """The computed values a GEMM reads besides its weight, back through views, exact ops and casts to FP32."""
    def carries(x: str) -> bool:
        n = nodes[x]
        return is_view(n) or op_name(n.target) in EXACT or (op_name(n.target) in CASTS and not is_low(n.dtype))

    back = walk([gemm.name], lambda x: [i for i in nodes[x].inputs if x != gemm.name or i not in weight],
                through=carries)
    return {x for x in back if not carries(x)}


def experts_decisions(graph: Graph, values: dict[str, Any], changed: dict[str, float],
                      extern_calls: list[tuple[str, str]], ids: dict[str, str]) -> list[Decision]:
    """Inside each experts module, where the engine runs one fused-MoE op the registry describes: every value the
    trainer rounds is FP32 in the engine but the activation product (silu(gate) * up, rounded on both sides) and
    the module's output (rounded once on both). The evidence: the trainer's output against the engine's
    computation (moe_experts_like_engine) on the trainer's own inputs."""
    out: list[Decision] = []
    modules = sorted(experts_modules(graph).items(), key=lambda kv: layer_of(kv[0]) or 0)
    for i, (path, params) in enumerate(modules):
        ins, output = _module_io(graph, path)
        inside = [n for n in graph.nodes if n.op == "call_function" and ((n.module or "") + ".").startswith(path + ".")]
        acts = [n for n in inside if op_name(n.target) in _ACTS]
        vals = [values.get(x) for x in ins]
        hidden = next((v for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 2
                       and v.shape[-1] == values[params["gate_up_proj"]].shape[-1]), None)
        index = next((v for v in vals if isinstance(v, torch.Tensor) and not v.is_floating_point()), None)
        weights = next((v for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point() and index is not None
                        and v.shape == index.shape), None)
        trained = values.get(output) if output else None
        if hidden is None or index is None or weights is None or not acts or not isinstance(trained, torch.Tensor):
            continue
        module = _Experts(values[params["gate_up_proj"]], values[params["down_proj"]],
                          _ACTS[op_name(acts[0].target)])
        with torch.no_grad():
            like = moe_experts_like_engine(module, hidden, index, weights)
        differs = float((like.reshape(-1) != trained.reshape(-1).to(like.dtype)).float().mean())
        graph_name, kernel = extern_calls[i] if len(extern_calls) == len(modules) else ("", "")
        registry = (f"_C.cpu_fused_moe: FP32 inside but the activation product, output rounded once; the trainer's "
                    f"experts output differs from that computation on {differs:.0%} (tests/test_opaque_ops_engine.py)")
        product = _down_gemm_inputs(graph, inside, params["down_proj"])
        for n in inside:
            v = values.get(n.name)
            if not isinstance(v, torch.Tensor) or not v.is_floating_point() or is_view(n) or \
                    op_name(n.target) in EXACT:
                continue
            stored = n.name in product or n.name == output  # rounded on both sides: the engine stores these
            t_rounds = is_low(n.dtype) and changed.get(n.name, 0.0) > 0
            out.append(Decision(
                id=ids[n.name], node=n.name, op=n.target, module=n.module, layer=layer_of(n.module),
                train=SideState(dtype=n.dtype, rounds=is_low(n.dtype), on_grid=t_rounds, changed=changed.get(n.name),
                                how=f"rounded to {n.dtype} (changes {changed.get(n.name, 0):.0%} of elements)"
                                if t_rounds else f"kept in {n.dtype}"),
                engine=SideState(dtype=n.dtype if stored else "float32", rounds=stored, on_grid=stored,
                                 how="stored in BF16 by the fused MoE op (registry)" if stored
                                 else "FP32 inside the fused MoE op (registry)"),
                rule="opaque-registry", site=t_rounds and not stored,
                evidence=Evidence(engine_graph=graph_name, kernel=kernel, stretch=[path], registry=registry)))
    return out


def routing_agreement(graph: Graph, values: dict[str, Any], engine_ids: dict[int, torch.Tensor],
                      shape: str) -> list[RoutingAgreement]:
    """Per layer, the fraction of tokens whose top-k expert set differs between the engine and the trainer. A
    grouped router takes two top-ks (its groups, then its experts): the trainer's last top-k of the engine's width
    is compared, one row per layer."""
    found: dict[int, torch.Tensor] = {}
    for n in graph.nodes:
        layer = layer_of(n.module)
        if op_name(n.target) != "topk" or layer is None or layer not in engine_ids:
            continue
        got = values.get(n.name)
        if isinstance(got, tuple | list) and got[1].shape[-1] == engine_ids[layer].shape[-1]:
            found[layer] = got[1].reshape(-1, got[1].shape[-1])
    out = []
    for layer, trainer in found.items():
        engine = engine_ids[layer].reshape(-1, trainer.shape[-1])
        if engine.shape != trainer.shape:
            continue
        differs = (trainer.sort(-1).values != engine.to(trainer.dtype).sort(-1).values).any(-1)
        out.append(RoutingAgreement(layer=layer, shape=shape, tokens=int(trainer.shape[0]),
                                    differing=int(differs.sum()), fraction=float(differs.double().mean())))
    return out


