"""Peak memory of a training step (forward + backward), unpatched and patched, measured on the CPU.

    TRITON_INTERPRET=1 python benchmarks/patch_memory_benchmark.py --scan fixtures/scans/tiny-qwen3 --arch qwen3
    python benchmarks/patch_memory_benchmark.py --scan SCAN_DIR --config Qwen/Qwen3-0.6B --batch 1 --seq 1024 \\
        --variants unpatched,torch --saved-only [--exact]

Two numbers per variant, both from torch's own allocator events (no sampling):
- peak: the most tensor memory live at once during the step, above what was live before it (parameters),
  from the profiler's allocation and free events (`profile_memory=True`), in time order;
- saved: bytes of the distinct tensors autograd saves for the backward during the forward (saved-tensor hooks), with
  and without the parameters (which every variant keeps alike).

Variants: `unpatched` (HF eager), `torch` (every region aligned, the generated PyTorch functions: what the runtime
runs on a CPU), `triton` (the same with the Triton kernels, GRAPHDIFF_TRITON=1: needs TRITON_INTERPRET=1, in
which the kernels run in numpy, whose own buffers torch does not see). On a GPU the same comparison is
`patch_step_benchmark.py --device cuda` (torch.cuda.max_memory_allocated). `--splice-rows N` adds the peak of
one norm splice's Triton backward over N rows (where the weight gradient's buffer shows). `--config` takes a bundled
model at full depth with random weights (patch_step_benchmark.load_model); `--saved-only` runs the forward alone and
reports the saved bytes only (no backward, no profiler: affordable at full depth on a CPU whose BF16 GEMMs are slow).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from graphdiff import runtime
from graphdiff.codegen import generate


def saved_storages(fn: Callable[[], object]) -> tuple[object, dict[int, int]]:
    """`fn`'s result and the distinct storages autograd saves for the backward while it runs (pointer -> bytes)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, saved


def peak_and_saved(model: torch.nn.Module, ids: torch.Tensor, saved_only: bool = False) -> tuple[int | None, int, int]:
    """(peak, saved, saved less the parameters) bytes of one step; `saved_only`: peak None, the forward alone."""
    model.zero_grad(set_to_none=True)
    saved: dict[int, int] = {}

    def step() -> None:
        loss, kept = saved_storages(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
        saved.update(kept)
        if not saved_only:
            loss.backward()

    if saved_only:
        step()
        return None, sum(saved.values()), _activations(model, saved)
    peak = peak_of(step)
    model.zero_grad(set_to_none=True)
    return peak, sum(saved.values()), _activations(model, saved)


def _activations(model: torch.nn.Module, saved: dict[int, int]) -> int:
    """The saved bytes that are not the model's parameters (which every variant keeps alike)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in params)


def peak_of(fn: Callable[[], object]) -> int:
    """The most CPU tensor memory live at once while `fn` runs, above what was live when it started."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int]] = []  # (time, bytes): allocations positive, frees negative

    def walk(node) -> None:  # noqa: ANN001 - a profiler event node
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def splice_backward_peak(gen: object, splice: object, hidden: int, rows: int) -> int:
    """Peak memory of one norm splice's Triton backward (x: rows x hidden BF16, weight: hidden BF16)."""
    gen_ = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen_).to(torch.bfloat16).requires_grad_()
    w = torch.randn(hidden, generator=gen_).to(torch.bfloat16).requires_grad_()
    y = getattr(gen, splice.triton_fn)(x, w, align=frozenset(splice.regions))[0]
    g = torch.ones_like(y)
    return peak_of(lambda: torch.autograd.grad(y, (x, w), g))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from patch_step_benchmark import load_model, model_arguments  # beside this script

    model_arguments(ap)
    ap.add_argument("--variants", default="unpatched,torch,triton")
    ap.add_argument("--exact", action="store_true", help="the patch runs the engine's own ops (`patch --exact`)")
    ap.add_argument("--saved-only", action="store_true", help="the forward's saved bytes only (no backward, no peak)")
    ap.add_argument("--splice-rows", type=int, default=0,
                    help="also: peak of model.norm's Triton backward alone over this many rows (TRITON_INTERPRET=1)")
    ap.add_argument("--out", type=Path, help="write the numbers as JSON here")
    ap.set_defaults(batch=2, seq=64)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="graphdiff-mem-"))
    model, _ = load_model(args, work)
    manifest = generate(args.scan, work / "patch", exact=args.exact)
    regions = [r.name for r in manifest.regions if r.generated]
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    results = {}
    for variant in args.variants.split(","):
        if variant == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            print("triton: skipped (set TRITON_INTERPRET=1 to run the kernels on the CPU)")
            continue
        os.environ["GRAPHDIFF_TRITON"] = "1" if variant == "triton" else "0"
        if variant != "unpatched":
            runtime.apply(model, work / "patch" / "manifest.json", regions=regions)
        if not args.saved_only:
            peak_and_saved(model, ids)  # warm-up: lazy initialisation is not the step's memory
        peak, saved, activations = peak_and_saved(model, ids, args.saved_only)
        if variant != "unpatched":
            runtime.remove(model)
        results[variant] = {"peak_bytes": peak, "saved_bytes": saved, "saved_activation_bytes": activations}
        base = results.get("unpatched")
        ratios = [f"{saved / base['saved_bytes']:.3f}x saved",
                  f"{activations / base['saved_activation_bytes']:.3f}x without the parameters"] if base else []
        ratios += [f"{peak / base['peak_bytes']:.3f}x peak"] if base and peak is not None else []
        ratio = f"  ({', '.join(ratios)})" if ratios else ""
        shown = "-" if peak is None else f"{peak / 2**20:8.2f}"
        print(f"{variant:10s} peak {shown} MiB  saved for backward {saved / 2**20:8.2f} MiB "
              f"({activations / 2**20:.2f} MiB without the parameters){ratio}", flush=True)
    if args.splice_rows and os.environ.get("TRITON_INTERPRET") == "1":
        from graphdiff.runtime import load_generated

        gen = load_generated(manifest, work / "patch" / "manifest.json")
        splice = next(s for s in manifest.splices if s.key == "model.norm")
        peak = splice_backward_peak(gen, splice, model.config.hidden_size, args.splice_rows)
        grads = args.splice_rows * model.config.hidden_size * 2 + model.config.hidden_size * 2
        results["norm_backward"] = {"rows": args.splice_rows, "peak_bytes": peak, "gradient_bytes": grads}
        print(f"model.norm Triton backward, {args.splice_rows} x {model.config.hidden_size}: "
              f"peak {peak / 2**20:.2f} MiB (the BF16 gradients themselves: {grads / 2**20:.2f} MiB)")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
