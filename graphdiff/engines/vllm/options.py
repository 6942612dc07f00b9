"""`--compilation-config` checked against vLLM's own CompilationConfig before any engine starts.

Importing `vllm.config` takes seconds (it imports the engine's whole package tree), so the installed vLLM's
config source is read instead: the fields of CompilationConfig, PassConfig and DynamicShapesConfig (as the
dataclasses declare them, init=False fields left out: vLLM refuses them as extra fields) and the members of its
mode enums. A key vLLM does not have, or a value of the wrong type or outside an enum, is one GraphdiffError; what
passes here the engine still validates itself.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from pathlib import Path

from graphdiff.errors import GraphdiffError

CLASSES = ("CompilationConfig", "PassConfig", "DynamicShapesConfig")
ENUMS = ("CompilationMode", "CUDAGraphMode", "DynamicShapesType")
NESTED = {"PassConfig", "DynamicShapesConfig"}


def _source() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    roots = list(spec.submodule_search_locations or []) if spec else []
    found = [Path(r) / "config" / "compilation.py" for r in roots if (Path(r) / "config" / "compilation.py").is_file()]
    return found[0] if found else None


def _init_field(node: ast.AnnAssign) -> bool:
    """A dataclass field the constructor takes (not ClassVar, not field(init=False))."""
    if "ClassVar" in ast.unparse(node.annotation):
        return False
    call = node.value
    return not (isinstance(call, ast.Call) and any(k.arg == "init" and isinstance(k.value, ast.Constant)
                                                   and k.value.value is False for k in call.keywords))


def _enum_members(cls: ast.ClassDef) -> dict[str, object]:
    members: dict[str, object] = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                members[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:  # (FULL, NONE): members named by other members
                members[node.targets[0].id] = None
    return members


@functools.cache
def schema() -> tuple[dict[str, dict[str, str]], dict[str, dict[str, object]]] | None:
    """{class: {field: annotation}}, {enum: {member: value}} of the installed vLLM; None without vLLM."""
    path = _source()
    if path is None:
        return None
    tree = ast.parse(path.read_text())
    fields: dict[str, dict[str, str]] = {}
    enums: dict[str, dict[str, object]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        if cls.name in CLASSES:
            fields[cls.name] = {n.target.id: ast.unparse(n.annotation) for n in cls.body
                                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                                and not n.target.id.startswith("_") and _init_field(n)}
        elif cls.name in ENUMS:
            enums[cls.name] = _enum_members(cls)
    return fields, enums


def _type_problem(value: object, annotation: str, enums: dict[str, dict[str, object]]) -> str | None:
    """Why `value` (from JSON) is not an `annotation`; None when it is (or the annotation is not a simple one)."""
    options = [a.strip() for a in annotation.split("|")]
    if value is None:
        return None  # vLLM fills None with its default, or refuses it itself
    problems = [_one_type(value, a, enums) for a in options]
    return None if None in problems else problems[0]


def _one_type(value: object, a: str, enums: dict[str, dict[str, object]]) -> str | None:
    simple: dict[str, type | tuple[type, ...]] = {"bool": bool, "str": str, "Path": str, "float": (int, float),
                                                  "int": int}
    if a in simple:
        ok = isinstance(value, simple[a]) and not (a in ("int", "float") and isinstance(value, bool))
        return None if ok else f"expected {a}, got {value!r}"
    if a.startswith(("list", "set")):
        return None if isinstance(value, list) else f"expected a list, got {value!r}"
    if a.startswith("dict") or a in NESTED:
        return None if isinstance(value, dict) else f"expected an object, got {value!r}"
    if a in enums:
        members = enums[a]
        ints = [v for v in members.values() if isinstance(v, int)]
        if (isinstance(value, str) and value.upper() in members) or (type(value) is int and value in ints):
            return None
        choices = ", ".join(f"{v} {k}" if isinstance(v, int) else k for k, v in members.items())
        return f"{value!r} is not a {a} (choose {choices})"
    if a.startswith("Literal["):
        parsed = ast.literal_eval(a.removeprefix("Literal")) if a.count("[") == 1 else []
        allowed = tuple(parsed) if isinstance(parsed, list | tuple) else (parsed,)
        if not allowed:
            return None
        return None if value in allowed else f"expected one of {', '.join(map(repr, allowed))}, got {value!r}"
    return None


def _check_fields(given: dict, cls: str, where: str, option: str) -> None:
    found = schema()
    if found is None:
        return
    fields, enums = found
    known = fields.get(cls, {})
    for key, value in given.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; vLLM's {cls} has {', '.join(sorted(known))}"
            raise GraphdiffError(f"{option}: {where}{key!r} is not a field of vLLM's {cls}{hint}")
        annotation = known[key]
        problem = _type_problem(value, annotation, enums)
        if problem:
            raise GraphdiffError(f"{option}: {where}{key}: {problem}")
        if annotation in NESTED and isinstance(value, dict):
            _check_fields(value, annotation, f"{where}{key}.", option)


def check_compilation_config(config: dict, option: str = "--compilation-config") -> None:
    """Refuse keys and values vLLM's CompilationConfig would refuse at engine start; "optimization_level" is
    graphdiff's record of -O, allowed beside them."""
    _check_fields({k: v for k, v in config.items() if k != "optimization_level"}, "CompilationConfig", "", option)
