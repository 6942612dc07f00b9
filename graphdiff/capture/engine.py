"""The engine as every capture starts it: its process state, options and start, and what a loaded engine model
tells (parameter names, packed and unread parameters, its attention kernel, versions). Shared by the single-process
capture (capture/vllm.py) and the tensor-parallel driver and workers (capture/tp.py, capture/tp_worker.py).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphdiff.capture.cpu_kind import cpu_kind, kernel_build
from graphdiff.capture.inductor_hooks import BufferRecorder
from graphdiff.capture.shapes import engine_limits
from graphdiff.capture.vllm_cpu import as_asked
from graphdiff.errors import GraphdiffError, first_line
from graphdiff.models.resolve import architecture, read_config
from graphdiff.records import Capture, Graph, KernelRecord, PackedParam, Shape


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


def _mangle(path: str, kind: str) -> str:
    """Dynamo's placeholder name for a parameter/buffer at `path` relative to the compiled module."""
    *mods, leaf = path.split(".")
    parts = [f"modules_{m}" for m in mods] + [f"{kind}_{leaf}"]
    return "l_self_" + "_".join(parts) + "_"


def input_names(placeholders: list[str], model: torch.nn.Module) -> tuple[dict[str, str], str]:
    """Map Dynamo placeholder names to the engine model's parameter names.

    The compiled callable is some submodule (e.g. `model` inside `Qwen3ForCausalLM`);
    its path prefix is found as the root under which most placeholders resolve.
    Inputs that are not parameters keep a readable name ("input_ids", "positions"); opaque
    weight handles (CPU oneDNN linear) are named after their module with a `#handle` tail.
    """
    best: tuple[int, str, dict[str, str]] = (-1, "", {})
    for root, sub in [("", model), *((n + ".", m) for n, m in model.named_children())]:
        table = {_mangle(n, "parameters"): root + n for n, _ in sub.named_parameters()}
        table.update({_mangle(n, "buffers"): root + n for n, _ in sub.named_buffers()})
        hits = sum(p in table for p in placeholders)
        if hits > best[0]:
            mods = {
                "l_self_" + "_".join(f"modules_{m}" for m in n.split(".")) + "_": root + n
                for n, _ in sub.named_modules()
                if n
            }
            best = (hits, root, {**table, **{"#mod#" + k: v for k, v in mods.items()}})
    _, root, table = best
    prefixes = sorted(((k[5:], v) for k, v in table.items() if k.startswith("#mod#")), key=lambda kv: -len(kv[0]))
    names: dict[str, str] = {}
    for p in placeholders:
        if p in table:
            names[p] = table[p]
            continue
        prefix = next(((k, v) for k, v in prefixes if p.startswith(k)), None)
        if prefix:
            names[p] = f"{prefix[1]}#{p[len(prefix[0]):].rstrip('_')}"
        else:
            names[p] = re.sub(r"^l_|_$", "", p)
    return names, root


def unread_params(model: torch.nn.Module, graphs: list[Graph]) -> list[str]:
    """The engine model's parameters that its compiled graphs never read although they hold something (not all
    zeros): the engine computes something else there than the checkpoint describes, which no rounding alignment
    can close (vLLM CPU's plain softmax top-k router ignores an `e_score_correction_bias`). Only parameters under
    the compiled module count (the LM head runs outside it). A graph input `module#handle` (a packed linear's
    closure, an attribute path) reads that module's parameters whose name ends the handle's path, and a linear's
    weight and bias."""
    read: set[str] = set()
    handles: list[tuple[str, str]] = []
    for graph in graphs:
        for name in graph.inputs.values():
            if "#" in name:
                mod, _, path = name.partition("#")
                handles.append((mod, path))
            else:
                read.add(name)
    roots = {n.split(".", 1)[0] for n in read if "." in n}
    modules = dict(model.named_modules())
    for mod, path in handles:
        owner = modules.get(mod)
        if owner is None:
            continue
        # a handle reached through submodules (`modules_shared_experts_modules_down_proj_cpu_linear...`)
        subs = sorted(((n, f"modules_{'_modules_'.join(n.split('.'))}_") for n, _ in owner.named_modules() if n),
                      key=lambda kv: -len(kv[1]))
        sub, rest = next(((n, path[len(m):]) for n, m in subs if path.startswith(m)), ("", path))
        prefix = f"{mod}.{sub}." if sub else f"{mod}."
        for local, _ in (owner.get_submodule(sub) if sub else owner).named_parameters():
            if rest.endswith(local.replace(".", "_")) or ("linear" in rest and local in ("weight", "bias")):
                read.add(prefix + local)
    unread = []
    for name, param in model.named_parameters():
        if name.split(".", 1)[0] not in roots or name in read or param.numel() < 2 or not param.is_floating_point():
            continue
        if bool(param.detach().abs().amax() > 0):
            unread.append(name)
    return unread


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


