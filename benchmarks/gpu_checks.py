"""What only a GPU can show about the generated patch: the Triton kernels on real hardware.

    python benchmarks/gpu_checks.py SCAN_DIR [SCAN_DIR ...] --json OUT.json

1. `graphdiff.codegen.verify` on CUDA for every scan's patch: each splice's PyTorch path bit-identical to
   the plan replay, its Triton kernels bit-identical to the PyTorch path (FP32 transcendental outputs in
   ulp), backward within a relative error of a float64 replay.
2. Whole model (the seeded tiny checkpoint of each tiny:ARCH scan): logits and loss of the patched model,
   Triton path vs PyTorch path on the same GPU, and the training step's gradients (finite, close to the
   unpatched model's).
Prints one JSON document; no assertion stops it halfway (a device run is short and costly).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from graphdiff import runtime
from graphdiff.codegen import generate
from graphdiff.codegen.verify import verify


def whole_model(patch: Path, arch: str, work: Path, device: str) -> dict:
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.models.tiny import make_tiny

    model = load_hf_model(make_tiny(arch, work / f"model-{arch}")).to(device)
    ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0)).to(device)

    def run(triton: bool | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        if triton is None:
            runtime.remove(model)
        else:
            os.environ["GRAPHDIFF_TRITON"] = "1" if triton else "0"
            runtime.apply(model, patch, allow_version_mismatch=True)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.logits.detach().float(), out.loss.detach(), grads

    base_logits, base_loss, base_grads = run(None)
    torch_logits, torch_loss, torch_grads = run(False)
    tri_logits, tri_loss, tri_grads = run(True)
    os.environ.pop("GRAPHDIFF_TRITON", None)
    runtime.remove(model)

    def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)) for n in b)

    return {
        "logits_identical_triton_vs_torch": bool(torch.equal(tri_logits, torch_logits)),
        "logits_identical_fraction": float((tri_logits == torch_logits).float().mean()),
        "logits_max_abs_triton_vs_torch": float((tri_logits - torch_logits).abs().max()),
        "logits_max_abs_patched_vs_unpatched": float((tri_logits - base_logits).abs().max()),
        "loss": {"unpatched": float(base_loss), "torch": float(torch_loss), "triton": float(tri_loss)},
        "grads_finite": all(bool(torch.isfinite(g).all()) for g in tri_grads.values()),
        "grad_rel_err_triton_vs_torch": rel(tri_grads, torch_grads),
        "grad_rel_err_patched_vs_unpatched": rel(tri_grads, base_grads),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scans", type=Path, nargs="+")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", help="cuda; cpu with TRITON_INTERPRET=1 to try the script")
    args = ap.parse_args()
    import transformers
    import triton

    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result: dict = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
                    "transformers": transformers.__version__, "scans": {}}
    work = Path(tempfile.mkdtemp(prefix="gd-gpu-"))
    for scan_dir in args.scans:
        entry: dict = {}
        result["scans"][scan_dir.name] = entry
        try:
            t = time.perf_counter()
            patch = work / scan_dir.name
            generate(scan_dir, patch)
            checks = verify(scan_dir, patch, device=args.device)
            entry["verify"] = {
                "checks": len(checks), "failed": [c.as_dict() for c in checks if not c.ok],
                "triton_identical": sum(c.identical for c in checks if c.path == "triton"),
                "triton_checks": sum(c.path == "triton" for c in checks),
                "torch_identical": sum(c.identical for c in checks if c.path == "torch"),
                "torch_checks": sum(c.path == "torch" for c in checks),
                "max_ulp_triton": max((c.max_ulp for c in checks if c.path == "triton"), default=0.0),
                "max_grad_rel_err": max(c.grad_rel_err for c in checks),
                "non_identical": [f"{c.splice} {c.path} aligned={c.aligned} ulp={c.max_ulp:.1f} "
                                  f"(allowed {c.ulp_limit}{': ' + c.cause if c.cause else ''})"
                                  for c in checks if not c.identical],
                "seconds": round(time.perf_counter() - t, 1),
            }
            if scan_dir.name.startswith("tiny-"):
                entry["whole_model"] = whole_model(patch, scan_dir.name.removeprefix("tiny-"), work, args.device)
        except Exception as e:  # report and go on with the next scan
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-3000:]
        print(json.dumps({scan_dir.name: entry}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
