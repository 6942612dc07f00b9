"""ATen fragment -> plain PyTorch: every op in FP32, `_round` only at the rounding plan's points.

Each node becomes one line. Readable forms for the common ops; any other ATen op is emitted as
`torch.ops.aten.<op>.<overload>(...)` (the same kernel eager dispatches), so the emitter is not a list
of model templates. Casts are identities (the value is FP32 throughout); the plan decides rounding. The helpers the
emitted code calls (`_f32`, `_round`, the ordered row sums) are in its prelude (prelude.py). Arguments and values
are named by role (names.py): `names` maps each graph node of the fragment to its variable.
"""

from __future__ import annotations

import math
import re

from graphdiff.analysis.rounding import is_view
from graphdiff.codegen.fragment import Fragment, rounding
from graphdiff.codegen.names import arguments, value_names
from graphdiff.ops import is_low, op_name
from graphdiff.records import Node, walk
from graphdiff.replay.inductor_math import math_form
from graphdiff.replay.kernel_fragment import value_base
from graphdiff.replay.sum_order import LAYER_NORM_FN, MEAN_FN, SUM_FN

BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
UNARY = {"rsqrt": "torch.rsqrt", "sqrt": "torch.sqrt", "exp": "torch.exp", "sigmoid": "torch.sigmoid",
         "tanh": "torch.tanh", "reciprocal": "torch.reciprocal", "silu": "F.silu", "neg": "torch.neg",
         "relu": "F.relu", "log": "torch.log", "abs": "torch.abs"}
DTYPES = {"bfloat16": "torch.bfloat16", "float16": "torch.float16"}


class Unsupported(Exception):
    """A node the emitter cannot write shape-independently (the manifest records the reason)."""


def literal(a: object, names: dict[str, str]) -> str:
    """An argument as code: a node's variable (`names`), a number, a dtype, or a list of them."""
    if isinstance(a, dict):
        if "node" in a:
            return names[a["node"]]
        if "float" in a:
            return f"float({a['float']!r})"
        if "dtype" in a:
            return f"torch.{a['dtype']}"
        if "sym" in a:
            raise Unsupported(f"symbolic size {a['sym']} in an argument")
        raise Unsupported(f"argument {a}")
    if isinstance(a, list):
        return "[" + ", ".join(literal(x, names) for x in a) + "]"
    return repr(a)


def _int_sizes(sizes: object) -> list[int] | None:
    return list(sizes) if isinstance(sizes, list) and all(isinstance(s, int) for s in sizes) else None


def reshaped(n: Node, nodes: dict[str, Node], names: dict[str, str]) -> str:
    """A view/reshape/expand written against its input's own sizes: the leading sizes it keeps (batch, sequence)
    are read from the input at run time; only the sizes it changes are the captured constants (generation runs the
    emitted code at a second token count, so a constant that is a token count is refused there)."""
    args, name = n.call[0], op_name(n.target)
    src = args[0]
    source = nodes.get(src["node"]) if isinstance(src, dict) and "node" in src else None
    sizes, shape = _int_sizes(args[1] if len(args) > 1 else None), _int_sizes(source.shape if source else None)
    if sizes is None or shape is None or n.call[1]:
        raise Unsupported(f"{n.target} with sizes {args[1:]} {n.call[1] or ''}".strip())
    x = literal(src, names)
    if name == "expand":  # sizes align with the input's from the right; -1 keeps the input's size
        offset = len(sizes) - len(shape)
        kept = [-1 if i >= offset and s == shape[i - offset] else s for i, s in enumerate(sizes)]
        return f"{x}.expand({', '.join(map(repr, kept))})"
    k = 0
    while k < min(len(sizes), len(shape)) and sizes[k] == shape[k]:
        k += 1
    tail = 0  # the trailing sizes it keeps (features), at least one size changing on each side
    while tail < min(len(sizes), len(shape)) - k - 1 and sizes[-1 - tail] == shape[-1 - tail]:
        tail += 1
    middle, merged = sizes[k:len(sizes) - tail], shape[k:len(shape) - tail]
    if len(middle) == 1 and merged and math.prod(merged) == middle[0]:  # leading sizes merged (tokens of a batch)
        parts = [f"*{x}.shape[:{k}]"] if k else []
        return f"{x}.reshape({', '.join([*parts, '-1', *map(repr, sizes[len(sizes) - tail:])])})"
    split = _leading_sizes(n, sizes[:len(sizes) - tail], nodes, names) if len(merged) == 1 and middle else None
    if split is not None:  # a merged size split back: the sizes as an earlier value of the fragment has them
        return f"{x}.reshape({', '.join([split, *map(repr, sizes[len(sizes) - tail:])])})"
    parts = ([f"*{x}.shape[:{k}]"] if k else []) + [repr(s) for s in sizes[k:]]
    return f"{x}.reshape({', '.join(parts)})"


