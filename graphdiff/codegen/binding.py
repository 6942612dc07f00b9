"""Which HF argument feeds each input of an emitted function and which returned value each output is, two ways: a
module forward's read from its source (its activation parameter, the items of its returned tuple), a function's found
by running the HF function and the emitted code on the same probe tensors (bit-identical, or no binding)."""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch

from graphdiff import sources
from graphdiff.codegen import names
from graphdiff.codegen.fragment import Fragment
from graphdiff.codegen.probes import probe
from graphdiff.records import FunctionSplice, ModuleSplice, Node, walk


def bind_function(frag: Fragment, fn: Callable[..., Any], nodes: dict[str, Node]) -> tuple[list[str], list[int]] | str:
    """Which HF parameter feeds each fragment input, which returned value each output is: found by running
    the HF function and the emitted HF-plan code on the same probe tensors (bit-identical, or no binding)."""
    positional = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    params = [p.name for p in positional]
    if len(params) < len(frag.inputs):
        return f"{frag.function} takes {len(params)} positional parameters, the fragment reads {len(frag.inputs)}"
    if not callable(frag.compiled):
        return f"{frag.key}: no emitted function to bind"
    rest = _settings(positional[len(frag.inputs):])
    if isinstance(rest, str):
        return f"{frag.function} also needs {rest}, which no tensor of the fragment is"
    gen = torch.Generator().manual_seed(0)
    probes = [probe(nodes[i], gen) for i in frag.inputs]
    ours = frag.compiled(*probes, align=frozenset())
    found = []
    for perm in itertools.permutations(range(len(frag.inputs))):  # perm[k]: HF parameter index of input k
        args: list[torch.Tensor | None] = [None] * len(frag.inputs)
        for k, p in enumerate(perm):
            args[p] = probes[k]
        outs = _outputs_reproduced(fn, args, rest, ours)
        if outs is not None:
            found.append(([params[p] for p in perm], outs))
    if found:  # a commutative op binds either way: the one its source line names wins (`residual + out`)
        return max(found, key=lambda f: _named_operands(frag, f[0]))
    return f"no assignment of {frag.function}'s parameters reproduces it bit for bit with the emitted code"


_SETTINGS = {"float": 0.0, "int": 0, "bool": False}  # a setting's value under which the trainer graph was traced


def _settings(params: list[inspect.Parameter]) -> dict[str, Any] | str:
    """Values for a function's parameters after the fragment's tensors that have no default: each a setting its
    annotation says is a float, int or bool (`dropout_add`'s `prob: float, training: bool`), given the value under
    which the trainer graph was traced, in eval mode (0, False: no dropout, as the graph has none); or the first
    parameter that is not such a setting."""
    out: dict[str, Any] = {}
    for p in params:
        if p.default is not p.empty:
            continue
        kind = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        if kind not in _SETTINGS:
            return f"its parameter {p.name}"
        out[p.name] = _SETTINGS[kind]
    return out


def _outputs_reproduced(fn: Callable[..., Any], args: list, rest: dict[str, Any],
                        ours: tuple) -> list[int] | None:
    """Which returned value of `fn(*args, **rest)` each of `ours` is, bit for bit; None where one is not."""
    try:
        with torch.no_grad():
            theirs = fn(*args, **rest)
    except Exception:  # a wrong assignment fails to broadcast: try the next one
        return None
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    outs: list[int] = []
    for o in ours:
        hit = [j for j, t in enumerate(theirs) if isinstance(t, torch.Tensor) and t.shape == o.shape
               and t.dtype == o.dtype and torch.equal(t, o) and j not in outs]
        if not hit:
            return None
        outs.append(hit[0])
    return outs


def _named_operands(frag: Fragment, bound: list[str]) -> int:
    """How many fragment inputs an op reads as an operand its source line names by the parameter bound to it (`out =
    residual + out`: the add's first operand is `residual`)."""
    score = 0
    for n in frag.nodes:
        try:
            expr = ast.parse(n.source.code.strip()).body[0] if n.source is not None else None
        except (SyntaxError, IndexError):
            continue
        value = getattr(expr, "value", None)
        if not isinstance(value, ast.BinOp):
            continue
        operands = [o.id if isinstance(o, ast.Name) else "" for o in (value.left, value.right)]
        for j, a in enumerate(n.call[0][:2]):
            k = frag.inputs.index(a["node"]) if isinstance(a, dict) and a.get("node") in frag.inputs else -1
            score += int(k >= 0 and operands[j] == bound[k])
    return score


METADATA = frozenset({"dtype", "device", "shape", "ndim"})  # attributes that read a tensor's metadata, not its values


def _forward_def(frag: Fragment) -> ast.FunctionDef | None:
    """The module's `forward` as written: the definition in its installed source file holding the fragment's
    lines."""
    src = next((n.source for n in frag.nodes if n.source is not None and n.source.function == "forward"), None)
    if src is None:
        return None
    tree = sources.parse_source(src.file)  # the installed package's file, found by module
    if tree is None:
        return None
    return next((f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "forward"
                 and f.lineno <= src.line <= (f.end_lineno or f.lineno)), None)


def _spans(node: ast.stmt, line: int) -> bool:
    return node.lineno <= line <= (node.end_lineno or node.lineno)


