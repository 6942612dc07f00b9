"""What Inductor's Triton codegen computes for one ATen op, read from Inductor on the installed torch.

On a GPU the engine runs the Triton kernels Inductor generates, so a generated kernel must compute each op
with the same function, not just the same math. Inductor turns an ATen op into Triton text in three steps,
and each is asked here, per fragment node:

1. decomposition: `torch._inductor.decomposition.select_decomp_table()`, applied by tracing the op with
   `make_fx` as AOT autograd does (aten.silu becomes x / (exp(-x) + 1));
2. lowering: `torch._inductor.lowering.lowerings`, run on IR input buffers; the IR's inner functions call
   Inductor's `ops` (aten.div -> ops.truediv, pow with a small integer exponent -> `pow_recursive`'s
   multiplications, mean -> a sum reduction and ops.truediv by the row size, scalars -> ops.constant);
3. the Triton op overrides: every `ops` call goes to `TritonOverrides` (ops.rsqrt -> libdevice.rsqrt,
   ops.exp -> libdevice.exp, or tl_math.exp under `use_fast_math`, ops.truediv -> `/`, or div_rn under
   `eager_numerics.division_rounding`, ops.sigmoid -> tl.sigmoid).

The inner functions run under a recording ops handler, so an op becomes a list of `Step`s: one Triton
expression each, over the fragment's variables and earlier steps. A reduction is a `sum` step: Inductor's
persistent reduction of a row (one FP32 `tl.sum` over a power-of-two block, masked lanes 0) for rows up to
`persistent_limit()`, which the emitter writes.

Where Inductor cannot be asked (no torch._inductor, or its internals changed), `_fallback` gives the forms read
from torch 2.11 and 2.13 (the recorded H200 dump and this module's tests), and `source()` says why.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from graphdiff.ops import IDENTITY, op_name
from graphdiff.records import Node


class Unsupported(Exception):
    """An op this lowering cannot follow (the manifest records the reason)."""


@dataclass(frozen=True)
class Step:
    var: str  # the variable it assigns
    op: str  # Inductor's ops name: mul, truediv, exp, rsqrt, constant, sum, ...
    args: tuple[str, ...]  # variables it reads
    expr: str  # the Triton expression Inductor emits ("" for `sum`: the emitter writes the reduction)
    value: float | None = None  # constants: the number


@functools.cache
def _inductor() -> dict[str, Any] | str:
    """Inductor's modules, or why they cannot be used."""
    try:
        from torch._inductor import config, ir
        from torch._inductor.codegen.common import CSEVariable
        from torch._inductor.codegen.triton import TritonOverrides
        from torch._inductor.decomposition import select_decomp_table
        from torch._inductor.graph import GraphLowering
        from torch._inductor.lowering import lowerings
        from torch._inductor.virtualized import V
        from torch.utils._sympy.value_ranges import ValueRanges
    except Exception as e:  # noqa: BLE001 - any import failure means: use the fallback, say why
        return f"torch._inductor not importable ({type(e).__name__}: {e})"
    return dict(config=config, ir=ir, CSEVariable=CSEVariable, TritonOverrides=TritonOverrides,
                decomp=select_decomp_table(), GraphLowering=GraphLowering, lowerings=lowerings, V=V,
                ValueRanges=ValueRanges)


_reason: list[str] = []


def source() -> str:
    """Where the forms come from, for the generated module's header."""
    ind = _inductor()
    if isinstance(ind, str):
        return f"fallback forms (torch 2.11/2.13 Inductor): {ind}"
    config = ind["config"]
    knobs = f"use_fast_math={config.use_fast_math}, division_rounding={config.eager_numerics.division_rounding}"
    if _reason:
        return f"Inductor of torch {torch.__version__} ({knobs}); fallback forms for: {'; '.join(sorted(set(_reason)))}"
    return f"Inductor of torch {torch.__version__} ({knobs})"


