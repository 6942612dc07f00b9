"""Where the patched training step's added time goes, splice by splice: forward, backward, dispatch.

    python benchmarks/patch_region_cost.py --scan SCAN_DIR --config Qwen/Qwen3-0.6B --batch 1 --seq 1024
    python benchmarks/patch_region_cost.py --scan SCAN_DIR --config Qwen/Qwen3-0.6B --seq 1024 --exact

One patched forward of the model records the inputs of each splice's first call (its first layer's module, the
first call of a function splice, the first attention call). Each splice is then timed alone on those inputs, as
the patched model calls it (the runtime's wrapper: its argument binding, checkpointing and recompute recipe)
and as the unpatched model does (the module's own forward, HF's function, HF's sdpa): the forward, and forward
plus backward (with a fixed output gradient), each the median of --repeat runs in CPU time at --threads 1.
`calls` is how often one step calls it; `added_ms` is (patched - unpatched) forward + backward times calls, the
splice's share of the step's added time. The carry (the FP32 residual stream) and the runtime's nn.Linear input
hooks are not splices of their own: their cost is the step's added time less the splices' sum (`rest_ms`,
printed when --step is given).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from patch_step_benchmark import load_model, model_arguments, step  # beside this script

from graphdiff import runtime
from graphdiff.codegen import generate


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median of `repeat` runs after a warm-up, in this process's CPU seconds (the machine may be shared)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times)


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

    def copy(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            t = v.detach().clone()
            if t.is_floating_point() and v.requires_grad:
                t.requires_grad_(True)
                leaves.append(t)
            return t
        return v
    return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}, leaves


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


def patched_callables(model: torch.nn.Module, manifest: Any, path: Path) -> dict[str, tuple[Callable, Callable, Any]]:
    """splice key -> (patched callable, unpatched callable, owner to patch for recording)."""
    gen = runtime.load_generated(manifest, path / "manifest.json")
    align = frozenset(runtime.active_regions(model) or [])
    import importlib

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    found: dict[str, tuple[Callable, Callable, Any]] = {}
    for s in manifest.splices:
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
    from transformers import AttentionInterface

    rec = Recorder()
    undo: list[Callable[[], None]] = []
    for key, (patched, _, where) in found.items():
        if isinstance(where, list):  # modules: wrap the instance forward of every target
            for mod in where:
                fwd = mod.forward
                mod.forward = rec.wrap(key, fwd)
                undo.append(lambda mod=mod, fwd=fwd: setattr(mod, "forward", fwd))
        elif isinstance(where, tuple):  # the dispatcher: record what it is called with inside the patched module
            owner, name = where
            dispatcher = getattr(owner, name)
            setattr(owner, name, rec.wrap(key, dispatcher))
            undo.append(lambda owner=owner, name=name, f=dispatcher: setattr(owner, name, f))
        else:
            AttentionInterface._global_mapping[where] = rec.wrap(key, patched)
            undo.append(lambda where=where, f=patched: AttentionInterface._global_mapping.__setitem__(where, f))
    model(input_ids=ids, use_cache=False)  # with grad: the recorded activations require it, as in training
    for u in undo:
        u()
    return rec


def cost(key: str, rec: Recorder, patched: Callable, plain: Callable, repeat: int, model: torch.nn.Module
         ) -> dict[str, float]:
    args, kwargs = rec.calls[key]
    row: dict[str, float] = {"calls": rec.counts[key] // 1}
    for label, fn in (("patched", patched), ("unpatched", plain)):
        if label == "unpatched":
            runtime.remove(model)  # the module forward / function as HF runs them
        a, k, leaves = fresh(args, kwargs)
        if label == "unpatched":  # HF's own ops see the trainer's BF16 activations
            a = tuple(t.detach().to(torch.bfloat16).requires_grad_(t.requires_grad)
                      if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in a)
            leaves = [t for t in a if isinstance(t, torch.Tensor) and t.requires_grad]
        call = functools.partial(fn, *a, **k)
        with torch.no_grad():
            row[f"{label}_fwd_ms"] = 1e3 * timed(call, repeat)
        row[f"{label}_fwd_bwd_ms"] = 1e3 * timed(fwd_bwd(call, leaves), repeat)
    row["added_ms"] = row["calls"] * (row["patched_fwd_bwd_ms"] - row["unpatched_fwd_bwd_ms"])
    return {k: round(v, 3) for k, v in row.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(ap)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--attention", default="fp32", choices=("fp32", "engine"))
    ap.add_argument("--step", action="store_true", help="also time whole steps, unpatched and patched (3 each)")
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (CPU time: 1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="gd-cost-"))
    manifest = generate(args.scan, work / "patch", attention=args.attention, exact=args.exact)
    model, label = load_model(args, work)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    runtime.apply(model, work / "patch")
    found = patched_callables(model, manifest, work / "patch")
    rec = record(model, ids, found)
    rows = {}
    for key, (patched, plain, _) in found.items():
        runtime.apply(model, work / "patch")
        rows[key] = cost(key, rec, patched, plain, args.repeat, model)
        print(key, json.dumps(rows[key]), flush=True)
    result: dict[str, Any] = {"model": label, "batch": args.batch, "seq": args.seq, "exact": args.exact,
                              "threads": torch.get_num_threads(), "splices": rows,
                              "splices_added_ms": round(sum(r["added_ms"] for r in rows.values()), 1)}
    if args.step:
        times: dict[str, list[float]] = {"unpatched": [], "patched": []}
        for _ in range(3):
            for v in times:
                runtime.remove(model) if v == "unpatched" else runtime.apply(model, work / "patch")
                times[v].append(step(model, ids, cpu_time=True))
        med = {v: statistics.median(t) for v, t in times.items()}
        result["step_s"] = {v: round(t, 3) for v, t in med.items()}
        result["rest_ms"] = round(1e3 * (med["patched"] - med["unpatched"]) - result["splices_added_ms"], 1)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
