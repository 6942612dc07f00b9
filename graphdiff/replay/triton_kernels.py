"""Run the Triton kernels of an Inductor TORCH_COMPILE_DEBUG dump in Triton's interpreter, on the CPU.

A dump's `output_code.py` holds each kernel's source (`async_compile.triton('name', '''source''')`) and the
`call()` wrapper that allocates the buffers and launches the kernels. Here each kernel is loaded without its
Inductor heuristics decorator (only `@triton.jit`), launched with the first config Inductor's own heuristics give
for its size hints, and the wrapper is executed on the CPU (externs: CPU `mm`, math SDPA), recording every kernel
call's buffers as the replay reads them (`KernelRecord`: inputs before the call, stores after it). The dump's code
is executed (its kernels, its wrapper, its decorator arguments): run only a dump one would run.

Triton's interpreter must be on before a kernel is decorated: `TRITON_INTERPRET=1` is set before triton is
imported (the caller's duty; `interpreter_on` checks it). Three things the interpreter does unlike the GPU are
changed while a kernel runs (`gpu_numerics`):
- fp32 -> bf16 conversions (a store to a BF16 buffer, `.to(tl.bfloat16)`) truncate in the interpreter, even with
  `fp_downcast_rounding="rtne"` (that path rounds half up); the GPU rounds to nearest even: converted by torch here;
- `tl.sum` is numpy's pairwise sum there; here a halving tree over the block (x[:n/2] + x[n/2:], down to one), the
  value a warp's butterfly shuffle gives when each thread holds one element of the row (`sum_order.ordered_sum`
  with lanes = R0_BLOCK); a GPU thread holding several elements adds them first, so the real order depends on the
  kernel's layout (size per thread, warps), which this does not read;
- `libdevice.*` (stubs that return None in the interpreter) map to numpy (`LIBDEVICE`); the GPU calls CUDA's
  libdevice: `rsqrt` is `__nv_rsqrtf` (an approximate reciprocal square root), numpy `1 / sqrt` rounds twice;
  `exp` is `__nv_expf` (within 2 ulp), numpy's float32 `exp` has its own error; `tl_math.sin`/`cos` lower to
  the GPU's own approximations, numpy's float32 `sin`/`cos` here.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import math
import os
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphdiff.records import KernelRecord
from graphdiff.replay.sum_order import ordered_sum

KINDS = ("pointwise", "persistent_reduction", "reduction")
_RUN = re.compile(r"^(\s*)(\w+)\.run\((.*), stream=\w+\)\s*$")
_HANDLE = re.compile(r"# \[Provenance debug handles\] (\S+)$")


def interpreter_on() -> bool:
    """Whether kernels decorated now run in Triton's interpreter (TRITON_INTERPRET=1 before triton's import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class TritonKernel:
    """One kernel of a dump: its source without Inductor's decorator, that decorator's kind and arguments."""

    name: str
    source: str  # `@triton.jit` source, importable on a CPU
    kind: str  # pointwise, persistent_reduction or reduction
    heuristics: dict[str, Any]  # the decorator's keyword arguments (size_hints, triton_meta, inductor_meta, ...)

    @property
    def params(self) -> list[str]:
        """The launch arguments by name, in order (constexpr block sizes excluded)."""
        sig = self.heuristics["triton_meta"]["signature"]
        return [p for p, t in sig.items() if t != "constexpr" or p in self.heuristics["triton_meta"]["constants"]]


def kernel_sources(output_code: str) -> dict[str, str]:
    """Kernel name -> its source, for every `async_compile.triton(...)` of an output_code.py."""
    tree = ast.parse(output_code)
    return {str(st.value.args[0].value): str(st.value.args[1].value) for st in tree.body
            if isinstance(st, ast.Assign) and isinstance(st.value, ast.Call)
            and ast.unparse(st.value.func) == "async_compile.triton"
            and isinstance(st.value.args[0], ast.Constant) and isinstance(st.value.args[1], ast.Constant)}


def _decorator_kwargs(dec: ast.Call) -> dict[str, Any]:
    from torch._inductor.runtime.hints import DeviceProperties, ReductionHint, TileHint

    scope = {"DeviceProperties": DeviceProperties, "ReductionHint": ReductionHint, "TileHint": TileHint,
             "__file__": "", "set": set}
    return {k.arg: eval(ast.unparse(k.value), scope) for k in dec.keywords if k.arg}  # noqa: S307 (dump's literals)


def parse_kernel(name: str, source: str) -> TritonKernel:
    """The kernel's `@triton.jit` source (Inductor's heuristics decorator and GPU driver switch removed) and the
    decorator's arguments."""
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    dec = next(d for d in fn.decorator_list if isinstance(d, ast.Call)
               and ast.unparse(d.func).startswith("triton_heuristics."))
    kind = ast.unparse(dec.func).removeprefix("triton_heuristics.")
    if kind not in KINDS:
        raise ValueError(f"{name}: Inductor heuristics {kind!r} not supported (only {', '.join(KINDS)})")
    drop = set(range(dec.lineno - 1, dec.end_lineno or dec.lineno))  # 0-based lines of `@triton_heuristics...(`
    lines = [line for i, line in enumerate(source.splitlines())
             if i not in drop and "set_driver_to_gpu()" not in line]
    return TritonKernel(name, "\n".join(lines) + "\n", kind, _decorator_kwargs(dec))


