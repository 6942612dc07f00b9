"""The CPU kind that decides vLLM CPU's kernels, and running as a lesser kind (the other path, for tests).

vLLM CPU picks its kernels from three facts it reads through torch:
- AMX tiles (`torch.cpu._is_amx_tile_supported`): the `amx` attention kernel and `_C.weight_packed_linear`
  for weights up to 1 MiB; without them the `vec` attention and oneDNN GEMMs;
- AVX-512 BF16 (`torch.cpu._is_avx512_bf16_supported`): which build of its C++ ops it loads, `_C`, else
  `_C_AVX512` (or `_C_AVX2` without AVX-512), whose FP32 -> BF16 stores truncate (round toward zero) where `_C`
  rounds to nearest even;
- oneDNN picks its GEMM kernels from the CPU as well (`ONEDNN_MAX_CPU_ISA` caps it); Inductor compiles its own
  kernels with `-mavx512bf16` only where the same torch predicate says so, and its AMX ones after `_init_amx`.

`GRAPHDIFF_CPU_KIND=avx512` (or `avx512_bf16`, `avx2`) makes this process and every process it starts behave as
that kind of CPU: the three torch predicates answer as that CPU would, oneDNN is capped at its ISA. A kind can
only be forced downwards (an AVX-512 CPU cannot run AMX tiles). Inductor's generated kernels round to nearest even on
every x86 kind, with or without the BF16 instructions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from graphdiff.errors import GraphdiffError

KINDS = ("avx2", "avx512", "avx512_bf16", "amx")  # each has every feature of the kinds before it
FORCE_ENV = "GRAPHDIFF_CPU_KIND"
ONEDNN_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16", "amx": "AVX512_CORE_AMX"}
# the vLLM CPU ops library each kind loads (vllm/platforms/cpu.py import_kernels)
KERNEL_BUILD = {"avx2": "_C_AVX2", "avx512": "_C_AVX512", "avx512_bf16": "_C", "amx": "_C"}
_SITE = Path(__file__).with_name("forced_kind")  # its sitecustomize applies the forced kind in new processes
_NATIVE: dict[str, bool] = {}
_PREDICATES = ("_is_amx_tile_supported", "_init_amx", "_is_avx512_bf16_supported", "_is_avx512_supported")
_ENV = ("ONEDNN_MAX_CPU_ISA", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR")  # what apply_forced_kind sets


def _features() -> dict[str, bool]:
    """The CPU's own answers (kept from before any forcing)."""
    if not _NATIVE:
        _NATIVE.update(amx=bool(torch.cpu._is_amx_tile_supported()),
                       bf16=bool(torch.cpu._is_avx512_bf16_supported()),
                       avx512=bool(torch.cpu._is_avx512_supported()))
    return _NATIVE


def native_kind() -> str:
    f = _features()
    return "amx" if f["amx"] else "avx512_bf16" if f["bf16"] else "avx512" if f["avx512"] else "avx2"


def forced_kind() -> str | None:
    """The kind asked for with GRAPHDIFF_CPU_KIND, checked against this CPU; None when not asked."""
    asked = os.environ.get(FORCE_ENV, "").strip()
    if not asked:
        return None
    if asked not in KINDS:
        raise GraphdiffError(f"{FORCE_ENV}={asked}: not a CPU kind; one of {', '.join(KINDS)}")
    native = native_kind()
    if KINDS.index(asked) > KINDS.index(native):
        raise GraphdiffError(f"{FORCE_ENV}={asked}: this CPU is {native}, a kind can only be forced downwards")
    return asked


def cpu_kind() -> str:
    """The kind this process runs as: the forced one, else the CPU's own."""
    return forced_kind() or native_kind()


