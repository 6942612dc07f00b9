"""The names generated code gives its arguments and values: by role, as the model's own code names them.

Arguments: a replaced function's own parameter names; for a module forward, the parameter attribute (`weight`) of
each parameter input and the forward's first parameter (`hidden_states`) for the activation. Values: the Python
variable the node's source line assigns (`q_embed`), `<name>_<op>` for the line's intermediates (`q_embed_mul`),
the op's name where the line assigns no simple variable (`rsqrt`). Every name is a fresh identifier, and so is
every name the kernels derive from it (`<name>_ptr`, `d_<name>`), so no two values share a variable.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import keyword
import re

from graphdiff import sources
from graphdiff.codegen import prelude
from graphdiff.codegen.fragment import Fragment
from graphdiff.ops import op_name
from graphdiff.records import Node

# What the emitted code reads besides its own values: modules, the prelude's functions, the builtins it calls, and
# the fixed locals of the PyTorch functions, the Triton wrappers and kernels (names starting with `_`, the
# helpers and kernels, are never given: see `identifier`).
RESERVED = frozenset({
    "torch", "F", "triton", "tl", "libdevice", "tl_math", "math", "os", "float", "int", "bool", "range", "frozenset",
    "str", "tuple", "list", "dict", "len", "align", "lanes", "flags", "row", "cols", "mask", "pid", "ok", "valid",
    "r", "g", "y", "D", "BLOCK", "RPP", "n_rows", "out_ptr", "gout_ptr", "OUT_BF16",
    *(part.__name__ for part in prelude.PARTS),
})
INDEXED = re.compile(r"^(a|A|o|acc|g|GM)\d+$|^g\d+_ptr$")  # region flags, kernel accumulators, gradient modes
DERIVED = ("{}_ptr", "{}_rows", "{}_s", "d_{}")  # a kernel input's pointer, row offsets, stride; an adjoint
ASSIGNMENT = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)")  # `name = ...`, `name: T = ...`


def identifier(base: str) -> str:
    """`base` as a plain identifier: no leading underscore (the module's helpers), not starting with a digit."""
    name = re.sub(r"\W", "_", base).strip("_")
    return name if name and not name[0].isdigit() else f"value_{name}".rstrip("_")


class Namer:
    """Hands out fresh names: `base`, else `base_1`, `base_2`, ... ; each name and its derived forms are taken."""

    def __init__(self, taken: set[str] | None = None) -> None:
        self.taken = set(taken or ())

    def _free(self, name: str) -> bool:
        return (name not in self.taken and name not in RESERVED and not INDEXED.match(name)
                and not keyword.iskeyword(name))

    def claim(self, base: str) -> str:
        base = identifier(base)
        for k in itertools.count():
            name = base if k == 0 else f"{base}_{k}"
            forms = [name, *(form.format(name) for form in DERIVED)]
            if all(self._free(f) for f in forms):
                self.taken.update(forms)
                return name
        raise AssertionError("unreachable")

    @staticmethod
    def holding(names: dict[str, str]) -> Namer:
        """A namer that hands out none of `names`' variables (nor their derived forms)."""
        return Namer({form.format(x) for x in names.values() for form in ("{}", *DERIVED)})


def assigned(code: str) -> str | None:
    """The simple variable a source line assigns (`q_embed = ...` -> `q_embed`), or None."""
    m = ASSIGNMENT.match(code)
    return m.group(1) if m and not keyword.iskeyword(m.group(1)) else None


def _parameter_in_source(file: str, cls: str) -> str | None:
    """The first parameter (after self) of the `forward` class `cls` defines in `file`, read from its source."""
    tree = sources.parse_source(file)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            fwd = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
            args = fwd.args.posonlyargs + fwd.args.args if fwd is not None else []
            return args[1].arg if len(args) > 1 else None
    return None


def _parameter_of_class(file: str, cls: str) -> str | None:
    """The first parameter (after self) of `cls.forward`, inherited or not, from the installed module `file` is."""
    dotted = sources.dotted_module(file)
    if dotted is None or dotted.split(".")[0] not in ("transformers", "torch"):
        return None
    try:
        forward = getattr(importlib.import_module(dotted), cls).forward
        params = [p.name for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return params[1] if len(params) > 1 else None


def arguments(frag: Fragment, bound: list[str] | None = None) -> list[str]:
    """The emitted function's argument names, in `frag.inputs` order: the HF function's parameters feeding each
    input (`bound`, from the binding; `arg0`, ... before it), or the module forward's parameter attributes and its
    activation parameter."""
    if frag.target == "function":
        return list(bound) if bound else [f"arg{k}" for k in range(len(frag.inputs))]
    file = next((n.source.file for n in frag.nodes if n.source is not None and n.source.function == "forward"), "")
    act = None
    if file and frag.module_class:
        act = _parameter_in_source(file, frag.module_class) or _parameter_of_class(file, frag.module_class)
    return [frag.params.get(i, act or "x") for i in frag.inputs]


def _line(n: Node) -> tuple | None:
    return (n.source.file, n.source.line, n.source.code) if n.source is not None and n.source.code else None


def value_names(frag: Fragment, args: list[str]) -> dict[str, str]:
    """Each fragment input's variable (`args`, deduplicated) and each node's (graph node name -> identifier). A node
    whose value another node of its own source line reads is an intermediate of that line's assignment."""
    namer = Namer()
    names = {i: namer.claim(a) for i, a in zip(frag.inputs, args)}
    line = {n.name: _line(n) for n in frag.nodes}
    inner = {i for n in frag.nodes for i in n.inputs if line[n.name] is not None and line.get(i) == line[n.name]}
    for n in frag.nodes:
        op = identifier(op_name(n.target))
        target = assigned(n.source.code) if n.source is not None else None
        names[n.name] = namer.claim(op if target is None else f"{target}_{op}" if n.name in inner else target)
    return names