@functools.cache
def persistent_limit() -> int:
    """The longest row Inductor reduces in one block (a persistent reduction) for an inner-dimension
    reduction; longer rows it loops over with an autotuned block. Asked from Inductor's own heuristic."""
    ind = _inductor()
    if isinstance(ind, str):
        return 1024
    try:
        from torch._inductor.choices import InductorChoices
        from torch._inductor.runtime.hints import ReductionHint
        from torch._inductor.sizevars import SizeVarAllocator

        class _Features:  # the two things the heuristic reads of a kernel
            def __init__(self, n: int) -> None:
                self.reduction_numel = n

            def get_reduction_hint(self) -> ReductionHint:
                return ReductionHint.INNER

        class _Graph:
            sizevars = SizeVarAllocator()

        with ind["V"].set_graph_handler(_Graph()):
            n = 1
            # the ignore: _Features stands in for the SIMDKernelFeatures the heuristic takes
            while n <= 1 << 20 and InductorChoices.should_use_persistent_reduction(
                    _Features(n * 2), False):  # type: ignore[arg-type]
                n *= 2
            return n
    except Exception as e:  # noqa: BLE001
        _reason.append(f"persistent-reduction limit ({type(e).__name__}: {e})")
        return 1024


class _Recorder:
    """An Inductor ops handler: each `ops.X(...)` call becomes a Step with TritonOverrides' text for it."""

    def __init__(self, ind: dict, prefix: str, env: dict[str, str]) -> None:
        self.ind, self.prefix, self.env = ind, prefix, env
        self.steps: list[Step] = []

    def _var(self, name: str) -> object:
        return self.ind["CSEVariable"](name, self.ind["ValueRanges"].unknown(), torch.float32)

    def load(self, name: str, index: object) -> object:
        return self._var(self.env[name])

    def index_expr(self, expr: Any, dtype: torch.dtype) -> object:  # expr: a sympy expression
        # Inductor's Triton kernels write an integer index constant (a row size) as a shaped tl.full
        if not getattr(expr, "is_Integer", False):
            raise Unsupported(f"index expression {expr}")
        return self.constant(float(int(expr)), dtype)

    def to_dtype(self, x: object, dtype: torch.dtype, *args: object, **kwargs: object) -> object:
        # Inductor computes low-precision values in FP32 (triton_compute_type): a cast to a float type is the
        # value itself; the plan's roundings are the emitter's
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise Unsupported(f"cast to {dtype}")
        return x

    def __getattr__(self, name: str) -> Callable[..., object]:
        fn = getattr(self.ind["TritonOverrides"], name)

        def call(*args: Any, **kwargs: Any) -> object:
            expr = fn(*args, **kwargs)
            var = self._var(f"{self.prefix}{len(self.steps)}")
            refs = tuple(str(a) for a in args if isinstance(a, self.ind["CSEVariable"]))
            value = float(args[0]) if name == "constant" else None
            self.steps.append(Step(str(var), name, refs, str(expr), value))
            return var

        return call


def _fake_args(n: Node, nodes: dict[str, Node]) -> tuple[list, list[str]]:
    """The node's positional arguments with node references as FP32 tensors (a mask, `where`'s condition: bool), and
    which variables they are."""
    out: list[object] = []
    refs: list[str] = []
    for a in n.call[0]:
        if isinstance(a, dict) and "node" in a:
            shape = [s if isinstance(s, int) else 8 for s in (nodes[a["node"]].shape or [])]
            out.append(torch.empty(shape, dtype=torch.bool if nodes[a["node"]].dtype == "bool" else torch.float32))
            refs.append(a["node"])
        elif isinstance(a, (int, float, bool)) or (isinstance(a, list) and all(isinstance(x, int) for x in a)):
            out.append(a)
        else:
            raise Unsupported(f"argument {a!r} of {n.target}")
    if n.call[1]:
        raise Unsupported(f"{n.target} with keyword arguments {n.call[1]}")
    return out, refs


