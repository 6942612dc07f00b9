"""Regions for helper functions whose ops read a value through the engine's stored low-precision copy.

The engine may hold a value in FP32 for some readers and hand others the BF16 copy it stores (the plan's
`read_rounded_by`): OLMo 2's RoPE kernel computes `q * cos` from the q norm's FP32 output and `rotate_half(q)` from
the halves it stores in BF16. Once the norm's splice hands the FP32 value on, a reader that no region re-emits reads
it unrounded. A module-level helper function holding such readers (`rotate_half`) in a module that no other region
re-emits becomes a region of kind `stored_copy` with no sites, one per module pattern, whose splice is the function
with those reads rounded (`Fragment.rounded_reads`; a no-op on a BF16 input) and HF's rounding otherwise.
"""

from __future__ import annotations

import importlib

from graphdiff import sources
from graphdiff.analysis.regions import OPAQUE_KINDS, module_pattern
from graphdiff.records import Graph, Node, Region, ScanResult, layer_of
from graphdiff.runtime import module_regex

KIND = "stored_copy"


def dotted_module(file: str) -> str | None:
    """A transformers module's dotted name from its recorded file ('transformers/models/qwen3/modeling_qwen3.py' ->
    'transformers.models.qwen3.modeling_qwen3'); None for a file of another package."""
    dotted = sources.dotted_module(file)
    return dotted if dotted is not None and dotted.split(".")[0] == "transformers" else None


def _helper(n: Node) -> bool:
    """Is `n` computed by a module-level function of a transformers module (not a forward, not a method)?"""
    src = n.source
    dotted = dotted_module(src.file) if src is not None and src.function != "forward" else None
    if src is None or dotted is None:
        return False
    try:
        return callable(getattr(importlib.import_module(dotted), src.function, None))
    except ImportError:
        return False


def readers(scan: ScanResult, graph: Graph) -> list[Node]:
    """The trainer ops that read a value through the engine's stored copy (`read_rounded_by`) inside a helper
    function of a module that no region re-emits, in graph order."""
    nodes = graph.node_map()
    node_of = {d.id: d.node for d in scan.plan}
    covered = [module_regex(r.module) for r in scan.regions if r.kind not in (*OPAQUE_KINDS, KIND)]
    names = {node_of[i] for d in scan.plan for i in d.evidence.read_rounded_by if i in node_of}
    found = [nodes[n] for n in names if n in nodes]
    return sorted((n for n in found if _helper(n) and not any(rx.fullmatch(n.module or "") for rx in covered)),
                  key=lambda n: graph.position(n.name))


def copy_regions(scan: ScanResult, graph: Graph) -> list[Region]:
    """One `stored_copy` region per module pattern holding such readers."""
    by_pattern: dict[str, list[Node]] = {}
    for n in readers(scan, graph):
        by_pattern.setdefault(module_pattern(n.module), []).append(n)
    return [Region(name=f"{pattern}#{KIND}", kind=KIND, module=pattern,
                   kind_reason=f"no rounding site: {found[0].source.function if found[0].source else 'a helper'} "
                               "reads the engine's stored low-precision copy of a value its other readers hold "
                               "in FP32",
                   layers=sorted({layer_of(n.module) for n in found}, key=lambda x: -1 if x is None else x),
                   sites=[], rounded_on=[])
            for pattern, found in by_pattern.items()]


def with_copy_regions(scan: ScanResult, graph: Graph) -> ScanResult:
    """The scan with its `stored_copy` regions added (what codegen cuts and verifies)."""
    more = copy_regions(scan, graph)
    return scan.model_copy(update={"regions": [*scan.regions, *more]}) if more else scan


def seed_node(scan: ScanResult, graph: Graph, region: Region, layers: list[int] | None = None) -> Node | None:
    """The region's first reader (of its first layer, or the first of `layers`): its function is the splice."""
    rx = module_regex(region.module)
    found = [n for n in readers(scan, graph) if rx.fullmatch(n.module or "")]
    if layers:
        found = [n for n in found if layer_of(n.module) in layers] or found
    return found[0] if found else None
