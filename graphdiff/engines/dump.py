"""Engine-side graph from a TORCH_COMPILE_DEBUG directory, so a GPU server's dump can be
analysed on a laptop.

Per compiled graph Inductor writes (TORCH_COMPILE_DEBUG=1):
  fx_graph_transformed.py                         the post-grad FX graph, with `# File:` source lines
  output_code.py                                  the generated kernels and the wrapper that calls them
  inductor_provenance_tracking_node_mappings.json kernel call -> FX nodes it fuses
The graph is read with `ast` (the file is Python), never executed.

A `# File:` line names only a node's innermost frame. Where that frame is a `__torch_function__` passing the op on
(vLLM's parameter subclass: a linear that vLLM CPU runs as `F.linear` on its weight, e.g. where oneDNN has no BF16
GEMM), the line that issued the op is not in the dump: such nodes get no source rather than the pass-through's
line (the live capture names the caller).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from graphdiff.capture.assemble import assemble_graph
from graphdiff.capture.fx import PASS_THROUGH
from graphdiff.engines.base import EngineOptions, cpu_only
from graphdiff.engines.saved import graph_device
from graphdiff.errors import GraphdiffError
from graphdiff.records import Buffers, Capture, EngineSample, Graph, Node, Progress, Shape, Source

REQUIRED = ("fx_graph_transformed.py", "output_code.py", "inductor_provenance_tracking_node_mappings.json")

_ANN_DTYPES = {
    "bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "i64": "int64", "i32": "int32",
    "i16": "int16", "i8": "int8", "u8": "uint8", "b8": "bool", "c64": "complex64",
}
_TORCH_DTYPES = set(_ANN_DTYPES.values()) | {"float8_e4m3fn", "float8_e5m2", "complex128", "uint16", "uint32"}
_FILE = re.compile(r"# File: (.*?):(\d+) in (\S+), code: (.*)$")


def find_graph_dirs(root: Path) -> list[Path]:
    if not root.exists():
        raise GraphdiffError(f"dump directory {root} does not exist")
    if not root.is_dir():
        raise GraphdiffError(f"{root} is not a directory (expected a TORCH_COMPILE_DEBUG output directory)")
    dirs = sorted({p.parent for p in root.rglob("output_code.py")}, key=lambda p: (p.stat().st_mtime, str(p)))
    if not dirs:
        raise GraphdiffError(f"no Inductor graphs under {root}: expected torchinductor/*/output_code.py "
                             "(run the engine with TORCH_COMPILE_DEBUG=1)")
    for d in dirs:
        missing = [f for f in REQUIRED if not (d / f).is_file()]
        if missing:
            raise GraphdiffError(f"partial dump {d}: missing {', '.join(missing)} (was TORCH_COMPILE_DEBUG=1 set?)")
    return dirs


def _annotation_text(ann: ast.expr | None) -> str | None:
    """A string annotation's text (`"bf16[4, 8]"`), or None."""
    return ann.value if isinstance(ann, ast.Constant) and isinstance(ann.value, str) else None


def _parse_annotation(ann: str) -> tuple[str | None, list[int | str] | None]:
    m = re.fullmatch(r"(\w+)\[(.*)\]", ann.strip())
    if not m or m.group(1) not in _ANN_DTYPES:
        return None, None
    dims = [d.strip() for d in m.group(2).split(",") if d.strip()]
    return _ANN_DTYPES[m.group(1)], [int(d) if d.lstrip("-").isdigit() else d for d in dims]


def _target(call: ast.expr) -> str:
    if isinstance(call, ast.Subscript):
        return "getitem"
    assert isinstance(call, ast.Call)
    return ast.unparse(call.func).removeprefix("torch.ops.")


def _names_in(expr: ast.AST, known: set[str]) -> list[str]:
    return [n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id in known]


def _encode(expr: ast.expr, known: set[str]) -> object:
    """An argument of the printed graph, encoded like capture.fx.encode_arg."""
    if isinstance(expr, ast.Name):
        if expr.id in known:
            return {"node": expr.id}
        if expr.id in ("inf", "nan"):
            return {"float": expr.id}
        return {"repr": expr.id}
    if isinstance(expr, (ast.List, ast.Tuple)):
        return [_encode(e, known) for e in expr.elts]
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        inner = _encode(expr.operand, known)
        if isinstance(inner, (int, float)):
            return -inner
        if isinstance(inner, dict) and inner.get("float") == "inf":
            return {"float": "-inf"}
    text = ast.unparse(expr)
    if text.startswith("torch.") and text.removeprefix("torch.") in _TORCH_DTYPES:
        return {"dtype": text.removeprefix("torch.")}
    m = re.fullmatch(r"device\(type='(\w+)'(?:, index=\d+)?\)", text)
    if m:
        return {"device": m.group(1)}
    return {"repr": text}


def _sources(text: str) -> dict[int, Source]:
    """Line number -> the source its `# File:` comment names, for the statements under it (none under a
    pass-through frame)."""
    source_at: dict[int, Source] = {}
    current: Source | None = None
    for i, line in enumerate(text.splitlines(), start=1):
        s = line.strip()
        m = _FILE.search(s)
        if m:
            current = None if m.group(3) == PASS_THROUGH else \
                Source(file=m.group(1), line=int(m.group(2)), function=m.group(3), code=m.group(4))
        elif not s:
            current = None
        elif current is not None:
            source_at[i] = current
    return source_at