def _overload(target: str) -> torch._ops.OpOverload:
    ns, op, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def lower(n: Node, nodes: dict[str, Node], var: dict[str, str], out: str) -> list[Step]:
    """The Steps Inductor's Triton codegen runs for node `n`; the last assigns `out`. `var` names the
    kernel variable of each fragment value."""
    if op_name(n.target) in IDENTITY:  # casts: FP32 in registers (Inductor's to_dtype to a compute type)
        x = var[n.call[0][0]["node"]]
        return [Step(out, "identity", (x,), x)]
    ind = _inductor()
    if isinstance(ind, str):
        return _fallback(n, nodes, var, out)
    try:
        return _lower(ind, n, nodes, var, out)
    except Unsupported:
        raise
    except Exception as e:  # noqa: BLE001 - Inductor internals moved: the fallback, with the reason
        _reason.append(f"{n.target} ({type(e).__name__}: {str(e)[:80]})")
        return _fallback(n, nodes, var, out)


def _lower(ind: dict, n: Node, nodes: dict[str, Node], var: dict[str, str], out: str) -> list[Step]:
    from torch.fx.experimental.proxy_tensor import make_fx

    args, refs = _fake_args(n, nodes)
    op = _overload(n.target)

    def fn(*tensors: torch.Tensor) -> torch.Tensor:
        it = iter(tensors)
        return op(*[next(it) if isinstance(a, torch.Tensor) else a for a in args])

    gm = make_fx(fn, decomposition_table=ind["decomp"], tracing_mode="fake")(
        *[a for a in args if isinstance(a, torch.Tensor)])
    ir, V, lowerings = ind["ir"], ind["V"], ind["lowerings"]
    rec = _Recorder(ind, f"{out}_", {f"in{i}": var[r] for i, r in enumerate(refs)})
    graph = ind["GraphLowering"](gm)
    with V.set_graph_handler(graph):
        boxes: dict[str, Any] = {}  # Inductor's TensorBoxes
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                layout = ir.FixedLayout(torch.device("cpu"), node.meta["val"].dtype, list(node.meta["val"].shape))
                boxes[node.name] = ir.TensorBox.create(ir.InputBuffer(name=f"in{len(boxes)}", layout=layout))
            elif node.op == "call_function":
                if node.target not in lowerings:
                    raise Unsupported(f"{node.target} (from {n.target}) has no Inductor lowering (a fallback kernel)")
                boxes[node.name] = lowerings[node.target](
                    *[boxes[a.name] if isinstance(a, torch.fx.Node) else a for a in node.args], **node.kwargs)
            elif node.op == "output":
                (res,) = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
                result = boxes[res.name]
        for buf in graph.buffers:  # realized buffers (a reduction) are loaded by what follows: compute them first
            buf.freeze_layout()
        with V.set_ops_handler(rec):
            for buf in graph.buffers:
                rec.env[buf.get_name()] = str(_inner(rec, buf.data, ir))
            value = str(result.make_loader()([0] * len(result.get_size())))
    steps = rec.steps
    if not steps or value != steps[-1].var:  # the op is an input's value (pow 1, a cast)
        steps.append(Step(out, "identity", (value,), value))
    last = steps[-1]
    return [*steps[:-1], Step(out, last.op, last.args, last.expr, last.value)]


def _inner(rec: _Recorder, data: Any, ir: ModuleType) -> object:  # data: an Inductor IR loop body
    size = [0] * len(data.get_size())
    if isinstance(data, ir.Reduction):
        if data.reduction_type != "sum":
            raise Unsupported(f"{data.reduction_type} reduction")
        x = data.inner_fn(size, [0] * len(data.get_reduction_size()))
        var = rec._var(f"{rec.prefix}{len(rec.steps)}")
        rec.steps.append(Step(str(var), "sum", (str(x),), ""))
        return var
    if isinstance(data, ir.Pointwise):
        return data.inner_fn(size)
    raise Unsupported(f"{type(data).__name__} in Inductor's lowering")


