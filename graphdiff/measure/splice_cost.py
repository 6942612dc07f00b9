"""What each splice of a patch adds to a training step: forward and backward, timed alone on the inputs it gets in the
model.

One patched forward of the model records the inputs of each splice's first call (its first layer's module, the first
call of a function splice, the first attention call) and how often a step calls it. Each splice is then timed alone
on those inputs, as the patched model calls it (the runtime's wrapper: its argument binding, closed-form gradient or
checkpointing) and as the unpatched model does (the module's own forward, HF's function, HF's sdpa, on the BF16
activations HF holds): the forward, and forward plus backward with a fixed output gradient, each the median of
`repeat` runs in this process's CPU time. `added_ms` is calls × (patched - unpatched) forward + backward: the splice's
share of the step's added time. The carry (the FP32 residual stream) and nn.Linear input hooks are no splice of their
own: their cost is the step's added time less the splices' sum.

`region_costs` gives each region of a manifest the cost of its splice (`scan --patch` prints it beside the region's
effect on the gap); benchmarks/patch_region_cost.py prints the per-splice rows at a model's full width and depth.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graphdiff import runtime
from graphdiff.records import Manifest


def timed(fn: Callable[[], Any], repeat: int, best: bool = False) -> float:
    """Median (`best`: the least) of `repeat` runs after a warm-up, in this process's CPU seconds (the machine may be
    shared: the least is what the work itself takes, the median what it takes beside the neighbours)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return min(times) if best else statistics.median(times)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def fwd_bwd(fn: Callable[[], Any], inputs: list[torch.Tensor]) -> Callable[[], None]:
    """fn, then the backward of its floating outputs with fixed gradients into the inputs that need one."""
    def run() -> None:
        outs = [o for o in _tensors(fn()) if o.requires_grad]
        grads = [torch.ones_like(o) * 1e-3 for o in outs]
        torch.autograd.backward(outs, grads)
        for t in inputs:
            t.grad = None
    return run