def _leading_sizes(n: Node, leading: list[int], nodes: dict[str, Node], names: dict[str, str]) -> str | None:
    """`*v.shape[:m]` for the nearest value `v` before `n` in the fragment (no parameter) whose captured shape starts
    with `leading` (m sizes): where a view splits back the tokens an earlier view merged, it reads them from there."""
    def splits(i: str) -> bool:
        shape = list(nodes[i].shape or [])
        return (nodes[i].param is None and _int_sizes(nodes[i].shape) is not None and shape[:len(leading)] == leading
                and len(shape) > len(leading))

    def named(i: str) -> bool:  # a value of the fragment: the walk goes back through these only
        return i in names and i in nodes

    earlier = walk([n.name], lambda i: n.inputs if i == n.name else nodes[i].inputs, through=named)
    found = next((i for i in earlier if named(i) and splits(i)), None)
    return None if found is None else f"*{names[found]}.shape[:{len(leading)}]"


def expression(n: Node, nodes: dict[str, Node], names: dict[str, str]) -> str:
    """The FP32 PyTorch expression computing node `n` from its inputs' variables (`names`; `nodes`: the graph's
    nodes, for the sizes a view keeps from its input)."""
    args, kwargs = n.call[0], n.call[1]
    name = op_name(n.target)
    if name in ("_to_copy", "convert_element_type", "alias", "clone", "contiguous"):
        return literal(args[0], names)  # the value, in FP32; a downcast is a rounding point of the plan
    if name == "gelu" and set(kwargs) <= {"approximate"}:  # exact (erf) or tanh form, as the model asks
        return f"F.gelu({literal(args[0], names)}, approximate={kwargs.get('approximate', 'none')!r})"
    if name in ("view", "reshape", "_unsafe_view", "expand"):
        return reshaped(n, nodes, names)
    if any(k not in ("dtype",) for k in kwargs):
        raise Unsupported(f"{n.target} with keyword arguments {kwargs}")
    if name in BINARY and len(args) == 2:
        return f"{literal(args[0], names)} {BINARY[name]} {literal(args[1], names)}"
    if name in UNARY and len(args) == 1:
        return f"{UNARY[name]}({literal(args[0], names)})"
    if name == "pow" and n.target.endswith("Tensor_Scalar"):
        return f"torch.pow({literal(args[0], names)}, {literal(args[1], names)})"
    if name in ("mean", "sum") and n.target.endswith(("dim", "dim_IntList")):
        keep = args[2] if len(args) > 2 else False
        return f"torch.{name}({literal(args[0], names)}, {literal(args[1], names)}, keepdim={keep!r})"
    if name == "getitem" and len(args) == 2 and isinstance(args[1], int):
        return f"{literal(args[0], names)}[{args[1]}]"  # an item of a tuple-valued op (native_layer_norm, var_mean)
    if n.target.count(".") != 2:
        raise Unsupported(f"{n.target} is not an ATen op")
    ns, op, overload = n.target.split(".")
    return f"torch.ops.{ns}.{op}.{overload}({', '.join(literal(a, names) for a in args)})"


def flag(region_index: dict[str, int], region: str) -> str:
    return f"a{region_index[region]}"


def ordered_expression(n: Node, flag_var: str, nodes: dict[str, Node], names: dict[str, str],
                       reads_store: bool = False, stored_input: bool = False) -> str:
    """A row sum/mean or layer norm in the engine kernel's order (`lanes`, passed per module) when its region is
    aligned; `reads_store`: the kernel reads the norm's input back from its store after the mean, in HF's input
    dtype; `stored_input`: it reads every pass from that store (the input rounded, the mean too)."""
    args = n.call[0]
    if op_name(n.target) == "native_layer_norm":
        source = nodes.get(n.inputs[0]) if n.inputs and (reads_store or stored_input) else None
        stored = DTYPES.get(source.dtype or "") if source is not None else None
        parts = [literal(a, names) for a in args[:5]]
        if stored_input and stored is not None:
            parts[0], stored = f"_round({parts[0]}, {stored})", None
        ordered = f"{LAYER_NORM_FN}({', '.join(parts)}, lanes, {stored})"
        return f"{ordered} if {flag_var} and lanes else {expression(n, nodes, names)}"
    keep = args[2] if len(args) > 2 else False
    fn = MEAN_FN if op_name(n.target) == "mean" else SUM_FN
    ordered = f"{fn}({literal(args[0], names)}, {literal(args[1], names)}, {keep!r}, lanes)"
    return f"{ordered} if {flag_var} and lanes else {expression(n, nodes, names)}"