def launch_config(kernel: TritonKernel) -> dict[str, int]:
    """The block sizes Inductor launches with: the first config its own heuristics give for the kernel's size
    hints (on a GPU it autotunes among them and records no choice). A pointwise kernel computes each element
    alone, so its blocks do not change a bit; a persistent reduction's R0_BLOCK is in its code (the whole row);
    a looped reduction's R0_BLOCK comes from this config (the lanes it accumulates in)."""
    from torch._inductor.runtime import triton_heuristics

    kw = {k: v for k, v in kernel.heuristics.items() if k != "filename"}
    configs = getattr(triton_heuristics, kernel.kind)(**kw, return_configs=True)
    return {k: int(v) for k, v in configs[0].kwargs.items()}


def grid(kernel: TritonKernel, args: dict[str, Any], blocks: dict[str, int]) -> tuple[int, int, int]:
    """Inductor's launch grid: one program per XBLOCK (and YBLOCK) of the non-reduced sizes."""
    def blocks_of(axis: str) -> int:
        n = int(args.get(f"{axis}numel", kernel.heuristics["triton_meta"]["constants"].get(f"{axis}numel", 1)))
        return math.ceil(n / blocks.get(f"{axis.upper()}BLOCK", 1))

    kind = kernel.heuristics["inductor_meta"].get("grid_type", "Grid1D")
    if kind == "Grid1D":
        return blocks_of("x"), 1, 1
    if kind == "Grid2D":
        return blocks_of("x"), blocks_of("y"), 1
    raise ValueError(f"{kernel.name}: grid {kind} not supported")