def _fallback(n: Node, nodes: dict[str, Node], var: dict[str, str], out: str) -> list[Step]:
    """Inductor's forms as torch 2.11 and 2.13 emit them, for when Inductor cannot be asked."""
    name = op_name(n.target)
    a = n.call[0]
    xs = [var[x["node"]] if isinstance(x, dict) and "node" in x else x for x in a]
    x = xs[0] if xs else ""

    def const(k: int, value: float) -> Step:
        return Step(f"{out}_{k}", "constant", (), f"tl.full([], {float(value)!r}, tl.float32)", float(value))

    if name in ("add", "sub", "mul", "div"):
        y = xs[1]
        steps = []
        if not isinstance(y, str):
            steps.append(const(0, y))
            y = steps[-1].var
        expr = f"({x} / {y})" if name == "div" else f"{x} {dict(add='+', sub='-', mul='*')[name]} {y}"
        return [*steps, Step(out, "truediv" if name == "div" else name, (x, y), expr)]
    if name == "neg":
        return [Step(out, "neg", (x,), f"-{x}")]
    if name in ("rsqrt", "exp"):
        return [Step(out, name, (x,), f"libdevice.{name}({x})")]
    if name == "sqrt":
        return [Step(out, "sqrt", (x,), f"tl.sqrt_rn({x})")]
    if name == "sigmoid":
        return [Step(out, "sigmoid", (x,), f"tl.sigmoid({x})")]
    if name == "silu":  # Inductor's decomposition: x / (exp(-x) + 1)
        return [Step(f"{out}_0", "neg", (x,), f"-{x}"),
                Step(f"{out}_1", "exp", (f"{out}_0",), f"libdevice.exp({out}_0)"), const(2, 1.0),
                Step(f"{out}_3", "add", (f"{out}_1", f"{out}_2"), f"{out}_1 + {out}_2"),
                Step(out, "truediv", (x, f"{out}_3"), f"({x} / {out}_3)")]
    if name == "pow" and isinstance(xs[1], (int, float)) and float(xs[1]) in (2.0, 4.0):  # pow_recursive
        if float(xs[1]) == 2.0:
            return [Step(out, "mul", (x, x), f"{x} * {x}")]
        return [Step(f"{out}_0", "mul", (x, x), f"{x} * {x}"),
                Step(out, "mul", (f"{out}_0", f"{out}_0"), f"{out}_0 * {out}_0")]
    if name in ("mean", "sum") and list(a[1]) in ([-1], [len(nodes[a[0]["node"]].shape or []) - 1]):
        if name == "sum":
            return [Step(out, "sum", (x,), "")]
        shape = nodes[a[0]["node"]].shape
        d = shape[-1] if shape else None
        if not isinstance(d, int):
            raise Unsupported(f"mean over a symbolic size {d}")
        return [Step(f"{out}_0", "sum", (x,), ""), const(1, d),
                Step(out, "truediv", (f"{out}_0", f"{out}_1"), f"({out}_0 / {out}_1)")]
    raise Unsupported(f"{n.target} has no fallback form")


_CALL = re.compile(r"\b(libdevice|tl_math|tl\.math|tl|triton\.language)\.(\w+)\(")
_DIV = re.compile(r"\(\s*[\w.]+ / [\w.]+\s*\)")
_NOT_MATH = {"load", "store", "full", "arange", "where", "broadcast_to", "program_id", "zeros", "device_assert",
             "range", "static_range", "reshape", "full_like", "cdiv", "multiple_of", "max_contiguous"}


def math_calls(source: str) -> list[str]:
    """The math of Triton source, in order: library calls (`libdevice.rsqrt`, `tl_math.exp`, `tl.sigmoid`,
    `tl.sum`, `tl.div_rn`) and Triton's own division (`/`), without loads, stores, masks and casts."""
    found = []
    for m in _CALL.finditer(source):
        if m.group(2) not in _NOT_MATH:
            found.append((m.start(), f"{m.group(1).replace('triton.language', 'tl')}.{m.group(2)}"))
    found += [(m.start(), "/") for m in _DIV.finditer(source)]
    return [name for _, name in sorted(found)]
