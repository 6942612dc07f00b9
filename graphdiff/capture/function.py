"""Both sides for any nn.Module, not only a served model: eager (trainer-like) and torch.compile'd
with Inductor (engine-like), captured with the same hooks and recorder as the vLLM engine.

Used by the planted-mismatch suite (fixtures/planted) and by anyone who wants to diff two
implementations of one block directly.
"""

from __future__ import annotations

import re
from typing import Any
from unittest import mock

import torch
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx

from graphdiff.capture.assemble import build_graph
from graphdiff.capture.engine_model import input_names
from graphdiff.capture.fx import graph_from_fx
from graphdiff.capture.inductor_code import parse_kernel_calls, parse_kernel_defs
from graphdiff.capture.inductor_hooks import BufferRecorder, inductor_hooks, weight_inputs
from graphdiff.records import Graph


def trace_eager(module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                arg_names: list[str]) -> tuple[Graph, torch.fx.GraphModule, list[torch.Tensor]]:
    """The eager ATen graph of module(*args); placeholders named after parameters and `arg_names`."""
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    names = [*state, *arg_names]
    tensors = [*state.values(), *args]

    def forward(*flat: torch.Tensor) -> Any:
        return torch.func.functional_call(module, dict(zip(state, flat[: len(state)])), flat[len(state):])

    # make_fx records nn_module_stack relative to f._orig_mod (an attribute set on the function)
    forward._orig_mod = module  # type: ignore[attr-defined]
    keep_all = mock.patch.object(proxy_tensor._ModuleStackTracer, "_filter_traceback_frames", lambda _, f: f)
    with torch.no_grad(), keep_all:
        gm = make_fx(forward, tracing_mode="real", record_module_stack=True, record_stack_traces=True)(*tensors)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return graph_from_fx(gm, dict(zip(placeholders, names)), "eager"), gm, tensors


def capture_compiled(module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                     arg_names: list[str]) -> tuple[Graph, dict[str, Any]]:
    """Compile module with Inductor (fresh, no caches), capture its graph and one run's kernel buffers."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # process-wide by design: a fresh compile needs Dynamo's caches empty (nothing to restore)
    with inductor_config.patch(force_disable_caches=True), inductor_hooks() as hooks, torch.no_grad():
        compiled = torch.compile(module, backend="inductor", fullgraph=True, dynamic=False)
        compiled(*args)
        comp = next(c for c in reversed(hooks.compiled) if c.module is not None)
        names, root = input_names(comp.placeholders, module)
        # Dynamo names a forward(*args) input `l_args_N_`; give it the caller's name.
        names = {p: arg_names[int(m.group(1))] if (m := re.fullmatch(r"args_(\d+)", n)) else n
                 for p, n in names.items()}
        graph = build_graph(comp, names, root, 0)
        wrapper, code = comp.wrapper()
        defs = parse_kernel_defs(code)
        recorder = BufferRecorder(wrapper, parse_kernel_calls(code, defs), defs, weight_inputs(graph))
        recorder.armed = True
        compiled(*args)
        recorder.armed = False
        recorder.remove()
    return graph, recorder.records
