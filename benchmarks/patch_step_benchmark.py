"""Training-step cost of the patch: forward+backward time, patched / unpatched, in one process.

    python benchmarks/patch_step_benchmark.py --scan fixtures/scans/tiny-qwen3 --arch qwen3
    python benchmarks/patch_step_benchmark.py --scan DIR --model CHECKPOINT_DIR --batch 4 --seq 512

The model is a seeded tiny checkpoint of the scan's config (or --model). On CPU the runtime uses the
generated PyTorch functions; on a GPU (--device cuda) the Triton kernels. Steps alternate between the
two configurations (remove/apply between them) so that drift in machine speed hits both alike; the
median of each is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from graphdiff import runtime
from graphdiff.codegen import generate


def step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    model.zero_grad(set_to_none=True)
    sync()
    t = time.perf_counter()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scan", type=Path, required=True, help="scan directory (scan.json + train.capture.json)")
    ap.add_argument("--arch", default="qwen3", help="tiny architecture to build when --model is not given")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--model", type=Path, help="checkpoint dir (its config must match the scan)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from graphdiff.capture.hf import load_hf_model
    from graphdiff.tiny import make_tiny

    work = Path(tempfile.mkdtemp(prefix="gd-bench-"))
    model_dir = args.model or make_tiny(args.arch, work / "model", layers=args.layers)
    manifest = generate(args.scan, work / "patch")
    model = load_hf_model(model_dir).to(args.device).train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)
    times: dict[str, list[float]] = {"unpatched": [], "patched": []}
    for label in ("unpatched", "patched"):  # warm-up (allocator, Triton compile)
        runtime.apply(model, work / "patch") if label == "patched" else runtime.remove(model)
        step(model, ids)
    for _ in range(args.steps):
        for label in ("unpatched", "patched"):
            runtime.apply(model, work / "patch") if label == "patched" else runtime.remove(model)
            times[label].append(step(model, ids))
    med = {k: statistics.median(v) for k, v in times.items()}
    path = "triton" if args.device.startswith("cuda") and any(s.triton_fn for s in manifest.splices) else "pytorch"
    print(json.dumps({
        "model": str(model_dir), "architecture": manifest.architecture, "device": args.device, "path": path,
        "batch": args.batch, "seq": args.seq, "steps": args.steps, "threads": torch.get_num_threads(),
        "unpatched_s": round(med["unpatched"], 4), "patched_s": round(med["patched"], 4),
        "ratio": round(med["patched"] / med["unpatched"], 3),
    }, indent=1))


if __name__ == "__main__":
    main()
