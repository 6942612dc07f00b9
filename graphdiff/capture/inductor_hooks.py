"""In-process hooks on Inductor: what it compiles, which FX nodes each kernel fuses, and real buffers.

Installed only for the duration of a capture (the engine's start-up, or a torch.compile of any module):
- `compile_fx` (entry): the graph handed to Inductor, whose placeholder names say which module
  parameter each input is (Dynamo names them after the module path);
- `set_kernel_post_grad_provenance_tracing`: called by the scheduler once per kernel call it
  generates, with the scheduler nodes (and so the FX nodes) fused into it;
- `GraphLowering.compile_to_module`: the post-grad FX graph and the compiled module.
After compile, every generated kernel callable in the compiled module can be wrapped by a
`BufferRecorder`, so that real forwards record each kernel call's input buffers (before) and output
buffers (after). Nothing is added to the graph: an added output would be stored, and storing is rounding.
"""

from __future__ import annotations

import contextlib
import operator
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from graphdiff.capture.inductor_code import KernelCall, arg_role
from graphdiff.records import Graph, KernelRecord


@dataclass
class Compiled:
    """One Inductor compilation seen by the hooks."""

    placeholders: list[str]  # input names of the graph handed to Inductor
    gm: torch.fx.GraphModule | None = None  # post-grad graph
    module: ModuleType | None = None
    origins: dict[str, list[str]] = field(default_factory=dict)  # kernel id -> FX nodes
    origin_node: dict[str, str] = field(default_factory=dict)  # kernel id -> exact FX node (externs)
    stores: dict[str, str] = field(default_factory=dict)  # buffer -> FX node whose value it holds

    def wrapper(self) -> tuple[ModuleType, str]:
        """The compiled Python wrapper module and its source (the file Inductor wrote it to)."""
        assert self.module is not None and self.module.__file__ is not None, "Inductor compiled no wrapper module"
        return self.module, Path(self.module.__file__).read_text()


@dataclass
class _Hooks:
    compiled: list[Compiled] = field(default_factory=list)
    depth: int = 0


def _snodes(schedule: Any) -> Iterator[Any]:
    for snode in schedule:
        if hasattr(snode, "get_nodes"):
            yield from snode.get_nodes()


def _consumed(node: Any, origins: Any) -> bool:
    """Whether another origin reads `node`, directly or through a `getitem` of it (var_mean, split: their
    getitems are not origins of the buffer that fuses their consumers)."""
    return any(u in origins or (u.target is operator.getitem and any(g in origins for g in u.users))
               for u in node.users)


def _is_custom_op(node: Any) -> bool:
    """An op outside aten/prims (a vLLM or oneDNN op): always an extern call, never a generated kernel's value."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace not in ("aten", "prims")


def _last_origin(origins: Any, generated: bool = False) -> Any:
    """The FX node whose value a buffer holds: the one origin no other origin consumes. Inductor also lists, among
    a generated kernel's origins, the extern op that reads its buffer; that op is not the buffer's value."""
    if generated:
        origins = {o for o in origins if not _is_custom_op(o)}
    sinks = [o for o in origins if not _consumed(o, origins)]
    return sinks[0] if len(sinks) == 1 else None


def _record_origins(cur: Compiled, kid: str, irnodes: list[Any], is_extern: bool) -> None:
    """The FX nodes fused into kernel call `kid`, the buffer each IR node stores -> the FX node whose value it
    holds, and an extern call's exact FX node."""
    names: list[str] = []
    for ir in irnodes:
        for origin in sorted(ir.origins, key=lambda n: n.name):
            if origin.name not in names:
                names.append(origin.name)
        origin_node = getattr(ir, "origin_node", None) or _last_origin(ir.origins, generated=not is_extern)
        if origin_node is not None:
            if is_extern:
                cur.origin_node[kid] = origin_node.name
            with contextlib.suppress(Exception):
                cur.stores[ir.get_name()] = origin_node.name
    cur.origins[kid] = names


