"""Recorded buffers as fragment values (symbolic sizes evaluated, a reused buffer bound in memory order) and a replay's
values scored against the kernel's recorded stores: the fraction bit-identical, closeness, the FP32 error."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

import torch

from graphdiff.records import Graph, KernelRecord, Node
from graphdiff.replay.interpreter import LOW, SUM, bits_equal_fraction

_SYM_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def sym_value(expr: str, syms: dict[str, int]) -> int | None:
    """A symbolic size's value: a symbol (`s27`) or an integer expression of symbols as Dynamo prints it (`s27 + 1`,
    a SymInt node's result or a dimension); None where a symbol is unknown or the expression is of another form."""
    if expr in syms:
        return syms[expr]

    def value(e: ast.expr) -> int | None:
        if isinstance(e, ast.Constant) and isinstance(e.value, int):
            return e.value
        if isinstance(e, ast.Name):
            return syms.get(e.id)
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
            v = value(e.operand)
            return -v if v is not None else None
        if isinstance(e, ast.BinOp) and type(e.op) in _SYM_OPS:
            a, b = value(e.left), value(e.right)
            if a is None or b is None or (b == 0 and isinstance(e.op, ast.Mod | ast.FloorDiv)):
                return None
            return _SYM_OPS[type(e.op)](a, b)
        return None

    try:
        return value(ast.parse(expr, mode="eval").body)
    except SyntaxError:
        return None


def numel(shape: list[int | str] | None, syms: dict[str, int]) -> int | None:
    if shape is None:
        return None
    total = 1
    for d in shape:
        if isinstance(d, str):
            v = sym_value(d, syms)
            if v is None:
                return None
            d = v
        total *= int(d)
    return total


def as_node_value(t: Any, node: Node, syms: dict[str, int]) -> Any:
    """A recorded buffer as the value of the node it holds: where their shapes differ (a buffer Inductor reuses
    through `reinterpret_tensor`, e.g. a query projection's output read back as the [1, heads, tokens, dim] view an
    in-place RoPE kernel writes), the buffer's elements in memory order, which is the node's contiguous layout."""
    if not isinstance(t, torch.Tensor) or node.shape is None:
        return t
    shape = [d if isinstance(d, int) else sym_value(d, syms) for d in node.shape]
    if list(t.shape) == shape or any(d is None for d in shape) or t.numel() != numel(node.shape, syms):
        return t
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d] if t.shape[d] > 1 else 0)
    return t.permute(order).contiguous().reshape([int(d) for d in shape if d is not None])


def bind_symbols(graph: Graph, record: KernelRecord) -> dict[str, int]:
    """Symbolic sizes (the token count) from the kernel's scalar arguments and its inputs' real shapes."""
    syms = {name: int(v) for name, v in record.get("scalars", {}).items() if isinstance(v, int)}
    nodes = graph.node_map()
    for n in (nodes[b] for b in record["in"] if b in nodes):
        t = record["in"].get(n.name)
        if n.shape and isinstance(t, torch.Tensor) and len(n.shape) == t.dim():
            for d, real in zip(n.shape, t.shape):
                if isinstance(d, str):
                    syms.setdefault(d, int(real))
    return syms


def score(run_vals: dict[str, Any], outputs: dict[str, str], record: KernelRecord) -> tuple[float, int]:
    """Bit-identical fraction over the kernel's low-precision stores (the rounding claim).

    FP32 stores (e.g. a reduction's partial result) are compared by `fp32_error` instead:
    their last bits depend on accumulation order, which is not what this model predicts."""
    total, good = 0, 0.0
    for buf, node in outputs.items():
        real = record["out"].get(buf)
        pred = run_vals.get(node)
        if not isinstance(real, torch.Tensor) or not isinstance(pred, torch.Tensor) or real.dtype not in LOW:
            continue
        good += bits_equal_fraction(pred, real) * real.numel()
        total += real.numel()
    return (good / total if total else 0.0), total


def placement_closeness(values: dict[str, Any], node: str, real: torch.Tensor) -> float:
    """How close a store is to a node's value; an FP32 store of a mean may hold its row sum (Inductor's mean stores
    the sum and divides where it is read: q/k norms' sums of squares, placed by value, are the sums)."""
    pred = values[node]
    best = closeness(pred, real)
    if real.dtype == torch.float32 and isinstance(values.get(node + SUM), torch.Tensor):
        best = max(best, closeness(values[node + SUM], real))
    return best


def closeness(pred: torch.Tensor, real: torch.Tensor) -> float:
    """Higher is closer: bit agreement for low-precision stores, -relative error for FP32 ones."""
    if pred.numel() != real.numel():
        return float("-inf")
    if real.dtype in LOW:
        return bits_equal_fraction(pred, real)
    diff = (pred.double().reshape(-1) - real.double().reshape(-1)).norm()
    return -float(diff / real.double().norm().clamp_min(1e-30))


def fp32_error(run_vals: dict[str, Any], outputs: dict[str, str], record: KernelRecord) -> float:
    """Largest relative error over the FP32 stores; a store of a mean may hold its row sum (Inductor's mean
    stores the sum and divides where it is read), whichever the store is closer to."""
    worst = 0.0
    for buf, node in outputs.items():
        real = record["out"].get(buf)
        if not isinstance(real, torch.Tensor) or real.dtype != torch.float32:
            continue
        errors = []
        for pred in (run_vals.get(node), run_vals.get(node + SUM)):
            if isinstance(pred, torch.Tensor) and pred.numel() == real.numel():
                diff = (pred.double().reshape(-1) - real.double().reshape(-1)).abs()
                errors.append(float((diff / real.double().reshape(-1).abs().clamp_min(1e-30)).max()))
        worst = max(worst, min(errors, default=0.0))
    return worst
