"""ATen fragment -> plain PyTorch: every op in FP32, `_round` only at the rounding plan's points.

Each node becomes one line. Readable forms for the common ops; any other ATen op is emitted as
`torch.ops.aten.<op>.<overload>(...)` (the same kernel eager dispatches), so the emitter is not a list
of model templates. Casts are identities (the value is FP32 throughout); the plan decides rounding.
"""

from __future__ import annotations

from graphdiff.codegen.fragment import Fragment, rounding
from graphdiff.ops import is_low, op_name
from graphdiff.records import Node
from graphdiff.replay.sum_order import MEAN_FN, SOURCE, SUM_FN

BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
UNARY = {"rsqrt": "torch.rsqrt", "sqrt": "torch.sqrt", "exp": "torch.exp", "sigmoid": "torch.sigmoid",
         "tanh": "torch.tanh", "reciprocal": "torch.reciprocal", "silu": "F.silu", "neg": "torch.neg",
         "relu": "F.relu", "log": "torch.log", "abs": "torch.abs"}
DTYPES = {"bfloat16": "torch.bfloat16", "float16": "torch.float16"}


class Unsupported(Exception):
    """A node the emitter cannot write shape-independently (the manifest records the reason)."""


def var(name: str) -> str:
    return f"v_{name}"


def literal(a: object) -> str:
    if isinstance(a, dict):
        if "node" in a:
            return var(a["node"])
        if "float" in a:
            return f"float({a['float']!r})"
        if "dtype" in a:
            return f"torch.{a['dtype']}"
        if "sym" in a:
            raise Unsupported(f"symbolic size {a['sym']} in an argument")
        raise Unsupported(f"argument {a}")
    if isinstance(a, list):
        return "[" + ", ".join(literal(x) for x in a) + "]"
    return repr(a)


def expression(n: Node) -> str:
    """The FP32 PyTorch expression computing node `n` from its inputs' variables."""
    args, kwargs = n.call[0], n.call[1]
    name = op_name(n.target)
    if name in ("_to_copy", "convert_element_type", "alias", "clone", "contiguous"):
        return literal(args[0])  # the value, in FP32; a downcast is a rounding point of the plan
    if name == "gelu" and set(kwargs) <= {"approximate"}:  # exact (erf) or tanh form, as the model asks
        return f"F.gelu({literal(args[0])}, approximate={kwargs.get('approximate', 'none')!r})"
    if name in ("view", "reshape", "_unsafe_view", "expand") or any(k not in ("dtype",) for k in kwargs):
        # Concrete sizes would bake the captured batch and sequence length into the code.
        raise Unsupported(f"{n.target} with sizes {args[1:]} {kwargs or ''}".strip())
    if name in BINARY and len(args) == 2:
        return f"{literal(args[0])} {BINARY[name]} {literal(args[1])}"
    if name in UNARY and len(args) == 1:
        return f"{UNARY[name]}({literal(args[0])})"
    if name == "pow" and n.target.endswith("Tensor_Scalar"):
        return f"torch.pow({literal(args[0])}, {literal(args[1])})"
    if name in ("mean", "sum") and n.target.endswith(("dim", "dim_IntList")):
        keep = args[2] if len(args) > 2 else False
        return f"torch.{name}({literal(args[0])}, {literal(args[1])}, keepdim={keep!r})"
    if name == "getitem" and len(args) == 2 and isinstance(args[1], int):
        return f"{literal(args[0])}[{args[1]}]"  # an item of a tuple-valued op (native_layer_norm, var_mean)
    if n.target.count(".") != 2:
        raise Unsupported(f"{n.target} is not an ATen op")
    ns, op, overload = n.target.split(".")
    return f"torch.ops.{ns}.{op}.{overload}({', '.join(literal(a) for a in args)})"


def flag(region_index: dict[str, int], region: str) -> str:
    return f"a{region_index[region]}"


def ordered_expression(n: Node, flag_var: str) -> str:
    """A row sum/mean in the engine kernel's order (`lanes`, passed per module) when its region is aligned."""
    args = n.call[0]
    keep = args[2] if len(args) > 2 else False
    fn = MEAN_FN if op_name(n.target) == "mean" else SUM_FN
    return f"{fn}({literal(args[0])}, {literal(args[1])}, {keep!r}, lanes) if {flag_var} and lanes else {expression(n)}"


def emit_function(frag: Fragment, fn_name: str, nodes_by_name: dict[str, Node]) -> list[str]:
    """`def fn_name(i0, ..., align, lanes) -> tuple`: the fragment under the plan set by `align`; `lanes` is the
    module's engine kernel's row-sum order (0: ATen's)."""
    index = {r: i for i, r in enumerate(frag.regions)}
    params = ", ".join(f"x{i}" for i in range(len(frag.inputs)))
    lines = [f"def {fn_name}({params}, align: frozenset[str], lanes: int = 0) -> tuple[torch.Tensor, ...]:"]
    for region, i in index.items():
        sites = sorted(n for n, r in frag.sites.items() if r == region)
        lines.append(f"    a{i} = {region!r} in align  # aligned: {', '.join(sites)} stay FP32")
    for i, name in enumerate(frag.inputs):
        lines.append(f"    {var(name)} = _f32(x{i})  # {name}: {nodes_by_name[name].dtype}")
    for n in frag.nodes:
        code = (n.source.code if n.source else "")[:70]
        expr = ordered_expression(n, flag(index, frag.ordered[n.name])) if n.name in frag.ordered else expression(n)
        lines.append(f"    {var(n.name)} = {expr}  # {n.target}: {code}")
        when = rounding(frag, n.name)
        dtype = DTYPES.get(n.dtype or "", "torch.bfloat16")  # an engine-only rounding of an FP32 trainer value
        if when is not None and when[0] == "unless-aligned":
            lines.append(f"    if not {flag(index, when[1])}:  # HF rounds here, the engine does not")
            lines.append(f"        {var(n.name)} = _round({var(n.name)}, {dtype})")
        elif when is not None and when[0] == "if-aligned":
            lines.append(f"    if {flag(index, when[1])}:  # the engine rounds here, HF does not")
            lines.append(f"        {var(n.name)} = _round({var(n.name)}, {dtype})")
        elif when is not None:
            lines.append(f"    {var(n.name)} = _round({var(n.name)}, {dtype})  # both sides store it")
    outs = []
    for o in frag.outputs:
        n = nodes_by_name[o]
        if not is_low(n.dtype):
            outs.append(var(o))
        elif o in frag.sites and frag.keep_fp32.get(o, False):
            outs.append(f"{var(o)} if {flag(index, frag.sites[o])} else {var(o)}.to({DTYPES[n.dtype]})")
        else:
            outs.append(f"{var(o)}.to({DTYPES[n.dtype]})")  # exact: already rounded, or rounded at the boundary
    lines.append(f"    return ({', '.join(outs)},)")
    return lines


PRELUDE = '''
def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.is_floating_point() else x


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Store in `dtype` (round to nearest even) and go on computing in FP32."""
    return x.to(dtype).float()
''' + SOURCE