def fresh(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    """Detached copies of recorded inputs, floating activations requiring grad as in training."""
    leaves: list[torch.Tensor] = []

    def copy_of(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            t = v.detach().clone()
            if t.is_floating_point() and v.requires_grad:
                t.requires_grad_(True)
                leaves.append(t)
            return t
        return v
    return tuple(copy_of(a) for a in args), {k: copy_of(v) for k, v in kwargs.items()}, leaves


class Recorder:
    """The first call's inputs of each patched callable: module forwards, the function dispatchers, attention."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[tuple, dict]] = {}
        self.counts: dict[str, int] = {}

    def wrap(self, key: str, fn: Callable) -> Callable:
        def recording(*args: Any, **kwargs: Any) -> Any:
            self.counts[key] = self.counts.get(key, 0) + 1
            self.calls.setdefault(key, fresh(args, kwargs)[:2])
            return fn(*args, **kwargs)
        return recording


def patched_callables(model: Any, manifest: Manifest, path: Path) -> dict[str, tuple[Callable, Callable, Any]]:
    """splice key -> (patched callable, unpatched callable, owner to patch for recording), for the model patched from
    the patch directory `path`."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = runtime.load_generated(manifest, path / "manifest.json")
    align = frozenset(runtime.active_regions(model) or [])
    found: dict[str, tuple[Callable, Callable, Any]] = {}
    for s in manifest.splices:
        if s.problems:
            continue
        if s.target == "module":
            pattern = runtime.module_regex(s.module)
            mods = [m for n, m in model.named_modules() if pattern.match(n) and "forward" in m.__dict__]
            if mods:
                found[s.key] = (mods[0].forward, type(mods[0]).forward.__get__(mods[0]), mods)
        elif s.target == "function":
            owner_name, name = s.function.rsplit(".", 1)
            owner = importlib.import_module(owner_name)
            dispatcher = getattr(owner, name)
            replacement = runtime.dispatch.function_replacement(dispatcher.__wrapped__, s,
                                                                 runtime.dispatch.chooser(gen, s), align)
            found[s.key] = (replacement, dispatcher.__wrapped__, (owner, name))
        elif s.target == "attention":
            impl = model.config._attn_implementation
            found[s.key] = (AttentionInterface._global_mapping[impl], sdpa_attention_forward, impl)
    return found


def record(model: torch.nn.Module, ids: torch.Tensor, found: dict) -> Recorder:
    """The splices' first inputs and call counts in one forward of the patched model (with grad, as in training)."""
    from transformers import AttentionInterface

    rec = Recorder()
    undo: list[Callable[[], None]] = []
    for key, (patched, _, where) in found.items():
        if isinstance(where, list):  # modules: wrap the instance forward of every target
            for mod in where:
                undo.append(functools.partial(setattr, mod, "forward", mod.forward))
                mod.forward = rec.wrap(key, mod.forward)
        elif isinstance(where, tuple):  # the dispatcher: record what it is called with inside the patched module
            owner, name = where
            dispatcher = getattr(owner, name)
            setattr(owner, name, rec.wrap(key, dispatcher))
            undo.append(functools.partial(setattr, owner, name, dispatcher))
        else:
            AttentionInterface._global_mapping[where] = rec.wrap(key, patched)
            undo.append(functools.partial(AttentionInterface._global_mapping.__setitem__, where, patched))
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for u in undo:
            u()
    return rec


def cost(key: str, rec: Recorder, patched: Callable, plain: Callable, repeat: int, model: torch.nn.Module,
         best: bool = False, autograd: bool = False) -> dict[str, float]:
    """One splice's row: calls per step, patched and unpatched forward and forward + backward ms, added ms per step
    (`autograd`: the patched splice's gradient by autograd too, not its closed form: `autograd_*`). The model is left
    unpatched."""
    args, kwargs = rec.calls[key]
    row: dict[str, float] = {"calls": rec.counts[key]}
    labels = [("patched", patched), *([("autograd", patched)] if autograd else []), ("unpatched", plain)]
    for label, fn in labels:
        if label == "unpatched":
            runtime.remove(model)  # the module forward / function as HF runs them
        a, k, leaves = fresh(args, kwargs)
        if label == "unpatched":  # HF's own ops see the trainer's BF16 activations
            a = tuple(t.detach().to(torch.bfloat16).requires_grad_(t.requires_grad)
                      if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in a)
            leaves = [t for t in a if isinstance(t, torch.Tensor) and t.requires_grad]
        call = functools.partial(fn, *a, **k)
        before = os.environ.get("GRAPHDIFF_CLOSED_FORM")
        os.environ["GRAPHDIFF_CLOSED_FORM"] = "0" if label == "autograd" else "1"
        try:
            with torch.no_grad():
                row[f"{label}_fwd_ms"] = 1e3 * timed(call, repeat, best)
            row[f"{label}_fwd_bwd_ms"] = 1e3 * timed(fwd_bwd(call, leaves), repeat, best)
        finally:
            os.environ.pop("GRAPHDIFF_CLOSED_FORM")
            if before is not None:
                os.environ["GRAPHDIFF_CLOSED_FORM"] = before
    row["added_ms"] = row["calls"] * (row["patched_fwd_bwd_ms"] - row["unpatched_fwd_bwd_ms"])
    if autograd:
        row["autograd_added_ms"] = row["calls"] * (row["autograd_fwd_bwd_ms"] - row["unpatched_fwd_bwd_ms"])
    return {k: round(v, 3) for k, v in row.items()}


def splice_costs(model: torch.nn.Module, patch_dir: Path, ids: torch.Tensor, repeat: int = 3,
                 regions: list[str] | None = None, best: bool = False, autograd: bool = False,
                 on_row: Callable[[str, dict[str, float]], None] = lambda k, r: None) -> dict[str, dict[str, float]]:
    """splice key -> its row (`cost`) for each splice of the patch in `patch_dir` that `model` calls, patched with
    `regions` (default: the enabled ones); the model is left unpatched."""
    manifest = runtime.load_manifest(patch_dir / "manifest.json")
    runtime.apply(model, patch_dir, regions=regions)
    try:
        found = patched_callables(model, manifest, patch_dir)
        rec = record(model, ids, found)
    finally:
        runtime.remove(model)
    rows = {}
    for key, (patched, plain, _) in found.items():
        if key not in rec.calls:
            continue  # a splice this model never calls (a group of layers it does not have)
        runtime.apply(model, patch_dir, regions=regions)
        rows[key] = cost(key, rec, patched, plain, repeat, model, best, autograd)
        on_row(key, rows[key])
    return rows


def region_costs(base: torch.nn.Module, patch_dir: Path, tokens: int = 256, repeat: int = 5
                 ) -> dict[str, float]:
    """region -> ms its splice adds to a training step of `base` (a copy of it, patched with every generated region)
    over `tokens` seeded tokens, each time the least of `repeat` runs; a splice serving several regions counts for
    each."""
    manifest = runtime.load_manifest(patch_dir / "manifest.json")
    model: Any = copy.deepcopy(base).train()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    generated = [r.name for r in manifest.regions if r.generated]
    rows = splice_costs(model, patch_dir, ids.to(next(model.parameters()).device), repeat, generated, best=True)
    out: dict[str, float] = {}
    for s in manifest.splices:
        if s.key in rows:
            for r in s.regions:
                out[r] = out.get(r, 0.0) + rows[s.key]["added_ms"]
    return out
