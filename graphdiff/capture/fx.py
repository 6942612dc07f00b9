"""torch.fx nodes -> data-model nodes (shared by the engine and the training capture)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.fx

from graphdiff.records import NODE_OPS, Graph, Node, NodeOp, Source

# Graph inputs that carry data rather than weights; every other mapped placeholder is a parameter/buffer.
DATA_INPUTS = frozenset({"input_ids", "positions", "position_ids", "inputs_embeds", "attention_mask"})
# A frame in this function passes an op on (a torch function mode, or a tensor subclass such as vLLM's
# BasevLLMParameter); the op was issued by its caller.
PASS_THROUGH = "__torch_function__"

_TORCH_DIR = str(Path(torch.__file__).parent) + "/"
# One frame of a formatted traceback; the code line is absent for generated code.
_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)'
    r'(?:\n[ \t]+(?!File ")(?P<code>\S.*))?'
)


def target_name(target: Any) -> str:
    """A stable readable name for an FX node target: "aten.mul.Tensor", "getitem", "torch.nn.functional.silu"."""
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)  # namespace.op.overload
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if name is None:
        return str(target)
    if module in (None, "operator", "_operator", "builtins"):
        return name
    return f"{module}.{name}"


def _fmt(a: Any) -> str:
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt(v)}" for k, v in a.items()) + "}"
    return repr(a) if isinstance(a, str) else str(a)


def _tensor_info(val: Any) -> tuple[str | None, list[int | str] | None]:
    dtype = getattr(val, "dtype", None)  # a Tensor, FakeTensor or TensorMetadata; tuples have none
    if not isinstance(dtype, torch.dtype):
        return None, None
    shape = [s if isinstance(s, int) else str(s) for s in val.shape]
    return str(dtype).removeprefix("torch."), shape


def _source(stack_trace: str | None) -> Source | None:
    """The innermost frame outside torch: the library or model line that issued the op (a `__torch_function__` that
    passes ops on is not where they were issued: the patch's rounded residual sums' mode, or vLLM's parameter
    subclass that a linear's weight still is where vLLM CPU runs it as `F.linear`)."""
    frames = [m for m in _FRAME.finditer(stack_trace or "")
              if not m["file"].startswith(_TORCH_DIR) and m["function"] != PASS_THROUGH]
    if not frames:
        return None
    m = frames[-1]
    return Source(file=m["file"], line=int(m["line"]), code=(m["code"] or "").strip(), function=m["function"])


def _module_path(raw: str) -> str:
    """Dotted module path; Dynamo spells it "L['self'].model.layers[0].mlp"."""
    path = re.sub(r"^L\['[^']*'\]\.?", "", raw)
    return re.sub(r"\[(\d+)\]", r".\1", path)


def _module(meta: dict) -> tuple[str | None, str | None]:
    stack = meta.get("nn_module_stack")
    if not stack:
        return None, None
    path, typ = list(stack.values())[-1]  # innermost module last
    type_name = typ.__name__ if isinstance(typ, type) else str(typ).rsplit(".", 1)[-1]
    return _module_path(path), type_name


def encode_arg(a: Any) -> Any:
    """One FX argument as JSON (see Node.call)."""
    if isinstance(a, torch.fx.Node):
        return {"node": a.name}
    if isinstance(a, (list, tuple)):
        return [encode_arg(x) for x in a]
    if isinstance(a, dict):
        return {"dict": {str(k): encode_arg(v) for k, v in a.items()}}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": a.type}
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {"sym": str(a)}
    if isinstance(a, float) and (a != a or a in (float("inf"), float("-inf"))):
        return {"float": str(a)}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    return {"repr": str(a)}


def _opcode(node: torch.fx.Node) -> NodeOp:
    op = node.op
    if op not in NODE_OPS:  # call_module / call_method: never in the ATen graphs Dynamo and AOT autograd hand on
        raise ValueError(f"fx node {node.name}: opcode {op} in an ATen graph")
    return op


def node_from_fx(node: torch.fx.Node, input_names: dict[str, str]) -> Node:
    """Convert one FX node; `input_names` maps placeholder names to what they hold (HF names)."""
    inputs: list[str] = []

    def visit(n: torch.fx.Node) -> torch.fx.Node:
        inputs.append(n.name)
        return n

    torch.fx.node.map_arg((node.args, node.kwargs), visit)  # visits in argument order, keeps repeats
    args = [_fmt(a) for a in node.args] + [f"{k}={_fmt(v)}" for k, v in node.kwargs.items()]
    dtype, shape = _tensor_info(node.meta.get("val", node.meta.get("tensor_meta")))
    module, module_type = _module(node.meta)
    held = input_names.get(node.name) if node.op == "placeholder" else None
    return Node(
        name=node.name,
        op=_opcode(node),
        target=target_name(node.target),
        inputs=inputs,
        args=", ".join(args),
        call=[encode_arg(list(node.args)), {k: encode_arg(v) for k, v in node.kwargs.items()}],
        dtype=dtype,
        shape=shape,
        sym=str(val) if isinstance(val := node.meta.get("val"), torch.SymInt) else None,
        source=_source(node.meta.get("stack_trace")),
        module=module,
        module_type=module_type,
        param=held if held not in DATA_INPUTS else None,
        decomposed_from=_decomposed_from(node),
    )


def _decomposed_from(node: torch.fx.Node) -> str | None:
    """The ATen op an engine node was decomposed from (post-grad graphs record it)."""
    orig = node.meta.get("original_aten")
    if orig is None or node.op != "call_function":
        return None
    name = target_name(orig)
    return name if name != target_name(node.target) else None


def graph_from_fx(gm: torch.fx.GraphModule, input_names: dict[str, str], name: str) -> Graph:
    return Graph(name=name, nodes=[node_from_fx(n, input_names) for n in gm.graph.nodes], inputs=dict(input_names))
