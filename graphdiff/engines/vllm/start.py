"""vLLM as every capture starts it: its process state, its LLM arguments and start, and what only a loaded vLLM
model tells (packed parameters, its attention kernel, versions). Shared by the single-process capture
(engines/vllm/capture.py) and the tensor-parallel driver and workers (engines/vllm/tp.py, engines/vllm/tp_worker.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphdiff.capture.cpu_kind import cpu_kind, kernel_build
from graphdiff.capture.inductor_hooks import BufferRecorder
from graphdiff.capture.shapes import engine_limits
from graphdiff.engines.base import EngineOptions
from graphdiff.engines.vllm.cpu import as_asked
from graphdiff.errors import GraphdiffError, first_line
from graphdiff.models.resolve import architecture, read_config
from graphdiff.records import MATMUL_REDUCED_FACT, Capture, KernelRecord, PackedParam, Shape


def engine_env(work_dir: Path, debug_dir: Path | None = None) -> dict[str, str]:
    """Environment for an in-process, fresh-compile, small-footprint engine."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process, so the hooks see the compile
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(work_dir / "vllm-cache"),
        "VLLM_DISABLE_COMPILE_CACHE": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(work_dir / "inductor-cache"),
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",  # a cache hit skips the scheduler: no partition
        "INDUCTOR_PROVENANCE": "1",
    }
    if debug_dir is not None:
        env.update(TORCH_COMPILE_DEBUG="1", TORCH_COMPILE_DEBUG_DIR=str(debug_dir))
    return env


@contextlib.contextmanager
def engine_process_state(env: dict[str, str], debug_dir: Path | None = None) -> Iterator[None]:
    """The engine's environment and compile settings while it starts and runs; everything back afterwards.

    vLLM's CPU worker may bind OpenMP threads and memory: the thread count and CPU affinity are restored too.
    The user's own KV-cache size and log level win over ours."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    env = {k: v for k, v in env.items() if not (k == "VLLM_CPU_KVCACHE_SPACE" and k in os.environ)}
    env.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))
    saved = {k: os.environ.get(k) for k in env}
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    patches: dict[str, Any] = {"force_disable_caches": True}
    if debug_dir is not None:
        patches["trace.enabled"] = True
    os.environ.update(env)
    try:
        with inductor_config.patch(patches), dynamo_config.patch(
                {"debug_dir_root": str(debug_dir)} if debug_dir is not None else {}):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_num_threads(threads)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)


def packed_params(model: torch.nn.Module) -> list[PackedParam]:
    """Engine parameters that pack several HF ones, from the model's own packing table."""
    mapping: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    out: list[PackedParam] = []
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        sizes = getattr(mod, "output_sizes", None)
        if leaf not in mapping or not sizes or len(sizes) != len(mapping[leaf]):
            continue
        parent = name.rsplit(".", 1)[0] + "." if "." in name else ""
        for pname in ("weight", "bias"):
            if getattr(mod, pname, None) is None:
                continue
            parts, start = [], 0
            for sub, size in zip(mapping[leaf], sizes):
                parts.append((f"{parent}{sub}.{pname}", start, start + int(size)))
                start += int(size)
            out.append(PackedParam(engine=f"{name}.{pname}", dim=0, parts=parts))
    return out


def versions() -> dict[str, str]:
    import transformers
    import vllm

    from graphdiff import __version__

    return {"torch": torch.__version__, "vllm": vllm.__version__, "transformers": transformers.__version__,
            "graphdiff": __version__}


@dataclass
class EngineRun:
    """A started engine with its capture; keep it to score prompts again without recompiling."""

    llm: Any
    capture: Capture
    buffers: dict[str, dict[str, KernelRecord]]  # shape label -> kernel id -> that forward's record
    startup_s: float
    recorders: list[BufferRecorder] = field(default_factory=list)  # one per capture graph, in order (TP: none here)


def llm_kwargs(model_dir: Path, options: EngineOptions, shapes: list[Shape]) -> dict[str, Any]:
    compilation = options.config
    if torch.cuda.is_available():
        # A replayed CUDA graph bypasses the Python kernel wrappers: record with plain launches.
        compilation.setdefault("cudagraph_mode", "NONE")
    # No prefix caching: a recorded forward must compute its whole prompt, not a cached prefix's suffix.
    limits = engine_limits(shapes)
    limits["max_model_len"] = max(limits["max_model_len"], -(-(options.min_model_len + 1) // 64) * 64)
    limits["max_num_seqs"] = max(limits["max_num_seqs"], options.min_seqs)
    kwargs: dict[str, Any] = dict(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                                  enforce_eager=False, enable_prefix_caching=False, **limits)
    if compilation:
        kwargs["compilation_config"] = compilation
    if options.optimization_level is not None:
        kwargs["optimization_level"] = options.optimization_level
    if options.layers is not None:
        kwargs["hf_overrides"] = {"num_hidden_layers": options.layers}
    return kwargs


def start_llm(model_dir: Path, kwargs: dict[str, Any], forced_off: list[str]) -> Any:
    """vLLM's LLM(**kwargs), its compilation config honoured as asked (cpu.as_asked); one line on failure."""
    import vllm
    from vllm import LLM
    from vllm.model_executor.models.registry import ModelRegistry

    arch = architecture(read_config(model_dir))
    if arch not in ModelRegistry.get_supported_archs():
        raise GraphdiffError(f"vLLM {vllm.__version__} does not run {arch} ({model_dir}): no model of that name in its "
                             "registry")
    try:
        with as_asked(kwargs.pop("compilation_config", {}), forced_off) as cc:
            if cc:
                kwargs["compilation_config"] = cc
            return LLM(**kwargs)
    except Exception as e:  # vLLM raises many types; one informative line is what the user needs
        raise GraphdiffError(f"vLLM could not start on {model_dir}: {first_line(e)[:400]}") from e


def kernel_facts(device: str) -> dict[str, str]:
    """What decides the engine's opaque kernels besides its attention backend, as the registry keys them
    (analysis.opaque: op, device, build): the vLLM ops build it loaded; on a CPU the CPU kind (the build decides how
    an op stores BF16); on CUDA torch's cuBLAS reduced-precision flag (whether a BF16 GEMM may round partial sums)."""
    build = kernel_build(device)
    facts = {"build": build} if build else {}
    if device == "cpu" and build:
        facts["cpu"] = cpu_kind()
    if device == "cuda":
        flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        facts[MATMUL_REDUCED_FACT] = str(bool(flag)).lower()
    return facts


def attention_info(model: torch.nn.Module) -> dict[str, str]:
    """The engine's attention kernel, as its first attention layer reports it (its internals are opaque to the
    scan; graphdiff.analysis.opaque knows what some backends round inside)."""
    for mod in model.modules():
        backend = getattr(mod, "attn_backend", None)
        impl = getattr(mod, "impl", None)
        if backend is None or impl is None:
            continue
        info = {"backend": str(backend.get_name()), "impl": type(impl).__name__,
                "device": str(next((p.device.type for p in model.parameters()), "cpu"))}
        for key in ("isa", "head_size", "kv_cache_dtype"):
            value = getattr(mod, key, None)
            if value is not None:
                info[key] = str(value)
        info.update(kernel_facts(info["device"]))
        return info
    return {}