def apply_forced_kind() -> str | None:
    """Make this process, and the processes it starts, run as the forced kind; before vLLM loads its ops (and
    before oneDNN's first GEMM, for its ISA cap). Does nothing when no kind is forced. Returns the kind.

    Process-wide by design: the CLI applies it once for its whole process and its children (forced_kind_applied
    puts it back, for in-process use)."""
    kind = forced_kind()
    if kind is None:
        return None
    rank = KINDS.index(kind)
    torch.cpu._is_amx_tile_supported = lambda: False if rank < KINDS.index("amx") else _features()["amx"]
    if rank < KINDS.index("amx"):  # Inductor asks for AMX tiles through it before it picks its AMX kernels
        torch.cpu._init_amx = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: rank >= KINDS.index("avx512_bf16")
    torch.cpu._is_avx512_supported = lambda: rank >= KINDS.index("avx512")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ISA[kind])
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _kind_cache_dir(kind)
    path = os.environ.get("PYTHONPATH", "")
    if str(_SITE) not in path.split(os.pathsep):  # worker processes vLLM spawns (tensor parallelism)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SITE), path) if p)
    return kind


def _kind_cache_dir(kind: str) -> str:
    """Inductor's cache directory for a process posing as `kind`: its own. Inductor keys cached code by graph and
    config, not by the vector ISA it was generated for; a kernel generated for 8 lanes and loaded by a 16-lane
    process (or the reverse) reads and writes past its buffers."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    suffix = f"-as-{kind}"
    return base if base.endswith(suffix) else base + suffix


@contextlib.contextmanager
def forced_kind_applied() -> Iterator[str | None]:
    """`apply_forced_kind` for the duration of a block; torch's CPU predicates and the environment are put back on
    exit. What read them meanwhile keeps what it read (oneDNN's ISA cap, the vLLM ops library a block loaded)."""
    predicates = {n: getattr(torch.cpu, n) for n in _PREDICATES if hasattr(torch.cpu, n)}
    env = {k: os.environ.get(k) for k in _ENV}
    try:
        yield apply_forced_kind()
    finally:
        for name, fn in predicates.items():
            setattr(torch.cpu, name, fn)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def kernel_build(device: str = "cpu") -> str:
    """The vLLM ops library loaded in this process for the engine's `device`: on "cpu" the CPU build (`_C`,
    `_C_AVX512`, `_C_AVX2`); on "cuda" `_C` names the CUDA ops, never a CPU build: the registry keys an op by
    (device, build), so a capture records both. '' if none is loaded."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ""
    for line in maps.splitlines():
        name = line.rsplit("/", 1)[-1]
        if "/vllm/" in line and name.startswith("_C") and name.endswith(".so"):
            return name.split(".", 1)[0]
    return ""


def stores_truncate(build: str, device: str = "cpu") -> bool:
    """Does this vLLM CPU ops build store FP32 -> BF16 by truncation? (`_C_AVX512`, `_C_AVX2`: no AVX-512 BF16
    conversion instruction; measured against the real ops in tests/test_opaque_ops_engine.py.) No CUDA build does."""
    return device == "cpu" and build in ("_C_AVX512", "_C_AVX2")


def store_like(values: torch.Tensor, build: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP32 values stored in `dtype` as the vLLM CPU ops `build` stores them: truncated (BF16 on `_C_AVX512` /
    `_C_AVX2`) or rounded to nearest even."""
    return stored(values, stores_truncate(build), dtype)


def stored(values: torch.Tensor, truncate: bool, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP32 values stored in `dtype`: BF16 by truncation where `truncate`, else rounded to nearest even."""
    if dtype == torch.bfloat16 and truncate:
        return truncate_to_bf16(values.float()).to(dtype)
    return values.to(dtype)


# the one definition of this store: a generated patch carries its source (codegen.prelude)
def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """FP32 `x` stored in BF16 by truncation (round toward zero), kept in FP32: its low 16 bits cleared, so every
    value is exact in BF16. Not differentiable (a bit view)."""
    return (x.view(torch.int32) & -65536).view(torch.float32)


def posable_kinds() -> list[str]:
    """Every kind below this CPU's own, highest first: the other kernel paths a test run can force here (an `amx`
    CPU poses as avx512_bf16, avx512 and avx2; an `avx2` one as none)."""
    return list(reversed(KINDS[:KINDS.index(native_kind())]))
