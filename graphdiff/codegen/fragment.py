"""A region's own subgraph of the HF ATen graph, where it splices into the model, and its rounding plan: the
`Fragment` record (cut.py cuts it, `merge` joins the fragments of one splice point) and the rounding it implies.

The runtime replaces Python code, not graph nodes, so each region is cut at a Python boundary the
capture already names: the HF module whose `forward` computes the sites (`Node.module`), or the helper
function named by the sites' source frame (`Source.function`, e.g. `apply_rotary_pos_emb`). A module
whose own nodes only join the outputs of its child modules (a decoder layer's residual adds) cannot be
re-emitted without re-emitting the children; there the patch *carries* FP32 instead: its incoming
activation is upcast, so eager type promotion keeps the sum in FP32 ("carry").

Rounding plan, per node of the fragment, read from the scan's plan (`ScanResult.plan`, decided once in the
analysis): a node is rounded to its low-precision dtype where HF eager rounds it (`Decision.train.rounds`),
except at a trainer-rounded site of an aligned region; at an engine-rounded site of an aligned region it is
rounded where the engine rounds. So with no region aligned the fragment is HF eager, and each region toggles
only its own sites (what ablations need).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from graphdiff.ops import is_heavy, is_low, op_name
from graphdiff.records import Node

Target = Literal["module", "function", "carry"]
# (when, region; for "input-dtype" the input whose dtype at run time decides: rounded unless it is FP32)
Rounding = tuple[Literal["always", "unless-aligned", "if-aligned", "input-dtype"], str]


def is_boundary(n: Node) -> bool:
    """A fragment boundary: matmul-like, attention, or a getitem of a multi-output op."""
    return is_heavy(n.target) or n.target == "getitem"


def is_add(n: Node) -> bool:
    """An add, in place or not (a parallel block's `mlp_output += attention_output`)."""
    return op_name(n.target) in ("add", "add_")


def within(module: str | None, owner: str) -> bool:
    """Is `module` the module `owner` or one of its descendants?"""
    return module == owner or (module or "").startswith(owner + ".")


# How `merge` joins a field of two fragments of one splice point (a field without one keeps the first fragment's).
JOIN: dict[str, Callable[[Any, Any], Any]] = {
    "update": lambda a, b: {**a, **b},  # the later fragment's entries win
    "first": lambda a, b: {**a, **{k: v for k, v in b.items() if k not in a}},  # the first fragment's entries win
    "concat": lambda a, b: a + b,
    "union": lambda a, b: sorted({*a, *b}),
    "union per key": lambda a, b: {**a, **{k: sorted({*a.get(k, []), *v}) for k, v in b.items()}},
    "any": lambda a, b: a or b,
    "record": lambda a, b: b if a is None else a if b is None else joined(a, b),
}


def joined_by(how: str, **kw: Any) -> Any:
    """A dataclass field that `merge` joins by JOIN[how]."""
    return field(metadata={"join": how}, **kw)


def joined(into: Any, other: Any) -> Any:
    """`into` (a Fragment or Carry) with `other`'s fields joined into it, each as its field says (JOIN)."""
    for f in fields(into):
        if "join" in f.metadata:
            setattr(into, f.name, JOIN[f.metadata["join"]](getattr(into, f.name), getattr(other, f.name)))
    return into


@dataclass
class Carry:
    """What a carry splice (target "carry") holds in FP32 and rounds besides its module's own code: the manifest
    splice's carry fields (codegen.carry_plan reads them from the scan)."""

    # its incoming activation is held FP32 (not where its only sites are handoffs)
    input: bool = joined_by("any", default=True)
    # the module's own ops read its incoming activation rounded (the engine's low-precision copy at a piecewise graph
    # split), these child modules read it in FP32
    rounded: bool = False
    fp32_children: list[str] = field(default_factory=list)
    rounded_children: list[str] = field(default_factory=list)  # children reading the stored copy (carry_rounded_child)
    # children whose scaled or summed output stays FP32, any region's
    fp32_outputs: list[str] = joined_by("union", default_factory=list)
    # child whose output the module's own code scales -> the children reading the product, handed it in FP32
    fp32_scaled: dict[str, list[str]] = joined_by("union per key", default_factory=dict)
    # child module -> the decoder layers where the module's own residual add reading that child's output is stored by
    # the engine in BF16 (the patch may hold the child's output in FP32: the sum is then rounded there)
    rounded_sums: dict[str, list[int]] = field(default_factory=dict)
    # child module -> the decoder layers where the module's own residual add of that child's output is stored by the
    # engine in BF16 for later kernels while its own kernel reads it in FP32: later adds read it rounded
    stored_sums: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Fragment:
    """One splice point: the nodes it re-emits, its boundary, and which sites (of which region) it holds."""

    key: str  # module pattern, or the function's dotted path
    target: Target
    module: str  # module pattern (`layers.*`)
    module_class: str
    function: str = ""  # dotted path of the replaced function (target == "function")
    nodes: list[Node] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # boundary inputs, first-use order
    params: dict[str, str] = field(default_factory=dict)  # input placeholder -> module attribute
    outputs: list[str] = field(default_factory=list)
    # trainer-rounded site node (representative layer) -> region
    sites: dict[str, str] = joined_by("update", default_factory=dict)
    engine_sites: dict[str, str] = joined_by("update", default_factory=dict)  # engine-rounded site node -> region
    rounds: set[str] = field(default_factory=set)  # nodes HF eager rounds (from the scan's plan)
    # rounded nodes whose rounding is HF's cast back to an activation input's dtype (`.to(input_dtype)`): node -> that
    # input; rounded only while the input is low precision at run time (a norm whose input the patch carries in FP32)
    input_rounds: dict[str, str] = joined_by("update", default_factory=dict)
    keep_fp32: dict[str, bool] = field(default_factory=dict)  # output -> may leave the fragment in FP32
    # output -> the regions it leaves in FP32 only while they are aligned too: the attention regions it reaches (their
    # splice, the engine's op, rounds its inputs as the engine stores them; HF's sdpa refuses mixed dtypes) and the
    # carry regions whose residual add sums it (in FP32 only with the residual carried)
    fp32_with: dict[str, list[str]] = field(default_factory=dict)
    carry: Carry | None = joined_by("record", default=None)  # target "carry" only
    regions: list[str] = joined_by("concat", default_factory=list)
    # row sums/means the engine sums in its own order when their region is aligned (node -> region), and that
    # order's lanes per HF module (Region.reduction_lanes; the runtime passes each module's)
    ordered: dict[str, str] = joined_by("first", default_factory=dict)
    lanes: dict[str, int] = joined_by("first", default_factory=dict)
    # its layer norms' engine kernels read the input back from their BF16 store after the mean (norm_order)
    reads_store: bool = False
    # its layer norms' engine kernels read the input from their BF16 store in every pass, the mean too (norm_order)
    stored_input: bool = False
    # nodes of INDUCTOR_MATH the engine computes in a kernel Inductor generated: computed by Inductor when aligned
    inductor_math: list[str] = field(default_factory=list)
    # FP32 inputs (cos/sin) the engine gathers from a low-precision table instead (ScanResult.engine_rope_table):
    # input -> that dtype, rounded to it when the fragment's regions are aligned
    table_inputs: dict[str, str] = joined_by("update", default_factory=dict)
    # low-precision inputs made from no activation (a rotary table from the positions): input -> the dtype the traced
    # trainer held it in, which the runtime casts it back to where an FP32 value upstream promoted the op making it
    fixed_inputs: dict[str, str] = joined_by("update", default_factory=dict)
    # nodes whose engine op reads an input of the fragment as its stored low-precision copy while another reader
    # gets it in FP32 (`evidence.read_rounded_by` of a value made outside): they read it rounded (a no-op unless a
    # patch holds it FP32)
    rounded_reads: list[str] = joined_by("union", default_factory=list)
    rounded_values: list[str] = joined_by("union", default_factory=list)  # the ops computing the values they read so
    # the scanned decoder layers this splice serves (a group of layers sharing one rounding plan); [] = every layer
    layers: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # the emitted PyTorch function, once emitted (codegen uses it to verify bindings)
    compiled: Callable[..., Any] | None = None


def merge(frags: list[Fragment]) -> list[Fragment]:
    """Regions whose sites sit in the same module forward or function share one splice point, their fragments joined
    field by field (JOIN). A region that cannot be generated stays on its own: it must not take a region that can
    (Granite's residual scale, a multiply the carry cannot keep FP32, beside its residual adds, which the carry does)
    down with it."""
    by_key: dict[str, Fragment] = {}
    refused: list[Fragment] = []
    for f in frags:
        if f.problems:
            refused.append(f)
        elif f.key in by_key:
            joined(by_key[f.key], f)
        else:
            by_key[f.key] = f
    return [*by_key.values(), *refused]


def rounding(frag: Fragment, node: str) -> Rounding | None:
    """Where the generated code rounds `node`: always (HF and the engine both store it), unless its region is
    aligned (HF rounds, the engine keeps FP32), only if its region is aligned (the engine rounds, HF not)."""
    if node in frag.rounds:
        if node in frag.input_rounds:
            return "input-dtype", frag.input_rounds[node]
        return ("unless-aligned", frag.sites[node]) if node in frag.sites else ("always", "")
    if node in frag.engine_sites:
        return "if-aligned", frag.engine_sites[node]
    return None


def rounding_points(frag: Fragment, align: frozenset[str]) -> set[str]:
    """The nodes the generated code rounds when the regions in `align` are aligned (with the outputs it rounds as it
    returns them that no node of the fragment reads); a rounding that follows an input's dtype counts, as the traced
    inputs and the probes are in their low dtype."""
    out = set()
    for n in frag.nodes:
        r = rounding(frag, n.name)
        if r is not None and (r[0] in ("always", "input-dtype") or (r[0] == "unless-aligned") != (r[1] in align)):
            out.add(n.name)
    read = {i for n in frag.nodes for i in n.inputs}
    low = {n.name for n in frag.nodes if is_low(n.dtype)}
    return out | {o for o in frag.outputs if o in low and o not in read and not leaves_fp32(frag, o, align)}


def leaves_fp32(frag: Fragment, output: str, align: frozenset[str]) -> bool:
    """Does the generated code return `output` in FP32 when the regions in `align` are aligned? Its site's region
    aligned, and it may cross the boundary so (with the attention regions it reaches aligned too, `fp32_with`)."""
    region = frag.sites.get(output)
    return (region in align and frag.keep_fp32.get(output, False)
            and set(frag.fp32_with.get(output, [])) <= align)


def ordered_points(frag: Fragment, align: frozenset[str], lanes: int) -> dict[str, int]:
    """The row reductions the generated code sums in the engine's order (node -> lanes) when the regions in
    `align` are aligned and the module's kernel sums in `lanes` lanes (0: none)."""
    return {n: lanes for n, r in frag.ordered.items() if r in align} if lanes else {}


def region_slug(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z]+", "_", name.replace("*", "N")).strip("_")