def store_readers(frag: Fragment, nodes: dict[str, Node]) -> dict[str, tuple[str, str]]:
    """Where the engine's norm kernel reads its input back from its store (`frag.reads_store`), an RMS norm's ops
    after the first row mean read it rounded: node -> (the FP32 copy of the activation input it reads, HF's input
    dtype). That mean's own operands (the square) read the FP32 value, in the kernel's first loop; a later mean's (a
    written-out layer norm's variance) the reloaded store. Layer norms: the ordered layer norm itself
    (ordered_expression)."""
    if not frag.reads_store or not frag.ordered:
        return {}
    inside = {n.name for n in frag.nodes}
    first = next(n.name for n in frag.nodes if n.name in frag.ordered)  # the kernel's first loop, before the store
    feeds_rows = set(walk([first], lambda name: [i for i in nodes[name].inputs if i in inside]))
    found: dict[str, tuple[str, str]] = {}
    for n in frag.nodes:
        if n.name in feeds_rows or n.name in frag.ordered:
            continue
        for i in n.inputs:
            src = nodes[i]
            if (i in feeds_rows and op_name(src.target) in ("_to_copy", "convert_element_type") and src.inputs
                    and src.inputs[0] in frag.inputs and src.inputs[0] not in frag.params
                    and is_low(nodes[src.inputs[0]].dtype)):
                found[n.name] = (i, DTYPES.get(str(nodes[src.inputs[0]].dtype), "torch.bfloat16"))
    return found


def stored_reads(frag: Fragment, n: Node, nodes: dict[str, Node]) -> list[str]:
    """The inputs of `n` (a `rounded_reads` node) that are a fragment input or views of one: what it reads rounded."""
    if n.name not in frag.rounded_reads:
        return []
    inside = {m.name for m in frag.nodes}
    out = []
    for i in n.inputs:
        src = i
        while src in inside and is_view(nodes[src]) and nodes[src].inputs:
            src = nodes[src].inputs[0]
        base = value_base(nodes, src)
        if src in frag.inputs and src not in frag.params and is_low(nodes[src].dtype) and base is not None \
                and base.name in frag.rounded_values:
            out.append(i)
    return out


def _input_lines(frag: Fragment, names: dict[str, str], nodes: dict[str, Node], index: dict[str, int]) -> list[str]:
    """Each input in FP32; one the engine gathers from a low-precision table (`table_inputs`) rounded to it while
    the fragment's regions are aligned; an RMS norm's activation input that the engine's kernel reads from its
    low-precision store in every pass, the mean too (`stored_input`; a layer norm: ordered_expression), rounded to
    it while the norm sums in the kernel's order."""
    lines = []
    stored = frag.stored_input and frag.ordered and not any(op_name(n.target) == "native_layer_norm"
                                                           for n in frag.nodes)
    for name in frag.inputs:
        x = names[name]
        if name in frag.input_rounds.values():  # HF casts back to this input's dtype: none for an FP32 input
            lines.append(f"    {x}_low = {x}.dtype != torch.float32")
        if name in frag.table_inputs:
            flags = " or ".join(flag(index, r) for r in frag.regions)
            dtype = DTYPES.get(frag.table_inputs[name], "torch.bfloat16")
            lines.append(f"    {x} = _round(_f32({x}), {dtype}) if {flags} else _f32({x})"
                         f"  # float32; the engine reads a {frag.table_inputs[name]} table")
        elif stored and name not in frag.params and is_low(nodes[name].dtype):
            flags = " or ".join(flag(index, r) for r in sorted(set(frag.ordered.values())))
            dtype = DTYPES.get(str(nodes[name].dtype), "torch.bfloat16")
            lines.append(f"    {x} = _round(_f32({x}), {dtype}) if ({flags}) and lanes else _f32({x})"
                         f"  # float32; the engine's norm kernel reads its {nodes[name].dtype} store in every pass")
        else:
            lines.append(f"    {x} = _f32({x})  # {nodes[name].dtype}")
    return lines


def _stored_copies(frag: Fragment, n: Node, nodes: dict[str, Node], names: dict[str, str], index: dict[str, int],
                   rereads: dict[str, tuple[str, str]]) -> list[tuple[str, str]]:
    """(input, the line making its `_stored` copy) for each input `n` reads as the engine's stored low-precision
    copy: a norm's input its kernel's later loop reloads (`store_readers`), an input the engine's op reads from its
    store (`stored_reads`: a no-op unless FP32)."""
    out = []
    if n.name in rereads:
        src, dtype = rereads[n.name]
        flags = " or ".join(flag(index, r) for r in sorted(set(frag.ordered.values())))
        out.append((src, f"    {names[src]}_stored = _round({names[src]}, {dtype}) if ({flags}) and lanes "
                         f"else {names[src]}"))
    for held in stored_reads(frag, n, nodes):
        out.append((held, f"    {names[held]}_stored = _round({names[held]}, torch.bfloat16)"))
    return out


