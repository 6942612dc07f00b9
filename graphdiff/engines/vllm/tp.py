"""Tensor parallelism: the engine started with `tensor_parallel_size` > 1 and captured inside its workers.

vLLM runs each rank in its own worker process (the `mp` executor), each compiling its own graph on its own shards of
the weights. The driver (this module, in the engine child process) starts vLLM with graphdiff's worker extension
(graphdiff.engines.vllm.tp_worker: mixed into every worker, it installs the Inductor hooks when vLLM builds the worker,
before its compile), then, through `collective_rpc`, builds each rank's graphs and recorders, arms them for each
shape, and has each rank save its capture to files (which ends the capture in the worker). The ranks' captures
become one `Capture`: rank 0's graphs keep their names, rank r's are `rank<r>/<name>` with kernel ids
`<kernel>:r<r>.<handle>` (unique across ranks), and one buffers file holds every rank's records.

On CPU, vLLM binds each rank's OpenMP threads to one NUMA node unless told otherwise; with fewer NUMA nodes than
ranks it refuses to start ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"). The bind
(`VLLM_CPU_OMP_THREADS_BIND`, one set of cores per rank) is then derived from this process's CPU affinity.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphdiff.capture.engine_model import tag_kernel_ids
from graphdiff.engines.base import EngineOptions
from graphdiff.engines.saved import load_on_cpu
from graphdiff.engines.vllm.start import EngineRun, engine_env, engine_process_state, llm_kwargs, start_llm, versions
from graphdiff.errors import GraphdiffError
from graphdiff.records import Buffers, Capture, Graph, PackedParam, Shape

WORKER_EXTENSION = "graphdiff.engines.vllm.tp_worker.GraphdiffWorkerExtension"  # never imported in the driver
WORKER_ENV = "GRAPHDIFF_TP_WORKER"  # a worker built with the extension installs graphdiff's Inductor hooks
VLLM_COMPILE_ENV = "GRAPHDIFF_TP_VLLM_COMPILE"  # VLLM_COMPILE kept on CPU: workers define the CUDA-only _C ops
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
GRAPHS_FILE, BUFFERS_FILE, META_FILE = "graphs.json", "buffers.pt", "meta.json"  # per rank, rank<R>/


def _numa_nodes() -> int:
    try:
        text = Path("/sys/devices/system/node/online").read_text().strip()
    except OSError:
        return 1
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def omp_bind(tp: int, cpus: set[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tp` ranks: the allowed CPUs split into `tp` contiguous groups ("0|1",
    "0,1|2,3"), the remainder to the last ranks' left."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    ordered = sorted(cpus)
    if len(ordered) < tp:
        raise GraphdiffError(f"tensor_parallel_size {tp} needs at least {tp} CPU cores (one per rank); this process "
                             f"may use {len(ordered)}")
    size = len(ordered) // tp
    groups = [ordered[r * size:(r + 1) * size] for r in range(tp)]
    return "|".join(",".join(map(str, g)) for g in groups)


def tp_env(tp: int, vllm_compile_kept: bool = False) -> dict[str, str]:
    """Environment for a tensor-parallel engine: its workers as processes (with graphdiff's hooks, when capturing),
    the OpenMP bind where vLLM's automatic one cannot work (fewer NUMA nodes than ranks) and the user set none."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", WORKER_ENV: "1"}
    if vllm_compile_kept:
        env[VLLM_COMPILE_ENV] = "1"
    if BIND_ENV not in os.environ and _numa_nodes() < tp:
        env[BIND_ENV] = omp_bind(tp)
    return env


def tp_kwargs(tp: int, capture: bool = True) -> dict[str, Any]:
    """vLLM arguments for `tp` ranks in worker processes (and graphdiff's worker extension when capturing)."""
    kwargs: dict[str, Any] = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
    if capture:
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
    return kwargs


def start_failure_hint(tp: int) -> str:
    return (f" (tensor_parallel_size {tp}: vLLM runs one worker process per rank; on CPU each is bound to its cores "
            f"by {BIND_ENV}={os.environ.get(BIND_ENV, '?')})")


def rank_kernel_ids(graph: Graph, rank: int) -> dict[str, str]:
    """Rank r > 0: graph `rank<r>/<name>`, kernel ids `<kernel>:r<r>.<handle>` (unique across ranks, so that every
    rank's records live in one buffers file); returns old -> new. Rank 0 keeps its names (a TP=1 capture's)."""
    if rank == 0:
        return {}
    graph.name = f"rank{rank}/{graph.name}"
    return tag_kernel_ids(graph, f"r{rank}")


def capture_vllm_tp(model_dir: Path, shapes: list[Shape], options: EngineOptions,
                    progress: Callable[[str], None]) -> EngineRun:
    """`capture_vllm` with `options.tensor_parallel_size` ranks: every rank's graphs and buffers at every shape."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from graphdiff.engines.vllm.cpu import effective_config, on_cpu_platform, wants_vllm_compile
    from graphdiff.models.resolve import architecture, read_config

    tp = options.tensor_parallel_size
    work = Path(tempfile.mkdtemp(prefix="graphdiff-engine-tp-"))
    kwargs = {**llm_kwargs(model_dir, options, shapes), **tp_kwargs(tp)}
    kept = wants_vllm_compile(options.config) and on_cpu_platform()
    env = {**engine_env(work, options.debug_dir), **tp_env(tp, kept)}
    notes: list[str] = []
    with engine_process_state(env, options.debug_dir):
        progress(f"starting vLLM on {model_dir.name} with tensor_parallel_size {tp} (one worker process per rank, "
                 "each compiling with Inductor)")
        t0 = time.perf_counter()
        forced_off: list[str] = []
        try:
            llm = start_llm(model_dir, kwargs, forced_off)
        except GraphdiffError as e:
            raise GraphdiffError(str(e) + start_failure_hint(tp)) from None
        startup = time.perf_counter() - t0
        progress(f"engine ready in {startup:.1f}s ({tp} ranks)")
        ranks = llm.collective_rpc("graphdiff_graphs")
        if any(r["graphs"] == 0 for r in ranks):
            raise GraphdiffError(f"a rank compiled no model graph: {ranks}")
        for i, shape in enumerate(shapes):
            progress(f"recording every rank's kernel buffers at {shape.label}")
            llm.collective_rpc("graphdiff_arm", args=(i == 0,))
            steps = 1 if shape.phase == "prefill" else 2
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in shape.prompts],
                         SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), use_tqdm=False)
            llm.collective_rpc("graphdiff_keep", args=(shape.label, steps))
        saved = sorted(llm.collective_rpc("graphdiff_save", args=(str(work / "ranks"),)), key=lambda r: r["rank"])
        engine_config = effective_config(llm, forced_off)
    graphs, buffers, metas = load_ranks([Path(r["dir"]) for r in saved])
    for meta in metas:
        notes += [f"rank {meta['rank']}: {n}" for n in meta["notes"]]
    config = read_config(model_dir)
    cap = Capture(
        side="engine", engine="vllm", model=str(model_dir), architecture=architecture(config),
        versions=versions(), graphs=graphs, packed=[PackedParam.model_validate(p) for p in metas[0]["packed"]],
        prompt_tokens=list(shapes[0].prompts[0]), shapes=shapes, engine_config=engine_config,
        attention=metas[0]["attention"], device=metas[0]["device"], notes=notes,
        unread_params=sorted({n for meta in metas for n in meta.get("unread_params", [])}),
        logits_weight=metas[0].get("logits_weight", ""))
    return EngineRun(llm=llm, capture=cap, buffers=buffers, startup_s=startup)


def load_ranks(dirs: list[Path]) -> tuple[list[Graph], Buffers, list[dict]]:
    """The ranks' saved captures as one: graphs in rank order, buffers merged per shape (kernel ids are unique), on
    the CPU; each rank's meta with the device its buffers were saved from ("device")."""
    graphs: list[Graph] = []
    buffers: Buffers = {}
    metas = []
    for d in dirs:
        graphs += [Graph.model_validate(g) for g in json.loads((d / GRAPHS_FILE).read_text())]
        rank_buffers, saved_on = load_on_cpu(d / BUFFERS_FILE)
        for label, records in rank_buffers.items():
            buffers.setdefault(label, {}).update(records)
        metas.append({**json.loads((d / META_FILE).read_text()), "device": saved_on})
    return graphs, buffers, metas
