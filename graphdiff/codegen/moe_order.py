"""The router and experts regions of an MoE model whose router or experts round where the engine's do, for `--exact`.

A top-k router that rounds nowhere other than the engine (Mixtral's: softmax over every expert in FP32, top-k, then
renormalized) has no site, but it computes the weights in another order than the engine (top-k of the BF16 logits,
then a softmax over those k): the same value in exact arithmetic, other last bits in FP32, so the experts' weighted
sum, and later a token's choice, differ. `--exact` runs the engine's routing computation there too, as the splice of
a region with no sites (`router_regions`), as it runs the engine's attention op where attention has no site. Experts
with no site (a build whose fused-MoE op stores as the trainer rounds) still sum in another order than the engine's
op: `--exact` runs that op there too (`experts_regions`).
"""

from __future__ import annotations

from graphdiff.analysis.regions import module_pattern
from graphdiff.records import Graph, Region, RegionKind, ScanResult, layer_of

# configs whose engine router is not the plain softmax top-k the router splice computes (grouped top-k, sigmoid
# scoring, a correction bias, DeepSeek V4's sqrtsoftplus)
OTHER_ROUTING = ("n_group", "topk_group", "scoring_func", "topk_method", "moe_router_enable_expert_bias")


def _siteless(graph: Graph, suffix: str, kind: RegionKind, reason: str, module_class: str,
              op: str = "") -> list[Region]:
    """One region with no sites per module pattern of the trainer graph whose class name ends with `module_class`
    (and that runs `op`, where given)."""
    layers_of: dict[str, list[int | None]] = {}
    for n in graph.nodes:
        if op in n.target and n.module and (n.module_type or "").endswith(module_class):
            layers_of.setdefault(module_pattern(n.module), []).append(layer_of(n.module))
    return [Region(name=f"{pattern}#{suffix}", kind=kind, kind_reason=reason, module=pattern,
                   layers=sorted(set(layers), key=lambda x: -1 if x is None else x), sites=[], rounded_on=[],
                   kernels=[])
            for pattern, layers in layers_of.items()]


def router_regions(scan: ScanResult, graph: Graph) -> list[Region]:
    """One router region per top-k router module pattern of the trainer graph (a `...Router` module whose own code
    takes the top-k) where the scan found no router site and the engine routes with a softmax top-k, or computes
    the router logits with its own FP32 GEMM op (`router_gemm`); else none."""
    if any(r.kind == "router" for r in scan.regions) or not scan.engine_experts:
        return []
    if scan.engine_experts.get("router_gemm"):
        return _siteless(graph, "router", "router", "no rounding site: the engine computes the router logits with "
                         f"its own FP32 GEMM ({scan.engine_experts['router_gemm']}), which sums in another order "
                         "than ATen's", "Router", "topk")
    if any(key in scan.config for key in OTHER_ROUTING):
        return []
    return _siteless(graph, "router", "router", "no rounding site: the router rounds where the engine does, and "
                     "computes its softmax over the top-k in another order than the engine's", "Router", "topk")


def experts_regions(scan: ScanResult, graph: Graph) -> list[Region]:
    """One experts region per fused experts module pattern of the trainer graph (a `...Experts` module) where the
    scan found no experts site but the engine runs its fused-MoE op (whose sums no rounding plan reproduces); else
    none."""
    if any(r.kind == "expert_combine" for r in scan.regions) or not scan.engine_experts:
        return []
    return _siteless(graph, "expert_combine", "expert_combine", "no rounding site: the experts round where the "
                     "engine's fused-MoE op stores, which sums its GEMMs in its own order", "Experts")
