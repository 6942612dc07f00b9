"""How non-uniformly FP32 values sit between their two neighbouring BF16 numbers, at the scan's sites and at
ordinary outputs for contrast.

Rounding to BF16 is unbiased on average only if values are spread evenly between the
representable numbers. A value's position is its place in that gap, 0..1:

    pos = (|x| - lo) / (hi - lo),  lo = |x| rounded toward zero to BF16,  hi = the next BF16 above lo

Magnitudes, because rounding is symmetric in sign: -x rounds to -(round(x)). A value that is
exactly a BF16 number has pos = 0 (lo = |x|). Round-to-nearest-even sends pos < 0.5 down and
pos > 0.5 up (in magnitude); pos = 0.5 is a tie. BF16 is FP32 with the low 16 mantissa bits
dropped, so within one binade (and across into the next: hi - lo is still one BF16 step) the
position is exactly those 16 bits / 65536 — computed from the bits, with no floating-point error.

Statistic (paper): the empirical characteristic function of the positions,
c_k = mean(exp(2πi k pos)), k = 1..16, and the RMS of |c_k|. Uniform positions give
E|c_k|² = 1/n, so the statistic of n uniform positions is about 1/sqrt(n); all positions equal
give |c_k| = 1 for every k, so 1. Positions spread evenly over m points j/m give |c_k| = 1 when
m divides k and 0 otherwise: sqrt(floor(16/m) / 16).
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from graphdiff.analysis.rounding import rerun_fp32
from graphdiff.ops import MATMULS, op_name
from graphdiff.records import Graph, Site, layer_of

KMAX = 16
_LOW_BITS = 1 << 16  # FP32 mantissa bits that BF16 drops
_CHUNK = 1 << 18


def positions(x: torch.Tensor) -> torch.Tensor:
    """Each finite FP32 value's position between its neighbouring BF16 numbers, in [0, 1) (float64)."""
    if x.dtype != torch.float32:
        raise TypeError(f"positions are defined for FP32 values, got {x.dtype}")
    x = x.detach().flatten()
    x = x[torch.isfinite(x)]
    low = x.view(torch.int32) & (_LOW_BITS - 1)  # the sign bit is not among them: magnitude for free
    return low.to(torch.float64) / _LOW_BITS


def fourier_coefficients(pos: torch.Tensor, kmax: int = KMAX) -> torch.Tensor:
    """c_k = mean(exp(2πi k pos)) for k = 1..kmax (complex128)."""
    if pos.numel() == 0:
        raise ValueError("no positions")
    k = torch.arange(1, kmax + 1, dtype=torch.float64)
    pos = pos.to(torch.float64).flatten()
    re, im = torch.zeros(kmax, dtype=torch.float64), torch.zeros(kmax, dtype=torch.float64)
    for chunk in pos.split(_CHUNK):  # bounded memory for activations with millions of values
        phase = 2 * math.pi * torch.outer(k, chunk)
        re += torch.cos(phase).sum(1)
        im += torch.sin(phase).sum(1)
    return torch.complex(re, im) / pos.numel()


def nonuniformity_of_positions(pos: torch.Tensor, kmax: int = KMAX) -> float:
    """RMS over k = 1..kmax of |c_k|: 0 for perfectly spread positions, 1 when all are equal."""
    c = fourier_coefficients(pos, kmax)
    return float(c.abs().pow(2).mean().sqrt())


@dataclass
class Uniformity:
    value: float  # the statistic
    n: int  # finite values measured
    exact_fraction: float  # values that already were BF16 numbers (pos = 0, no rounding error)
    uniform_level: float  # 1/sqrt(n): what uniform positions of this count give, the noise floor


def nonuniformity(x: torch.Tensor, kmax: int = KMAX, drop_exact: bool = False) -> Uniformity:
    """The statistic for FP32 values `x` that are about to be rounded to BF16.

    `drop_exact` leaves out values that are BF16 numbers already (they are not rounded at all;
    a tensor that was upcast from BF16 is all exact and would read as fully clustered).
    """
    pos = positions(x)
    exact = float((pos == 0).double().mean()) if pos.numel() else 0.0
    if drop_exact:
        pos = pos[pos != 0]
    if pos.numel() == 0:
        raise ValueError("no finite (non-exact) values to measure")
    return Uniformity(nonuniformity_of_positions(pos, kmax), pos.numel(), exact, 1 / math.sqrt(pos.numel()))


def histogram(pos: torch.Tensor, bins: int = 32) -> list[int]:
    """Counts of positions in `bins` equal bins over [0, 1), for plots."""
    idx = (pos.to(torch.float64) * bins).floor().clamp(0, bins - 1).long()
    return torch.bincount(idx, minlength=bins).tolist()


def median_over_layers(per_layer: Iterable[float]) -> float:
    """The paper's summary: one statistic per layer (same site), the median across layers."""
    values = list(per_layer)
    if not values:
        raise ValueError("no layers")
    return float(statistics.median(values))


# --- at the scan's sites ---------------------------------------------------------------------------------
# Rounding non-uniformity at the scan's sites, and at ordinary outputs for contrast.
#
# For a site the trainer rounds, the FP32 values it rounds are its op re-run in FP32 on the same
# stored inputs; for a site the engine rounds, the engine's FP32 value of that node. The statistic
# (`nonuniformity` above) is computed per layer over a region's sites and summarized as the median
# over layers, as in the paper. Contrast groups, from the same trainer graph: projections (matmul
# outputs), attention outputs, normalization outputs (the op that produces a norm module's result).


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
            if not isinstance(parent, torch.fx.Node):
                return None
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
    out = {region: g for region, layers in per_region.items() if (g := _grouped(layers)) is not None}
    for group, names in contrast_groups(train).items():
        layers: dict[int | None, list[torch.Tensor]] = defaultdict(list)
        for name in names:
            x = _fp32_values(fx_nodes, values, name, known)
            if x is not None:
                layers[layer_of(train.node_map()[name].module)].append(x)
        if (g := _grouped(layers)) is not None:
            out[group] = g
    return out
