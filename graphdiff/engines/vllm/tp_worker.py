"""The capture inside vLLM's tensor-parallel worker processes (imported only there, by vLLM).

With `tensor_parallel_size` > 1 every rank compiles its own graph in its own worker process, so the capture has
to happen there. vLLM offers two hooks: `worker_extension_cls` (a class whose methods are mixed into every worker,
resolved in `WorkerWrapperBase.init_worker` before the worker builds, loads and compiles the model) and
`LLM.collective_rpc` (call a worker method on every rank). When vLLM builds a worker with the extension mixed
in, `start_capture` installs graphdiff's Inductor hooks in it before its compile (only where the driver asked for
it: `GRAPHDIFF_TP_WORKER=1`); the driver (graphdiff.engines.vllm.tp) arms, collects and saves through RPCs, and the
save ends the capture (`stop_capture`: the hooks, placeholders and buffer recorders undone). Importing this module
changes nothing.

Tensors do not travel back over collective_rpc (its msgpack transport turns nested tensors into lists and
memoryviews): each rank writes its graphs and buffers to files, and the RPC returns their paths.

Besides the generated kernels' buffers, each rank records the calls of the extern ops a tensor-parallel forward
adds rounding in (`EXTERN_OPS`: the all-reduce and the matmuls that write what it reduces), at the first recorded
shape: each all-reduce's BF16 partial (its input), its output, and the input of the matmul that wrote the
partial. The analysis checks the registry's description of the all-reduce on them (graphdiff.analysis.tensor_parallel).

Which ops those are depends on vLLM's ops build (graphdiff.capture.cpu_kind): `_C` / `_C_AVX512` all-reduce with their
shared-memory `_C.shm_allreduce` and multiply with `_C.onednn_mm` (`_C.weight_packed_linear` on AMX); `_C_AVX2` has
no shared-memory ops (vLLM falls back to torch.distributed: Inductor calls `_c10d_functional.all_reduce_`, then
`wait_tensor`, since gloo reduces asynchronously) and oneDNN creates no BF16 matmul under the AVX2 ISA (vLLM falls back
to F.linear: Inductor's `extern_kernels.mm`).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from graphdiff.capture.assemble import build_graph
from graphdiff.capture.collectives import allreduces
from graphdiff.capture.inductor_code import parse_kernel_calls, parse_kernel_defs
from graphdiff.capture.inductor_hooks import BufferRecorder, inductor_hooks, weight_inputs
from graphdiff.engines.vllm.cpu import cuda_only_placeholders
from graphdiff.engines.vllm.tp import (
    BUFFERS_FILE,
    GRAPHS_FILE,
    META_FILE,
    VLLM_COMPILE_ENV,
    WORKER_ENV,
    rank_kernel_ids,
)
from graphdiff.records import Buffers, ExternRecord, Graph, KernelRecord

# the argument each op's recorded call holds its input in (a matmul) or reduces in place (an all-reduce)
MATMUL_OPS = {"_C.onednn_mm": 1, "_C.weight_packed_linear": 1, "extern_kernels.mm": 0}  # out=, input; input, weight
ALLREDUCE_OPS = {"_C.shm_allreduce": 1, "_c10d_functional.all_reduce_": 0}  # (handle, buffer); (buffer, op, group)
ASYNC_OPS = {"_c10d_functional.all_reduce_"}  # returns before the sum is done: its wait_tensor completes it
EXTERN_OPS = (*ALLREDUCE_OPS, *MATMUL_OPS)

HOOKS: Any = None  # what the hooks saw compile in this worker (set by start_capture)
_ACTIVE: list[contextlib.ExitStack] = []  # the capture's installed state while it runs, undone by stop_capture


def start_capture() -> Any:
    """Install graphdiff's Inductor hooks in this worker (and, for VLLM_COMPILE on CPU, the CUDA-only op
    placeholders its compile names) until `stop_capture`; returns the hooks. Installs once per capture."""
    global HOOKS
    if not _ACTIVE:
        with contextlib.ExitStack() as stack:
            HOOKS = stack.enter_context(inductor_hooks())
            if os.environ.get(VLLM_COMPILE_ENV) == "1":
                stack.enter_context(cuda_only_placeholders())
            _ACTIVE.append(stack.pop_all())
    return HOOKS


def stop_capture() -> None:
    """Undo `start_capture` (a no-op when nothing is installed)."""
    while _ACTIVE:
        _ACTIVE.pop().close()


def _extern_kernels() -> Any:
    from torch._inductor.select_algorithm import extern_kernels

    return extern_kernels


class ExternRecorder:
    """Records calls of chosen extern ops (`torch.ops.<ns>.<op>.default`, `extern_kernels.<fn>`) while armed: tensor
    arguments before (cloned) and after the call (an in-place all-reduce, completed first where it is asynchronous).
    Inductor's wrapper calls externs through the op namespace at call time (`torch.ops._C.shm_allreduce.default(0,
    buf0)`, `extern_kernels.mm(buf1, arg2, out=buf3)`), so replacing the namespace's attribute is enough; `remove`
    restores it. Installed only after the compile: Dynamo must trace the real packets."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        self.calls: dict[str, list[dict]] = {op: [] for op in ops}
        self.armed = False
        self._saved = []
        for full in ops:
            ns, op = full.split(".")
            space = _extern_kernels() if ns == "extern_kernels" else getattr(torch.ops, ns)
            inner = getattr(space, op, None)
            if inner is None:
                continue
            self._saved.append((space, op, inner))
            wrapped = _recording(inner, full, self) if ns == "extern_kernels" else _Packet(inner, full, self)
            setattr(space, op, wrapped)

    def remove(self) -> None:
        for space, op, packet in self._saved:
            setattr(space, op, packet)


class _Packet:
    def __init__(self, inner: Any, name: str, recorder: ExternRecorder) -> None:
        self._inner, self._name, self._rec = inner, name, recorder

    def __getattr__(self, attr: str) -> Any:
        overload = getattr(self._inner, attr)
        if attr != "default":
            return overload
        rec, name = self._rec, self._name

        return _recording(overload, name, rec)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner(*args, **kwargs)


def _recording(fn: Any, name: str, rec: ExternRecorder) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if not rec.armed:
            return fn(*args, **kwargs)
        before = [a.detach().clone() if isinstance(a, torch.Tensor) else None for a in args]
        result = fn(*args, **kwargs)
        if name in ASYNC_OPS:  # the wrapper's own wait_tensor after it then finds nothing pending (measured: a no-op)
            torch.ops._c10d_functional.wait_tensor.default(args[ALLREDUCE_OPS[name]])
        after = [a.detach().clone() if isinstance(a, torch.Tensor) else None for a in args]
        rec.calls[name].append({"before": before, "after": after})
        return result

    return call


def _runs(kernel_name: str, op: str) -> bool:
    """Does an extern kernel (by its wrapper name) call this op (`_C.onednn_mm`, `extern_kernels.mm`)?"""
    return kernel_name == op or kernel_name.startswith(f"torch.ops.{op}.")


def extern_records(graphs: list[Graph], calls: dict[str, list[dict]]) -> tuple[dict[str, KernelRecord], list[str]]:
    """Kernel id of each all-reduce -> its record: {"in": {}, "out": {}, "scalars": {}, "extern": {...}} with the
    BF16 partial it reduced, its output, and the matmul that wrote the partial (kernel id, its input: the writer as
    capture.collectives.allreduces finds it). Calls are matched to the graphs' extern kernels in execution
    order (the wrapper is straight-line code; calls after the graphs', e.g. the LM head's matmul, are not the
    graphs')."""
    mm_input: dict[str, torch.Tensor] = {}
    for op, arg in MATMUL_OPS.items():  # each op's calls in execution order, matched to its extern kernels
        ks = [k for g in graphs for k in g.kernels if k.kind == "extern" and _runs(k.name, op)]
        if len(calls.get(op, [])) < len(ks):
            return {}, [f"recorded {len(calls.get(op, []))} {op} calls for {len(ks)} in the graphs: the all-reduce "
                        "inputs are not checked"]
        mm_input.update({k.id: c["before"][arg] for k, c in zip(ks, calls.get(op, []))})
    out: dict[str, KernelRecord] = {}
    for op, arg in ALLREDUCE_OPS.items():
        reduces = [a for g in graphs for a in allreduces(g) if _runs(a.kernel.split(":")[0], op)]
        ar_calls = calls.get(op, [])
        if len(ar_calls) < len(reduces):
            return {}, [f"recorded {len(ar_calls)} {op} calls for {len(reduces)} in the graphs: the all-reduce "
                        "inputs are not checked"]
        for a, c in zip(reduces, ar_calls):
            ext: ExternRecord = {"buffer": a.buffer, "partial": c["before"][arg], "reduced": c["after"][arg]}
            if a.matmul in mm_input:
                ext["matmul"], ext["matmul_input"] = a.matmul, mm_input[a.matmul]
            out[a.kernel] = {"in": {}, "out": {}, "scalars": {}, "extern": ext}
    return out, []


class _RankCapture:
    """One rank's capture in its worker: its graphs, a recorder on each, the buffers kept per shape. (A plain
    class: a dataclass needs its module in sys.modules, and a fresh import of this one need not be.)"""

    def __init__(self, rank: int, graphs: list[Graph], recorders: list[BufferRecorder]) -> None:
        self.rank, self.graphs, self.recorders = rank, graphs, recorders
        self.buffers: Buffers = {}
        self.notes: list[str] = []
        self.externs: ExternRecorder | None = None


class GraphdiffWorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); the driver calls these through collective_rpc."""

    model_runner: Any  # the vLLM worker's, which this class is mixed into
    _graphdiff: _RankCapture

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # vLLM builds the worker as `worker_class(**kwargs)` with this class among its bases, before the worker
        # loads and compiles its model; the worker's __init__ chain stops at vLLM's WorkerBase and never reaches a
        # mixin's __init__ (and a mixin may not override its methods), so the worker's construction starts here.
        if os.environ.get(WORKER_ENV) == "1":  # in a vLLM worker started by graphdiff's capture
            start_capture()
        return super().__new__(cls)

    def graphdiff_graphs(self) -> dict[str, Any]:
        """This rank's compiled model graphs (named and numbered for the rank) and a recorder on each."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from graphdiff.capture.engine_model import canonical_modules, input_names, is_model_graph, unique_kernel_ids

        if HOOKS is None:
            raise RuntimeError(f"graphdiff's Inductor hooks are not installed in this worker ({WORKER_ENV} unset)")
        rank = get_tensor_model_parallel_rank()
        model = self.model_runner.get_model()
        graphs: list[Graph] = []
        recorders: list[BufferRecorder] = []
        for comp in (c for c in HOOKS.compiled if c.module is not None):
            names, root = input_names(comp.placeholders, model)
            if not is_model_graph(names):
                continue
            graph = build_graph(comp, names, root, len(graphs))
            canonical_modules(graph, model)
            original = [k.id for k in graph.kernels]
            unique_kernel_ids(graph, len(graphs))
            rank_kernel_ids(graph, rank)
            ids = {a: k.id for a, k in zip(original, graph.kernels) if a != k.id}
            module, src = comp.wrapper()
            defs = parse_kernel_defs(src)
            recorders.append(BufferRecorder(module, parse_kernel_calls(src, defs), defs, weight_inputs(graph), ids))
            graphs.append(graph)
        self._graphdiff = _RankCapture(rank, graphs, recorders)
        return {"rank": rank, "graphs": len(graphs), "compilations": len(HOOKS.compiled)}

    def graphdiff_arm(self, record_externs: bool) -> None:
        state = self._graphdiff
        for r in state.recorders:
            r.reset()
            r.armed = True
        if record_externs:
            state.externs = ExternRecorder(EXTERN_OPS)
            state.externs.armed = True

    def graphdiff_keep(self, label: str, steps: int) -> list[str]:
        """Disarm; keep the forward that is the shape (a decode step: the last of `steps`)."""
        state = self._graphdiff
        buffers = state.buffers.setdefault(label, {})
        notes = []
        for graph, r in zip(state.graphs, state.recorders):
            r.armed = False
            if len(r.forwards) < steps:
                notes.append(f"{graph.name} ran {len(r.forwards)} complete forward(s) at {label}, expected {steps}: "
                             "its kernels are not replayed there")
                continue
            buffers.update(r.forwards[steps - 1])
            graph.shapes.append(label)
            r.reset()
        ext = state.externs
        if ext is not None:
            ext.armed = False
            ext.remove()
            state.externs = None
            records, more = extern_records(state.graphs, ext.calls)
            buffers.update(records)
            notes += more
        state.notes += notes
        return notes

    def graphdiff_save(self, out_dir: str) -> dict[str, Any]:
        """Write this rank's graphs (JSON), buffers (torch.save) and facts (JSON) under out_dir/rank<R>/."""
        from graphdiff.capture.engine_model import logits_weight, unread_params
        from graphdiff.engines.vllm.start import attention_info, packed_params

        state = self._graphdiff
        out = Path(out_dir) / f"rank{state.rank}"
        out.mkdir(parents=True, exist_ok=True)
        (out / GRAPHS_FILE).write_text(json.dumps([g.model_dump(mode="json") for g in state.graphs]))
        torch.save(state.buffers, out / BUFFERS_FILE)
        model = self.model_runner.get_model()
        meta = {"rank": state.rank, "packed": [p.model_dump(mode="json") for p in packed_params(model)],
                "attention": attention_info(model), "notes": state.notes,
                "unread_params": unread_params(model, state.graphs), "logits_weight": logits_weight(model)}
        (out / META_FILE).write_text(json.dumps(meta))
        for r in state.recorders:
            r.remove()
        stop_capture()  # the capture is saved: nothing of it stays installed in the worker
        return {"rank": state.rank, "dir": str(out)}