def _statement(fn: ast.FunctionDef, line: int) -> ast.stmt | None:
    """The innermost statement of `fn` on source line `line`."""
    found = [s for s in ast.walk(fn) if isinstance(s, ast.stmt) and s is not fn and _spans(s, line)]
    return min(found, key=lambda s: (s.end_lineno or s.lineno) - s.lineno, default=None)


def _values_read(tree: ast.AST) -> set[str]:
    """The names whose values `tree` reads: every name it loads but those it reads only metadata of (`x.dtype`)."""
    meta = {id(a.value) for a in ast.walk(tree) if isinstance(a, ast.Attribute) and a.attr in METADATA}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and id(n) not in meta}


def _module_argument(frag: Fragment, fn: ast.FunctionDef) -> str:
    """The forward parameter the activation input is: the one parameter whose values the lines reading it read
    (a rotary embedding's `position_ids`, beside an `x` it reads only the dtype of); "0", the first parameter (as
    for a norm's `hidden_states`), where that is the first or not one parameter."""
    params = [a.arg for a in (fn.args.posonlyargs + fn.args.args)[1:]]
    act = next(i for i in frag.inputs if i not in frag.params)
    read: set[str] = set()
    for n in frag.nodes:
        if act in n.inputs and n.source is not None and (stmt := _statement(fn, n.source.line)) is not None:
            read |= _values_read(stmt) & set(params)
    return read.pop() if len(read) == 1 and params and read != {params[0]} else "0"


def _variable(frag: Fragment, output: str, nodes: dict[str, Node], ret: ast.Return) -> str | None:
    """The variable an output's value is assigned to before the return statement (`cos` for `cos.to(x.dtype)`):
    the first line, walking back from the output, that assigns a simple variable."""
    inside = {n.name for n in frag.nodes}
    for name in itertools.chain([output], walk([output], lambda n: [i for i in nodes[n].inputs if i in inside])):
        src = nodes[name].source
        if src is not None and not _spans(ret, src.line) and (var := names.assigned(src.code)) is not None:
            return var
    return None


def _returned_positions(frag: Fragment, fn: ast.FunctionDef, nodes: dict[str, Node]) -> list[int] | str:
    """Where each output of a module forward returning a tuple goes in it: the item of its one return statement
    that reads the output's variable; or why that cannot be told."""
    returns = [r for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value is not None]
    if len(returns) != 1 or not isinstance(returns[0].value, ast.Tuple):
        return f"{frag.module_class}.forward has {len(frag.outputs)} outputs and not one `return` of a tuple"
    reads = [_values_read(item) for item in returns[0].value.elts]
    positions: list[int] = []
    for o in frag.outputs:
        var = _variable(frag, o, nodes, returns[0])
        hits = [k for k, r in enumerate(reads) if var in r]
        if len(hits) != 1 or hits[0] in positions:
            return f"cannot tell which value {frag.module_class}.forward returns {o} as ({var or 'no variable'})"
        positions.append(hits[0])
    return positions


def _bind_module(frag: Fragment, splice: ModuleSplice | FunctionSplice, nodes: dict[str, Node]) -> None:
    """A module forward's activation argument and, for a forward returning a tuple, each output's place in it; read
    from the forward's source (one activation, one output where it cannot be read: its first argument, returned)."""
    fn = _forward_def(frag)
    if fn is None:
        if len(frag.outputs) > 1:
            frag.problems.append(f"{frag.module_class}.forward's source is not readable: cannot tell which returned "
                                 "value each output is")
        return
    arg = _module_argument(frag, fn)
    splice.inputs = [f"param:{frag.params[i]}" if i in frag.params else f"arg:{arg}" for i in frag.inputs]
    if len(frag.outputs) > 1:
        positions = _returned_positions(frag, fn, nodes)
        if isinstance(positions, str):
            frag.problems.append(positions)
        else:
            splice.outputs = positions


def bind(frag: Fragment, splice: ModuleSplice | FunctionSplice, nodes: dict[str, Node]) -> None:
    """Which forward or function argument feeds each input, which returned value each output is."""
    splice.inputs = [f"param:{frag.params[i]}" if i in frag.params else "arg:0" for i in frag.inputs]
    splice.outputs = [0]
    if frag.target == "module":
        _bind_module(frag, splice, nodes)
    elif frag.target == "function":
        owner, name = frag.function.rsplit(".", 1)
        fn = getattr(importlib.import_module(owner), name, None)
        if not callable(fn):  # a method (XIELU's _xielu_python), not a module-level function the runtime can swap
            frag.problems.append(f"{name} is not a module-level function of {owner} (a method of "
                                 f"{frag.module_class or 'its module'}?): the runtime replaces functions by name")
            return
        bound = bind_function(frag, fn, nodes)
        if isinstance(bound, str):
            frag.problems.append(bound)
        else:
            splice.inputs, splice.outputs = [f"arg:{p}" for p in bound[0]], bound[1]


def argument_names(frag: Fragment, splice: ModuleSplice | FunctionSplice) -> list[str]:
    """The emitted function's argument names: the bound HF parameters (a module forward's activation bound to a
    parameter other than its first is named after it: `position_ids`)."""
    bound = [i.removeprefix("arg:") for i in splice.inputs]
    args = names.arguments(frag, bound)
    if frag.target != "module":
        return args
    return [b if s.startswith("arg:") and b != "0" else a for a, b, s in zip(args, bound, splice.inputs)]