def load_jit(kernel: TritonKernel, workdir: Path) -> Any:
    """The kernel as a `@triton.jit` function (imported from a file: Triton reads a kernel's source from it),
    its `libdevice` mapped to numpy."""
    path = workdir / f"{kernel.name}.py"
    path.write_text(kernel.source)
    spec = importlib.util.spec_from_file_location(f"graphdiff_triton_{kernel.name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.libdevice = LIBDEVICE  # type: ignore[attr-defined]
    return getattr(module, kernel.name)


def _numpy_op(f: Callable[..., np.ndarray]) -> Callable[..., Any]:
    """A libdevice function computed by numpy on the interpreter's arrays, in the first argument's dtype."""
    def op(*xs: Any) -> Any:
        import triton.language as tl  # type: ignore[import-untyped]
        from triton.runtime.interpreter import TensorHandle  # type: ignore[import-untyped]

        x = xs[0]
        out = f(*(a.handle.data for a in xs)).astype(x.handle.data.dtype)
        return tl.core.tensor(TensorHandle(out, x.handle.dtype.scalar), x.type)
    return op


LIBDEVICE = types.SimpleNamespace(
    exp=_numpy_op(np.exp), rsqrt=_numpy_op(lambda x: 1 / np.sqrt(x)), sqrt=_numpy_op(np.sqrt),
    tanh=_numpy_op(np.tanh), log=_numpy_op(np.log), log1p=_numpy_op(np.log1p), expm1=_numpy_op(np.expm1),
    sin=_numpy_op(np.sin), cos=_numpy_op(np.cos), pow=_numpy_op(np.power), abs=_numpy_op(np.abs),
)


def _to_bf16_rtne(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, rounded to nearest even (what the GPU's cvt.rn.bf16.f32 does)."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(x.shape)


def _tree_sum(data: np.ndarray, axis: int, keepdims: bool) -> np.ndarray:
    """A float sum over `axis` as a halving tree (zero-padded to a power of two): the replay's `ordered_sum` with
    one lane per element, so the interpreter and the replay sum in one order by one implementation."""
    x = np.moveaxis(data, axis, -1)
    width = 1 << max(x.shape[-1] - 1, 0).bit_length()
    out = ordered_sum(torch.from_numpy(np.ascontiguousarray(x)), [-1], False, width).numpy()
    return np.expand_dims(out, axis) if keepdims else out


@contextlib.contextmanager
def gpu_numerics(rtne: bool = True, tree_sum: bool = True) -> Iterator[None]:
    """While kernels run: bf16 conversions rounded to nearest even (`rtne`), `tl.sum` of floats as a halving tree
    (`tree_sum`); either off leaves the interpreter's own (truncation, numpy's pairwise sum)."""
    import triton.language as tl
    from triton.runtime import interpreter  # type: ignore[import-untyped]

    convert, reduce_sum = interpreter._convert_float, interpreter.ReduceOps.sum

    def convert_rtne(data: np.ndarray, src: Any, dst: Any, rounding: Any) -> np.ndarray:
        if src == tl.float32 and dst == tl.bfloat16:
            return _to_bf16_rtne(data)
        return convert(data, src, dst, rounding)

    def tree_sum_op(self: Any, input: Any) -> Any:
        data = input.handle.data
        if not np.issubdtype(data.dtype, np.floating) or self.axis is None:
            return reduce_sum(self, input)
        return self.to_tensor(_tree_sum(data, self.axis, self.keep_dims), input.dtype)

    if rtne:
        interpreter._convert_float = convert_rtne
    if tree_sum:
        interpreter.ReduceOps.sum = tree_sum_op
    try:
        yield
    finally:
        interpreter._convert_float, interpreter.ReduceOps.sum = convert, reduce_sum


def _role(param: str) -> str:
    return "inout" if param.startswith("in_out_ptr") else "out" if param.startswith("out_ptr") else "in"


@dataclass
class Launcher:
    """Launches a dump's kernels in the interpreter and records each call's buffers, by kernel id."""

    kernels: dict[str, TritonKernel]
    jit: dict[str, Any]
    blocks: dict[str, dict[str, int]]
    records: dict[str, KernelRecord]
    rtne: bool = True
    tree_sum: bool = True

    def __call__(self, kernel_id: str, name: str, names: list[str], values: list[Any]) -> None:
        k = self.kernels[name]
        args = dict(zip(k.params, values))
        ptrs = {p: (buf, v) for p, buf, v in zip(k.params, names, values) if isinstance(v, torch.Tensor)}
        ins = {buf: v.clone() for p, (buf, v) in ptrs.items() if _role(p) in ("in", "inout")}
        scalars = {p: v for p, v in args.items() if not isinstance(v, torch.Tensor)}
        with gpu_numerics(self.rtne, self.tree_sum):
            self.jit[name][grid(k, args, self.blocks[name])](**args, **self.blocks[name])
        outs = {buf: v.clone() for p, (buf, v) in ptrs.items() if _role(p) in ("out", "inout")}
        self.records[kernel_id] = {"in": ins, "out": outs, "scalars": scalars, "launch": dict(self.blocks[name])}


def _wrapper_source(output_code: str) -> str:
    """The `call()` wrapper as a plain function on CPU tensors: launches go to `_launch(id, name, names, args)`,
    the cuDNN attention to `_attention`, CUDA device guards away."""
    tree = ast.parse(output_code)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "call")
    lines = output_code.splitlines()[fn.lineno - 1:fn.end_lineno]
    out, handle = [], ""
    for line in lines:
        if m := _HANDLE.search(line):
            handle = m.group(1)
        if m := _RUN.match(line):
            indent, name, args = m.groups()
            names = [a.strip() for a in args.split(",")]
            line = f"{indent}_launch({handle!r}, {name!r}, {names!r}, [{args}])"
        line = line.replace("torch.cuda._DeviceGuard(0)", "_nullcontext()").replace("torch.cuda.set_device(0)", "pass")
        line = line.replace("torch.ops.aten._scaled_dot_product_cudnn_attention.default(", "_attention(")
        out.append(line)
    return textwrap.dedent("\n".join(out)).replace("def call(self, args)", "def call(args)")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: bool,
               scale: float | None = None, **_: Any) -> tuple[torch.Tensor]:
    """cuDNN SDPA's output in its layout ([batch, heads, tokens, dim] stored tokens-major), computed by the CPU."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return (out.transpose(1, 2).contiguous().transpose(1, 2),)


def _assert_size_stride(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], *_: Any) -> None:
    if tuple(t.shape) != tuple(size) or tuple(t.stride()) != tuple(stride):
        raise AssertionError(f"size/stride {tuple(t.shape)}/{t.stride()}, wrapper expects {size}/{stride}")


def run_dump(output_code: str, inputs: list[torch.Tensor], workdir: Path, rtne: bool = True,
             tree_sum: bool = True) -> dict[str, KernelRecord]:
    """Execute the dump's wrapper on the CPU with its kernels in Triton's interpreter: kernel id -> the call's
    record. `inputs`: the graph's inputs in order (input ids, then the parameters as Dynamo lifted them);
    `rtne`, `tree_sum`: `gpu_numerics`."""
    if not interpreter_on():
        raise RuntimeError("Triton's interpreter is off: set TRITON_INTERPRET=1 before triton is imported")
    kernels = {n: parse_kernel(n, s) for n, s in kernel_sources(output_code).items()}
    launch = Launcher(kernels, {n: load_jit(k, workdir) for n, k in kernels.items()},
                      {n: launch_config(k) for n, k in kernels.items()}, {}, rtne, tree_sum)
    scope: dict[str, Any] = {
        "torch": torch, "_launch": launch, "_attention": _attention, "_nullcontext": contextlib.nullcontext,
        "empty_strided_cuda": lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype).zero_(),
        "reinterpret_tensor": lambda t, size, stride, offset: t.as_strided(size, stride, t.storage_offset() + offset),
        "assert_size_stride": _assert_size_stride, "assert_alignment": lambda *a: None,
        "get_raw_stream": lambda i: None,
        "extern_kernels": types.SimpleNamespace(mm=lambda a, b, out: torch.mm(a, b, out=out)),
    }
    exec(compile(_wrapper_source(output_code), "<output_code call>", "exec"), scope)  # noqa: S102 (the dump's code)
    scope["call"](list(inputs))
    return launch.records