def is_model_graph(names: dict[str, str]) -> bool:
    # The model's graph takes its weights as inputs; other compiled helpers (the sampler) don't.
    return any("." in n for n in names.values())


@dataclass
class EngineRun:
    """A started engine with its capture; keep it to score prompts again without recompiling."""

    llm: Any
    capture: Capture
    buffers: dict[str, dict[str, KernelRecord]]  # shape label -> kernel id -> that forward's record
    startup_s: float
    recorders: list[BufferRecorder] = field(default_factory=list)  # one per capture graph, in order (TP: none here)


@dataclass
class EngineOptions:
    """How the engine is started: what a user passes to `vllm serve`, and the capture's own settings."""

    compilation_config: dict[str, Any] = field(default_factory=dict)  # as `vllm serve --compilation-config`
    optimization_level: int | None = None  # as `vllm serve -O N`
    layers: int | None = None  # override num_hidden_layers (hf_overrides)
    debug_dir: Path | None = None  # keep the TORCH_COMPILE_DEBUG dump here
    min_model_len: int = 0  # room for sampling on the same engine after the capture (prompt + tokens)
    min_seqs: int = 0
    tensor_parallel_size: int = 1  # as `vllm serve --tensor-parallel-size`: > 1 captures every rank (capture/tp.py)


def llm_kwargs(model_dir: Path, options: EngineOptions, shapes: list[Shape]) -> dict[str, Any]:
    compilation = dict(options.compilation_config)
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
    """vLLM's LLM(**kwargs), its compilation config honoured as asked (vllm_cpu.as_asked); one line on failure."""
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


def unique_kernel_ids(graph: Graph, index: int) -> dict[str, str]:
    """Inductor restarts its provenance handles at every compile (torch/_inductor/debug.py), so in a piecewise
    compile `<name>:<handle>` repeats across pieces. Graph `index` > 0 gets `<name>:g<index>.<handle>` (in its
    kernels and nodes); returns old -> new. The first graph, and so every single-graph capture, is unchanged."""
    return tag_kernel_ids(graph, f"g{index}") if index else {}


def tag_kernel_ids(graph: Graph, tag: str) -> dict[str, str]:
    """Every kernel id `<name>:<handle>` of `graph` made `<name>:<tag>.<handle>`, in its kernels and nodes; returns
    old -> new."""
    renamed = {}
    for k in graph.kernels:
        name, _, handle = k.id.rpartition(":")
        renamed[k.id] = k.id = f"{name}:{tag}.{handle}"
    for n in graph.nodes:
        if n.kernel in renamed:
            n.kernel = renamed[n.kernel]
    return renamed


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
        # the CPU kind and the vLLM CPU ops build it loaded: the build decides how the op stores BF16
        build = kernel_build()
        if build:
            info.update(build=build, cpu=cpu_kind())
        return info
    return {}


def logits_weight(model: torch.nn.Module) -> str:
    """The weight the engine's logits use: its LM head's own, or the input embedding (a tied model, or one whose
    vLLM class has no LM head and skips the checkpoint's lm_head.weight, as vLLM's Cohere)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embedding = get_embeddings() if callable(get_embeddings) else None
    if isinstance(weight, torch.Tensor) and weight is not getattr(embedding, "weight", None):
        return "lm_head.weight"
    return "input embedding"
