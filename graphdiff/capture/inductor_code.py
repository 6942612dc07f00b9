"""Read Inductor's generated wrapper module (output_code.py): kernels and their calls.

Both the in-process capture (the module Inductor just compiled) and the dump import
(output_code.py in a TORCH_COMPILE_DEBUG directory) read the same text, so they agree
on which buffers each kernel call loads and stores. Which FX nodes a kernel fuses is
*not* taken from here: in-process it comes from the scheduler, from a dump from the
provenance mapping Inductor writes beside this file.

Generated kernels name their pointer parameters by role (in_ptr*, out_ptr*,
in_out_ptr*) in both the C++ and the Triton backend; that naming is what tells loads
from stores.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from graphdiff.records import BufferArg, Role

# C++ and Triton element types -> torch dtype names.
_DTYPES = {
    "at::BFloat16": "bfloat16", "bfloat16": "bfloat16", "bf16": "bfloat16",
    "at::Half": "float16", "half": "float16", "fp16": "float16",
    "float": "float32", "fp32": "float32", "double": "float64", "fp64": "float64",
    "int64_t": "int64", "i64": "int64", "int32_t": "int32", "i32": "int32",
    "bool": "bool", "i1": "bool", "int8_t": "int8", "i8": "int8", "uint8_t": "uint8", "u8": "uint8",
}

_CPP_DEF = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(", re.M)
_TRITON_DEF = re.compile(r"^(\w+) = async_compile\.triton\('(\w+)'", re.M)
_CPP_SIG = re.compile(r'extern "C"\s+void\s+kernel\(([^)]*)\)', re.S)
_TRITON_SIG = re.compile(r"^def (\w+)\(([^)]*)\):", re.M)
_TRITON_TYPES = re.compile(r"'signature': \{([^}]*)\}")
_HANDLE = re.compile(r"# \[Provenance debug handles\] (\S+)")


@dataclass
class KernelDef:
    name: str
    backend: str  # "cpp" or "triton"
    params: list[tuple[str, str | None]]  # (parameter name, element dtype or None for scalars)
    code: str


@dataclass
class KernelCall:
    id: str  # "<name>:<handle>", matching Inductor's provenance mapping
    name: str  # kernel name or extern op ("torch.ops._C.onednn_mm.default", "extern_kernels.mm")
    extern: bool
    args: list[str | None]  # base buffer/input name per positional argument (None: not a buffer)
    result: str | None = None  # name assigned from an extern call's return value
    kwargs: dict[str, str | None] = field(default_factory=dict)


def param_role(param: str) -> Role:
    if param.startswith("in_out_ptr"):
        return "inout"
    if param.startswith("out_ptr"):
        return "out"
    if param.startswith("in_ptr"):
        return "in"
    return "scalar"


def _string_literal_after(src: str, start: int) -> str:
    """The first triple-quoted string literal after `start` (the kernel source)."""
    m = re.compile(r"r?'''(.*?)'''", re.S).search(src, start)
    return m.group(1) if m else ""


def parse_kernel_defs(src: str) -> dict[str, KernelDef]:
    defs: dict[str, KernelDef] = {}
    for m in _CPP_DEF.finditer(src):
        code = _string_literal_after(src, m.end())
        sig = _CPP_SIG.search(code)
        params: list[tuple[str, str | None]] = []
        for decl in (sig.group(1).split(",") if sig else []):
            decl = decl.strip()
            pname = re.split(r"[\s*&]+", decl)[-1]
            ctype = decl[: -len(pname)].replace("const", "").replace("*", "").strip()
            params.append((pname, _DTYPES.get(ctype) if "*" in decl else None))
        defs[m.group(1)] = KernelDef(m.group(1), "cpp", params, code)
    for m in _TRITON_DEF.finditer(src):
        code = _string_literal_after(src, m.end())
        declared = _TRITON_TYPES.search(code)
        types = dict(re.findall(r"'(\w+)': '\*?(\w+)'", declared.group(1) if declared else ""))
        sig = _TRITON_SIG.search(code)
        params = []
        for pname in (p.strip().split(":")[0].strip() for p in (sig.group(2).split(",") if sig else [])):
            if not pname:
                continue
            ptype = types.get(pname)
            params.append((pname, _DTYPES.get(ptype) if ptype and param_role(pname) != "scalar" else None))
        defs[m.group(1)] = KernelDef(m.group(1), "triton", params, code)
    return defs


def _base_name(expr: ast.expr) -> str | None:
    """The buffer an argument refers to: `buf3`, or the base of reinterpret_tensor(buf3, ...)."""
    if isinstance(expr, ast.Name):
        return expr.id
    views = ("reinterpret_tensor", "as_strided")
    if isinstance(expr, ast.Call) and expr.args and ast.unparse(expr.func).endswith(views):
        return _base_name(expr.args[0])
    return None


def _call_of(stmt: ast.stmt) -> tuple[ast.Call, str | None] | None:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        return stmt.value, None
    if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
        target = stmt.targets[0]
        return stmt.value, target.id if isinstance(target, ast.Name) else None
    return None


def _statements_after(lines: list[str], i: int, limit: int = 6) -> list[ast.stmt]:
    """The next few statements after line i (a statement may span several lines), up to the next handle."""
    out: list[ast.stmt] = []
    j = i + 1
    while j < len(lines) and len(out) < limit and not _HANDLE.search(lines[j]):
        text = lines[j].strip()
        if not text or text.startswith("#"):
            j += 1
            continue
        k = j
        while True:
            try:
                out.extend(ast.parse(text).body)
                break
            except SyntaxError:
                k += 1
                if k >= len(lines) or k - j > 50:
                    return out
                text += "\n" + lines[k].strip()
        j = k + 1
    return out


def parse_kernel_calls(src: str, defs: dict[str, KernelDef] | None = None) -> list[KernelCall]:
    """Kernel calls in the wrapper's call(), in order, each tagged by its provenance handle.

    Requires Inductor's provenance tracking (TORCH_COMPILE_DEBUG=1 or INDUCTOR_PROVENANCE=1),
    which writes `# [Provenance debug handles] name:N` before every kernel call (the Triton wrapper
    may put a `stream0 = get_raw_stream(0)` between the two: the call is the statement that calls
    `name` or `name.run`).
    """
    defs = parse_kernel_defs(src) if defs is None else defs
    lines = src.splitlines()
    calls: list[KernelCall] = []
    for i, line in enumerate(lines):
        m = _HANDLE.search(line)
        if not m:
            continue
        handle = m.group(1)
        name = handle.rsplit(":", 1)[0]
        for stmt in _statements_after(lines, i):
            found = _call_of(stmt)
            if found is None or ast.unparse(found[0].func) not in (name, f"{name}.run"):
                continue
            call, result = found
            calls.append(KernelCall(
                id=handle, name=name, extern=name not in defs, args=[_base_name(a) for a in call.args],
                result=result, kwargs={kw.arg: _base_name(kw.value) for kw in call.keywords if kw.arg},
            ))
            break
    return calls


def arg_role(param: str, dtype: str | None) -> Role:
    """A kernel parameter's role; parameters without an element type are scalars (sizes)."""
    return param_role(param) if dtype is not None else "scalar"


def kernel_args(call: KernelCall, kdef: KernelDef | None) -> list[BufferArg]:
    """Pair a generated kernel call's arguments with the kernel's parameters (role, dtype)."""
    if kdef is None:
        return [BufferArg(name=a or "?", role="in") for a in call.args]
    out = []
    for arg, (pname, dtype) in zip(call.args, kdef.params):
        out.append(BufferArg(name=arg or "?", role=arg_role(pname, dtype), dtype=dtype))
    return out
