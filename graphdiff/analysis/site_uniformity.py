"""Rounding non-uniformity at the scan's sites, and at ordinary outputs for contrast.

For a site the trainer rounds, the FP32 values it rounds are its op re-run in FP32 on the same
stored inputs; for a site the engine rounds, the engine's FP32 value of that node. The statistic
(measure.uniformity) is computed per layer over a region's sites and summarized as the median
over layers, as in the paper. Contrast groups, from the same trainer graph: projections (matmul
outputs), attention outputs, normalization outputs (the op that produces a norm module's result).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch

from graphdiff.analysis.rounding import rerun_fp32
from graphdiff.analysis.uniformity import median_over_layers, nonuniformity
from graphdiff.ops import MATMULS, op_name
from graphdiff.records import Graph, Site, layer_of


def _fp32_values(fx_nodes: dict[str, torch.fx.Node], values: dict[str, Any], name: str,
                 known: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
    if known and isinstance(known.get(name), torch.Tensor):
        return known[name].float()  # computed already while deciding where the trainer rounds
    node = fx_nodes.get(name)
    if node is None or node.op != "call_function":
        return None
    try:
        if node.target is operator.getitem:  # an element of a multi-output op (attention)
            parent = node.args[0]
            out = rerun_fp32(parent, values)[node.args[1]]
        else:
            out = rerun_fp32(node, values)
    except Exception:
        return None
    return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else None


def _stat(tensors: list[torch.Tensor]) -> float | None:
    if not tensors:
        return None
    try:
        return nonuniformity(torch.cat([t.reshape(-1) for t in tensors]), drop_exact=True).value
    except ValueError:
        return None


def _grouped(items: dict[int | None, list[torch.Tensor]]) -> float | None:
    per_layer = [v for v in (_stat(ts) for ts in items.values()) if v is not None]
    return round(median_over_layers(per_layer), 6) if per_layer else None


def contrast_groups(train: Graph) -> dict[str, list[str]]:
    """Ordinary rounded outputs of the trainer graph: projections, attention, norm outputs."""
    nodes = train.node_map()
    groups: dict[str, list[str]] = defaultdict(list)
    for n in train.nodes:
        if n.op != "call_function" or n.dtype not in ("bfloat16", "float16"):
            continue
        name = op_name(n.target)
        if name in MATMULS:
            groups["contrast: projections"].append(n.name)
        elif name == "getitem" and n.inputs and "scaled_dot_product" in nodes[n.inputs[0]].target \
                and n.call[0][1:] == [0]:
            groups["contrast: attention outputs"].append(n.name)
        elif (n.module_type or "").endswith("Norm") and not any(
                (nodes[u].module == n.module) for u in train.users().get(n.name, [])):
            groups["contrast: norm outputs"].append(n.name)  # the norm module's result
    return groups


def site_nonuniformity(train: Graph, gm: torch.fx.GraphModule, values: dict[str, Any], sites: list[Site],
                       engine_values: dict[str, torch.Tensor],
                       known: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Statistic per region (median over layers) and per contrast group; sets Site.nonuniformity."""
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    per_region: dict[str, dict[int | None, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for s in sites:
        if s.rounded_on == "train":
            x = _fp32_values(fx_nodes, values, s.train.node, known)
        else:
            v = engine_values.get(s.engine.node if s.engine else "")
            x = v.float() if isinstance(v, torch.Tensor) else None
        if x is None:
            continue
        stat = _stat([x])
        s.nonuniformity = round(stat, 6) if stat is not None else None
        per_region[s.region][s.layer].append(x)
    out = {region: v for region, layers in per_region.items() if (v := _grouped(layers)) is not None}
    for group, names in contrast_groups(train).items():
        layers: dict[int | None, list[torch.Tensor]] = defaultdict(list)
        for name in names:
            x = _fp32_values(fx_nodes, values, name, known)
            if x is not None:
                layers[layer_of(train.node_map()[name].module)].append(x)
        if (v := _grouped(layers)) is not None:
            out[group] = v
    return out