def _modules_with_trace(*modules: ModuleType) -> list[ModuleType]:
    """`modules` and Triton's codegen where it imports: each calls the provenance tracing hook by its own name."""
    found = list(modules)
    try:
        import torch._inductor.codegen.triton as triton_codegen

        found.append(triton_codegen)
    except ImportError:  # pragma: no cover - triton codegen is importable wherever triton is
        pass
    return found


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
    modules_with_trace = _modules_with_trace(inductor_debug, cpp_codegen)

    def compile_fx(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if hooks.depth == 0:
            names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
            hooks.compiled.append(Compiled(placeholders=names))
        hooks.depth += 1
        try:
            return orig_compile_fx(gm, example_inputs, *args, **kwargs)
        finally:
            hooks.depth -= 1

    def trace(node_schedule: Any, kernel_name: str, is_extern: bool = False) -> Any:
        handle = orig_trace(node_schedule, kernel_name, is_extern)
        if hooks.compiled:
            kid = f"{kernel_name}:{inductor_debug._inductor_kernel_provenance_debug_handle}"
            irnodes = [node_schedule] if is_extern else [s.node for s in _snodes(node_schedule) if s.node is not None]
            _record_origins(hooks.compiled[-1], kid, irnodes, is_extern)
        return handle

    def compile_to_module(self: Any) -> Any:
        mod = orig_to_module(self)
        if hooks.compiled and hooks.compiled[-1].module is None:
            hooks.compiled[-1].gm = self.module
            # the Python wrapper's module; the FX wrapper backend (not used by a capture) returns another kind
            hooks.compiled[-1].module = mod if isinstance(mod, ModuleType) else None
        return mod

    saved_level = inductor_config.trace.provenance_tracking_level
    inductor_config.trace.provenance_tracking_level = max(1, saved_level)
    # Hooks on Inductor's internals for the capture's duration (the ignores: replacing functions and a method)
    compile_fx_mod.compile_fx = compile_fx  # type: ignore[assignment]
    for m in modules_with_trace:
        m.set_kernel_post_grad_provenance_tracing = trace  # type: ignore[attr-defined]
    GraphLowering.compile_to_module = compile_to_module  # type: ignore[method-assign]
    try:
        yield hooks
    finally:
        compile_fx_mod.compile_fx = orig_compile_fx
        for m in modules_with_trace:
            m.set_kernel_post_grad_provenance_tracing = orig_trace  # type: ignore[attr-defined]
        GraphLowering.compile_to_module = orig_to_module  # type: ignore[method-assign]
        inductor_config.trace.provenance_tracking_level = saved_level


class _Launcher:
    """Stands in for a Triton launcher: `.run` records, everything else is the real launcher's."""

    def __init__(self, inner: Any, run: Callable) -> None:
        self._inner = inner
        self.run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class BufferRecorder:
    """Wraps a compiled module's generated kernels to record real buffers, one forward at a time.

    While armed, every forward's kernel calls are recorded; a forward ends when each kernel call site of the
    wrapper has run once (the wrapper is straight-line code), and its records go to `forwards`."""

    def __init__(self, module: ModuleType, calls: list[KernelCall], defs: dict, weights: set[str],
                 ids: dict[str, str] | None = None) -> None:
        # Weights are never written by a forward: keep them by reference (an embedding table is
        # gigabytes). Everything else is copied: the engine reuses its input buffers every step.
        self.weights = weights
        self.ids = ids or {}  # kernel call id -> the id the Graph gives it (unique across a piecewise compile)
        self.forwards: list[dict[str, KernelRecord]] = []
        self.armed = False
        self._current: dict[str, KernelRecord] = {}
        self._sites: dict[str, list[KernelCall]] = defaultdict(list)
        for c in calls:
            if not c.extern:
                self._sites[c.name].append(c)
        self._seen: dict[str, int] = defaultdict(int)
        self._module, self._originals = module, {name: getattr(module, name) for name in self._sites}
        for name, kernel in self._originals.items():
            setattr(module, name, self._wrap(kernel, name, defs[name]))

    def remove(self) -> None:
        """Put the module's own kernels back (recording stops)."""
        for name, kernel in self._originals.items():
            setattr(self._module, name, kernel)
        self._originals = {}

    @property
    def records(self) -> dict[str, KernelRecord]:
        """The first recorded forward (or what was recorded of it)."""
        return self.forwards[0] if self.forwards else self._current

    def reset(self) -> None:
        self.forwards, self._current, self._seen = [], {}, defaultdict(int)

    def complete(self) -> bool:
        return bool(self.forwards)

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
            rec: KernelRecord = {"in": {}, "out": {}, "scalars": {}}
            for arg, bufname, role in zip(args, site.args, roles):
                if isinstance(arg, torch.Tensor):
                    # an argument without a buffer name is "?", as in the Kernel's args (inductor_code.kernel_args)
                    if role == "in" and bufname in self.weights:
                        rec["in"][bufname or "?"] = arg.detach()
                    elif role in ("in", "inout"):
                        rec["in"][bufname or "?"] = arg.detach().clone()
                else:
                    rec["scalars"][bufname or "?"] = arg
            result = fn(*args, **kwargs)
            for arg, bufname, role in zip(args, site.args, roles):
                if isinstance(arg, torch.Tensor) and role in ("out", "inout"):
                    rec["out"][bufname or "?"] = arg.detach().clone()
            self._current[self.ids.get(site.id, site.id)] = rec
            if all(self._seen[n] == len(s) for n, s in self._sites.items()):  # the forward is over
                self.forwards.append(self._current)
                self._current, self._seen = {}, defaultdict(int)
            return result

        return _Launcher(kernel, recording_kernel) if hasattr(kernel, "run") else recording_kernel


def weight_inputs(graph: Graph) -> set[str]:
    """Placeholders that hold module parameters/buffers (named like `model.layers.0.x.weight`)."""
    return {p for p, name in graph.inputs.items() if "." in name and "#" not in name}


