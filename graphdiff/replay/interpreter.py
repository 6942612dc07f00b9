"""Re-execute a fragment of a captured graph under a rounding plan (a torch.fx Interpreter).

Two plans matter:
- `eager`: every node is materialized in its declared dtype, as an eager framework does
  (a BF16 op rounds its result) — the "naive" model of a fused kernel;
- `fp32`: every floating value is computed in FP32, and only the nodes in `rounded` are
  rounded to their declared low-precision dtype — what a fused kernel does in registers.
A kernel's stores are rounded to the stored buffer's dtype when its outputs are compared,
not inside the fragment: a kernel may store a value and keep using it unrounded.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx

from graphdiff.ops import DATA_MOVEMENT, op_name
from graphdiff.records import Node
from graphdiff.replay.inductor_math import INDUCTOR_MATH, inductor_math
from graphdiff.replay.sum_order import ordered_op, ordered_sum

LOW = (torch.bfloat16, torch.float16)
SUM = "#sum"  # values[mean + SUM]: a mean's row sum (what a kernel that computes the mean stores)
CPU = torch.device("cpu")  # where every replay runs (run_fragment)


class DtypeOf(Protocol):
    """Node name -> its dtype in the captured graph: a dict, or a view of a graph's index (replay.kernels)."""

    def get(self, name: str, /) -> str | None: ...


def resolve_target(name: str) -> Any:
    """The callable behind a data-model target string ("aten.mul.Tensor", "getitem", ...)."""
    if name == "getitem":
        return operator.getitem
    ns, _, rest = name.partition(".")
    obj: Any = getattr(torch.ops, ns)
    for part in rest.split("."):
        obj = getattr(obj, part)
    return obj


def to_dtype(name: str | None) -> torch.dtype | None:
    return getattr(torch, name) if name else None


def _decode(a: Any, nodes: dict[str, torch.fx.Node], syms: dict[str, int], device: torch.device | None = None) -> Any:
    """A recorded argument as the op takes it; every device as `device` where one is given."""
    if isinstance(a, list):
        return [_decode(x, nodes, syms, device) for x in a]
    if not isinstance(a, dict):
        return a
    if "node" in a:
        return nodes[a["node"]]
    if "dtype" in a:
        return getattr(torch, a["dtype"])
    if "device" in a:
        return device or torch.device(a["device"])
    if "sym" in a:
        return syms[a["sym"]]
    if "float" in a:
        return float(a["float"])
    if "dict" in a:
        return {k: _decode(v, nodes, syms, device) for k, v in a["dict"].items()}
    text = a.get("repr", "")
    if text.startswith("torch.") and hasattr(torch, text[6:]):
        return getattr(torch, text[6:])  # memory formats and layouts
    return None


def fragment_graph(nodes: Iterable[Node], external: Iterable[str], syms: dict[str, int],
                   device: torch.device | None = None) -> torch.fx.GraphModule:
    """An fx graph computing `nodes` (in order) from placeholders named after `external`; its factory ops (full,
    arange, ...) build on `device` where one is given, else on the device the graph recorded."""
    g = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for name in external:
        env[name] = g.placeholder(name)
    outs = []
    for n in nodes:
        args, kwargs = n.call[0], n.call[1]
        fx_node = g.call_function(  # kwargs per key: a keyword named dtype/device/node is not an encoded value
            resolve_target(n.target), tuple(_decode(args, env, syms, device)),
            {k: _decode(v, env, syms, device) for k, v in kwargs.items()},
        )
        fx_node.name = n.name
        env[n.name] = fx_node
        outs.append(fx_node)
    g.output(outs)
    return torch.fx.GraphModule(torch.nn.Module(), g)


