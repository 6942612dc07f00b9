"""Regions: the plan's sites grouped by the HF module that computes them and their kind.

A region is `module pattern#kind`; the pattern puts `*` for the layer index, so a region identical across layers
is one region with the layer list (and the layers whose sites differ from the first layer's).
"""

from __future__ import annotations

import re
from collections import defaultdict

from graphdiff.ops import op_name
from graphdiff.records import REGION_KINDS, Region, RegionKind, Site

# Regions whose engine side is one opaque op: the patch calls a function that computes as the registry says the op
# does, instead of re-emitting the trainer's fragment (attention, MoE routing and experts).
OPAQUE_KINDS = ("attention", "router", "expert_combine", "allreduce")


def module_pattern(module: str | None) -> str:
    """The module path with its layer index as `*` (`model.layers.3.mlp` -> `model.layers.*.mlp`)."""
    return re.sub(r"\.(layers|h|blocks|layer)\.\d+(?=\.|$)", r".\1.*", module or "<root>")


def _signature(sites: list[Site]) -> list[tuple]:
    """What a layer's sites in one region do: compared across layers to find layers that run another plan."""
    return sorted((op_name(s.train.op), s.rounded_on, s.matched) for s in sites)


def _region(name: str, pattern: str, kind: RegionKind, reason: str, members: list[Site]) -> Region:
    """One region of `members` (their `region` set to `name`), with its layers and the layers that differ."""
    by_layer: dict[int | None, list[Site]] = defaultdict(list)
    for s in members:
        by_layer[s.layer].append(s)
        s.region = name
    layers = sorted(by_layer, key=lambda x: -1 if x is None else x)
    first = _signature(by_layer[layers[0]])
    differing = [ly for ly in layers[1:] if ly is not None and _signature(by_layer[ly]) != first]
    kernels = sorted({(s.engine.kernel if s.engine and s.engine.kernel else "").split(":")[0]
                      for s in members} - {""})
    return Region(name=name, kind=kind, kind_reason=reason, module=pattern, layers=layers,
                  sites=[s.id for s in members], rounded_on=sorted({s.rounded_on for s in members}),
                  kernels=kernels, differing_layers=differing)


def group_regions(sites: list[Site], kinds: dict[str, tuple[RegionKind, str]],
                  owner: dict[str, str] | None = None) -> list[Region]:
    """Sites grouped by (module pattern, kind): region `pattern#kind`; `kinds` maps site id -> (kind, reason);
    `owner` a site id -> the module it belongs to where that is not its own (a submodule of MoE experts)."""
    groups: dict[tuple[str, RegionKind], list[Site]] = defaultdict(list)
    for s in sites:
        s.kind = kinds[s.id][0]
        groups[(module_pattern((owner or {}).get(s.id, s.train.module)), s.kind)].append(s)
    regions = [_region(f"{pattern}#{kind}", pattern, kind, kinds[members[0].id][1], members)
               for (pattern, kind), members in groups.items()]
    order = {k: i for i, k in enumerate(REGION_KINDS)}  # the order reports list regions in
    regions.sort(key=lambda r: (order.get(r.kind, len(order)), r.name))
    return regions