def parse_fx_graph(text: str) -> list[Node]:
    """Nodes of an Inductor-printed FX graph (print_readable output)."""
    source_at = _sources(text)
    # print_readable names the class `<lambda>` when the GraphModule had no name.
    tree = ast.parse(re.sub(r"^class <lambda>", "class _Graph", text, count=1, flags=re.M))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward")
    nodes: list[Node] = []
    known: set[str] = set()
    for a in fn.args.args[1:]:
        declared = _annotation_text(a.annotation) or ""
        dtype, shape = _parse_annotation(declared)
        sym = m.group(1) if (m := re.fullmatch(r"Sym\((\w+)\)", declared)) else None
        nodes.append(Node(name=a.arg, op="placeholder", target=a.arg, dtype=dtype, shape=shape, sym=sym))
        known.add(a.arg)
    for stmt in fn.body:
        if isinstance(stmt, ast.Return):
            ins = _names_in(stmt.value, known) if stmt.value else []
            nodes.append(Node(name="output", op="output", target="output", inputs=ins,
                              args=ast.unparse(stmt.value) if stmt.value else "",
                              call=[[_encode(stmt.value, known)] if stmt.value else [], {}]))
            continue
        target: ast.expr
        if isinstance(stmt, ast.AnnAssign):
            target, value, ann = stmt.target, stmt.value, stmt.annotation
        elif isinstance(stmt, ast.Assign):
            target, value, ann = stmt.targets[0], stmt.value, None
        else:
            continue
        if not isinstance(target, ast.Name) or value is None or isinstance(value, ast.Constant):
            continue  # `x = None` frees a buffer; it is not a node
        if not isinstance(value, (ast.Call, ast.Subscript)):
            continue
        ann_text = _annotation_text(ann)
        dtype, shape = _parse_annotation(ann_text) if ann_text is not None else (None, None)
        args = value.args + [k.value for k in value.keywords] if isinstance(value, ast.Call) else [value.value]
        inputs = [n for a in args for n in _names_in(a, known)]
        if isinstance(value, ast.Call):
            call = [[_encode(a, known) for a in value.args], {k.arg: _encode(k.value, known) for k in value.keywords}]
        else:
            call = [[_encode(value.value, known), _encode(value.slice, known)], {}]
        if isinstance(value, ast.Call):
            argtext = ", ".join([ast.unparse(a) for a in value.args] +
                                [f"{k.arg}={ast.unparse(k.value)}" for k in value.keywords])
        else:
            argtext = f"{ast.unparse(value.value)}, {ast.unparse(value.slice)}"
        nodes.append(Node(name=target.id, op="call_function", target=_target(value), inputs=inputs, args=argtext,
                          call=call, dtype=dtype, shape=shape, source=source_at.get(stmt.lineno)))
        known.add(target.id)
    return nodes


def _is_model_graph(nodes: list[Node]) -> bool:
    # Graphs of the model proper trace through the engine's model code; other compiled
    # helpers (e.g. the sampler) do not.
    return any(n.source and any(p in f"/{n.source.file}" for p in ("/model_executor/", "/transformers/models/"))
               for n in nodes)


def import_dump(root: Path, model: str = "") -> Capture:
    graphs: list[Graph] = []
    for d in find_graph_dirs(root):
        try:
            nodes = parse_fx_graph((d / "fx_graph_transformed.py").read_text())
            mapping = json.loads((d / "inductor_provenance_tracking_node_mappings.json").read_text())
            src = (d / "output_code.py").read_text()
        except (SyntaxError, json.JSONDecodeError, UnicodeDecodeError, StopIteration) as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise GraphdiffError(f"unreadable dump {d}: {type(e).__name__}: {first}") from None
        if not _is_model_graph(nodes):
            continue
        origins = mapping.get("cppCodeToPost") or mapping.get("tritonCodeToPost") or {}
        inputs = {n.name: n.name for n in nodes if n.op == "placeholder"}
        graphs.append(assemble_graph(f"engine_graph_{len(graphs)}", nodes, src, origins, {}, {}, inputs))
    if not graphs:
        raise GraphdiffError(f"no model graph under {root}: the compiled graphs there do not run model code")
    return Capture(side="engine", engine="dump", model=model or str(root), architecture="unknown",
                   graphs=graphs, device=graph_device(graphs),
                   notes=["imported from a TORCH_COMPILE_DEBUG dump: parameter names and module paths are not "
                          "recorded there"])


@dataclass
class DumpEngine:
    """A recorded dump behind the engine interface: graphs and kernels, no recorded buffers, nothing to run."""

    capture: Capture
    buffers: Buffers = field(default_factory=dict)
    startup_s: float = 0.0
    name: str = "dump"

    def sample(self, prompts: Sequence[list[int]], *, max_tokens: int, seed: int = 0,
               temperature: float = 1.0) -> list[EngineSample]:
        raise GraphdiffError("a recorded dump cannot sample: measure the gap with a live engine (--engine vllm)")

    def score(self, samples: Sequence[EngineSample]) -> None:
        raise GraphdiffError("a recorded dump cannot score sequences: measure the gap with a live engine")

    def record_routing(self, samples: Sequence[EngineSample], progress: Progress = lambda m: None) -> None:
        return None  # a dump ran no tokens of ours: no routing to record

    def stop(self) -> None:
        return None


def check(options: EngineOptions, shapes: Sequence[Shape] | None = None, capture: bool = False) -> None:
    """A recorded dump is read here, on the CPU: no --device."""
    cpu_only(options.device)


def start(model_dir: Path, shapes: list[Shape], options: EngineOptions, progress: Progress) -> DumpEngine:
    """The dump under `model_dir` (a TORCH_COMPILE_DEBUG directory) read as an engine; `shapes` are what it ran."""
    progress(f"reading the TORCH_COMPILE_DEBUG dump {model_dir}")
    return DumpEngine(import_dump(model_dir))