class RoundingInterpreter(torch.fx.Interpreter):
    """Runs a fragment under a rounding plan and keeps every node's value."""

    def __init__(self, gm: torch.fx.GraphModule, declared: DtypeOf, plan: str,
                 rounded: set[str] | frozenset[str] = frozenset(), compute: torch.dtype = torch.float32,
                 inductor_math: bool = False, ordered: dict[str, int] | None = None) -> None:
        super().__init__(gm)
        self.inductor_math = inductor_math  # transcendental ops as Inductor's C++ kernels compute them
        self.ordered = ordered or {}  # row reductions (node -> lanes) summed in an engine kernel's order
        self.declared = declared  # node -> its dtype in the captured graph
        self.plan = plan
        self.rounded = rounded
        self.compute = compute
        self.values: dict[str, Any] = {}

    def _up(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.compute:
            return x.to(self.compute)
        if isinstance(x, torch.dtype) and x.is_floating_point:
            return self.compute  # dtype arguments (casts, allocations) compute in FP32 too
        return x

    def _sum(self, name: str, args: tuple) -> torch.Tensor:
        """A mean's row sum in the same order: Inductor stores the sum and divides where it is read."""
        keep = bool(args[2]) if len(args) > 2 else False
        if name in self.ordered:
            return ordered_sum(args[0], args[1], keep, self.ordered[name])
        return torch.sum(args[0], args[1], keepdim=keep)

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function" or self.plan == "eager":
            out = super().run_node(n)
        elif op_name(str(n.target)) in DATA_MOVEMENT:
            out = torch.fx.node.map_aggregate(super().run_node(n), self._up)
            low = to_dtype(self.declared.get(n.name))  # a value read from its buffer (a cat written in place)
            if n.name in self.rounded and isinstance(out, torch.Tensor) and low in LOW:
                out = out.to(low).to(self.compute)
        else:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            args = torch.fx.node.map_aggregate(args, self._up)
            kwargs = torch.fx.node.map_aggregate(kwargs, self._up)
            name = op_name(str(n.target))
            if self.inductor_math and name in INDUCTOR_MATH and len(args) == 1 and not kwargs \
                    and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float32:
                out = inductor_math(name, args[0])
            elif n.name in self.ordered and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float32:
                out = ordered_op(name, args, self.ordered[n.name])
            else:
                assert callable(n.target)  # a call_function node: its target is the op
                out = n.target(*args, **kwargs)
            if name == "mean" and self.plan == "fp32" and isinstance(args[0], torch.Tensor):
                self.values[n.name + SUM] = self._sum(n.name, args)
            low = to_dtype(self.declared.get(n.name))
            if n.name in self.rounded and isinstance(out, torch.Tensor) and low in LOW:
                out = out.to(low).to(self.compute)
        if n.op != "output":
            self.values[n.name] = out
        return out


def bits_equal_fraction(pred: torch.Tensor, real: torch.Tensor) -> float:
    """Fraction of elements whose bits agree once `pred` is stored in `real`'s dtype."""
    if pred.numel() != real.numel():
        return 0.0
    a = pred.detach().to(real.dtype).reshape(-1).contiguous()
    b = real.detach().reshape(-1).contiguous()
    if a.is_floating_point():
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(width), b.view(width)
    return float((a == b).float().mean()) if a.numel() else 1.0


@dataclass
class FragmentRun:
    values: dict[str, Any]
    ok: bool = True
    error: str = ""


def run_fragment(nodes: list[Node], inputs: dict[str, Any], declared: DtypeOf, plan: str,
                 syms: dict[str, int], rounded: set[str] | frozenset[str] = frozenset(),
                 compute: torch.dtype = torch.float32, inductor_math: bool = False,
                 ordered: dict[str, int] | None = None) -> FragmentRun:
    """Execute `nodes` on `inputs` (external values by name) under `plan`, on the CPU: the recorded buffers are read
    there whatever device the engine ran on (a graph recorded on CUDA builds its constants on the CPU too)."""
    names = list(inputs)
    try:
        gm = fragment_graph(nodes, names, syms, CPU)
        interp = RoundingInterpreter(gm, declared, plan, rounded, compute, inductor_math, ordered)
        args = []
        for name in names:
            v = inputs[name]
            if plan == "eager" and isinstance(v, torch.Tensor) and v.is_floating_point():
                v = v.to(to_dtype(declared.get(name)) or v.dtype)  # the naive model reads declared dtypes
            args.append(v)
        interp.run(*args)
    except Exception as e:  # a fragment we cannot re-execute is reported, not fatal
        return FragmentRun(values={}, ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return FragmentRun(values=interp.values)