def emit_function(frag: Fragment, fn_name: str, nodes_by_name: dict[str, Node],
                  names: dict[str, str] | None = None) -> list[str]:
    """`def fn_name(<inputs>, align, lanes) -> tuple`: the fragment under the plan set by `align`; `lanes` is the
    module's engine kernel's row-sum order (0: ATen's). `names`: each input's and node's variable (default: the
    module's parameter names, or `arg0`, ... for a function not yet bound; names.value_names)."""
    names = names or value_names(frag, arguments(frag))
    index = {r: i for i, r in enumerate(frag.regions)}
    params = ", ".join(names[i] for i in frag.inputs)
    lines = [f"def {fn_name}({params}, align: frozenset[str], lanes: int = 0) -> tuple[torch.Tensor, ...]:"]
    for region, i in index.items():
        sites = [names[n.name] for n in frag.nodes if frag.sites.get(n.name) == region]
        what = f"{', '.join(sites)} stay FP32" if sites else "its rows summed in the engine kernel's order"
        lines.append(f"    a{i} = {region!r} in align  # aligned: {what}")
    lines += _input_lines(frag, names, nodes_by_name, index)
    rereads = store_readers(frag, nodes_by_name)
    copies: set[str] = set()  # the stored copies already made: an input is never reassigned, one copy serves all
    for n in frag.nodes:
        code = (n.source.code if n.source else "")[:70]
        read = dict(names)
        for src, line in _stored_copies(frag, n, nodes_by_name, names, index, rereads):
            read[src] = f"{names[src]}_stored"
            if line not in copies:
                copies.add(line)
                lines.append(line)
        expr = (ordered_expression(n, flag(index, frag.ordered[n.name]), nodes_by_name, names, frag.reads_store,
                                   frag.stored_input)
                if n.name in frag.ordered else expression(n, nodes_by_name, read))
        if n.name in frag.inductor_math:  # the engine's kernel computes it with Inductor's math library
            flags = " or ".join(flag(index, r) for r in frag.regions)
            form = math_form(op_name(n.target), n.call[1]) or op_name(n.target)
            expr = f"inductor_math({form!r}, {literal(n.call[0][0], names)}) if {flags} else {expr}"
        x = names[n.name]
        lines.append(f"    {x} = {expr}  # {n.target}: {code}")
        when = rounding(frag, n.name)
        dtype = DTYPES.get(n.dtype or "", "torch.bfloat16")  # an engine-only rounding of an FP32 trainer value
        if when is not None and when[0] == "unless-aligned":
            lines.append(f"    if not {flag(index, when[1])}:  # HF rounds here, the engine does not")
            lines.append(f"        {x} = _round({x}, {dtype})")
        elif when is not None and when[0] == "input-dtype":
            lines.append(f"    if {names[when[1]]}_low:  # HF's cast back to its input's dtype")
            lines.append(f"        {x} = _round({x}, {dtype})")
        elif when is not None and when[0] == "if-aligned":
            lines.append(f"    if {flag(index, when[1])}:  # the engine rounds here, HF does not")
            lines.append(f"        {x} = _round({x}, {dtype})")
        elif when is not None:
            lines.append(f"    {x} = _round({x}, {dtype})  # both sides store it")
    outs = []
    for o in frag.outputs:
        n, x = nodes_by_name[o], names[o]
        if not is_low(n.dtype):
            outs.append(x)
        elif o in frag.sites and frag.keep_fp32.get(o, False):
            cond = " and ".join([flag(index, frag.sites[o]), *(f"{r!r} in align" for r in frag.fp32_with.get(o, []))])
            outs.append(f"{x} if {cond} else {x}.to({DTYPES[str(n.dtype)]})")
        else:
            outs.append(f"{x}.to({DTYPES[str(n.dtype)]})")  # exact: already rounded, or rounded at the boundary
            _store_once(lines, x, DTYPES[str(n.dtype)])
    lines.append(f"    return ({', '.join(outs)},)")
    return lines


def _store_once(lines: list[str], x: str, dtype: str) -> None:
    """An output that both sides store and nothing after its rounding reads: stored once (`x.to(dtype)`) instead of
    rounded, widened back to FP32 and narrowed again at the return (two passes over it fewer; the same values and,
    through the casts, the same gradient)."""
    rounded = f"    {x} = _round({x}, {dtype})  # both sides store it"
    if rounded not in lines:
        return
    at = len(lines) - 1 - lines[::-1].index(rounded)
    if not any(re.search(rf"\b{re.escape(x)}\b", line) for line in lines[at + 1:]):
        lines[at] = f"    {x} = {x}.to({dtype})  # both sides store it (an output nothing else reads: stored once)"
