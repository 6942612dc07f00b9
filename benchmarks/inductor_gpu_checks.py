"""`--engine inductor` on a device in one go, into one JSON: what a lent GPU session runs (well inside 10 minutes).

    python benchmarks/inductor_gpu_checks.py --device cuda --json OUT.json
    python benchmarks/inductor_gpu_checks.py --device cpu --quick --json OUT.json   # the same steps, small, on a CPU

Per tiny architecture (qwen3, llama): `graphdiff scan tiny:ARCH --engine inductor --device D --patch --kl` (in this
process, through the pipeline), then from its outputs
1. kernel replay per kernel: the predicted rounding model's bit-identical fraction at every recorded shape;
2. per splice, the Triton kernels against the PyTorch path and the plan replay (`graphdiff.codegen.verify`) on D;
   on a CPU in Triton's interpreter (TRITON_INTERPRET=1, set here before Triton is imported), skipped (and said so
   in the JSON) where Triton is not importable;
3. the gap per 128-position bucket, unpatched and patched (the compiled model's teacher-forced log-probs).
Then the training step at Qwen3-8B width (2 x 2048 tokens, all 36 layers, random weights made on the device),
patched and unpatched, with peak memory (`patch_step_benchmark.py` beside this script, on a 3-layer scan of that
config); `--quick` times the tiny Qwen3's step instead (2 x 128). No step stops the others: each records its error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent


def triton_mode(device: str) -> str:
    """How the Triton part runs: on the GPU, in the interpreter (CPU), or why it is skipped."""
    if importlib.util.find_spec("triton") is None:
        return "skipped: triton is not importable in this environment"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        return "interpreter (TRITON_INTERPRET=1)"
    return "cuda"


def guarded(entry: dict, key: str, fn: Callable[[], object]) -> None:
    """entry[key] = fn(), or its error: one failing step does not stop the run."""
    t = time.perf_counter()
    try:
        entry[key] = fn()
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, the run goes on
        entry[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    entry.setdefault("seconds", {})[key] = round(time.perf_counter() - t, 1)


def scan_model(model: str, out: Path, device: str, shapes: list[int], gap_tokens: int, kl: bool = True,
               layers: int | None = None) -> dict:
    """`scan MODEL --engine inductor --device D --patch [--kl]` into `out`, with the gap measured on
    `gap_tokens`-token teacher-forced continuations of the gate's prompts."""
    from graphdiff.artifacts import ScanDir, staged
    from graphdiff.capture.shapes import prefill
    from graphdiff.measure.gate import GATE_PROMPTS
    from graphdiff.pipeline import Extras, scan, write_outputs
    from graphdiff.records import SampleAsk

    with staged(out, "scan") as tmp:
        outcome = scan(model, layers=layers, tokens=shapes[0], shapes=[prefill(n) for n in shapes], out=ScanDir(tmp),
                       sample=SampleAsk(count=GATE_PROMPTS, prompt_tokens=16, max_tokens=gap_tokens),
                       engine="inductor", device=device)
        write_outputs(ScanDir(tmp), outcome, None, Extras(patch=True, kl=kl, gap_tokens=gap_tokens))
    r = outcome.result
    return {"sites": len(r.sites), "regions": len(r.regions), "not_replayed": r.not_replayed,
            "unexplained": len(r.unexplained), "departure": r.departure.model_dump() if r.departure else None}


def kernel_replay(scan_dir: Path) -> dict:
    """Per generated kernel, the predicted model's bit-identical fraction at each shape, and the worst."""
    from graphdiff.artifacts import ScanDir

    scan = ScanDir(scan_dir).load_scan()
    kernels: dict[str, dict[str, float | str]] = {}
    for e in scan.replay:
        kernels.setdefault(e.kernel, {})[e.shape] = e.error or round(e.predicted_bitexact, 6)
    worst = min((v for k in kernels.values() for v in k.values() if isinstance(v, float)), default=None)
    failed = [k for k, v in kernels.items() if any(isinstance(x, str) for x in v.values())]
    return {"kernels": kernels, "worst_predicted": worst, "proven": worst is not None and worst >= 0.999
            and not failed, "errors": failed}


def splices(scan_dir: Path, device: str, triton: bool) -> dict:
    """`verify` of the scan's patch on `device`: per splice and path, bit-identical or by how many ulp."""
    from graphdiff.codegen.verify import verify

    checks = verify(scan_dir, scan_dir / "patch", device=device, triton=triton)
    per: dict[str, list[dict]] = {}
    for c in checks:
        per.setdefault(c.splice, []).append({"path": c.path, "aligned": c.aligned, "identical": c.identical,
                                             "max_ulp": c.max_ulp, "ok": c.ok, "grad_rel_err": c.grad_rel_err})
    return {"checks": len(checks), "failed": sum(not c.ok for c in checks),
            "triton_checks": sum(c.path == "triton" for c in checks),
            "triton_identical": sum(c.identical for c in checks if c.path == "triton"), "splices": per}


def gap(scan_dir: Path) -> dict:
    """The gap per position bucket, unpatched and patched (scan.json `kl`)."""
    from graphdiff.artifacts import ScanDir

    kl = ScanDir(scan_dir).load_scan().kl
    if kl is None:
        return {"error": "no gap measured"}
    rows = {}
    for m in kl.measurements:
        rows["patched" if m.regions else "unpatched"] = {
            "rms": m.rms, "k3": m.k3, "bitexact_fraction": m.bitexact_fraction, "tokens": m.tokens,
            "buckets": [{"positions": f"{b.start}-{b.stop - 1}", "rms": b.rms, "bitexact_fraction": b.bitexact_fraction}
                        for b in m.position]}
    equal = "patched" in rows and all(b["bitexact_fraction"] == 1.0 for b in rows["patched"]["buckets"])
    return {**rows, "patched_equal_in_every_bucket": equal}


def training_step(work: Path, device: str, quick: bool, scan_dir: Path | None) -> dict:
    """patch_step_benchmark.py on the Qwen3-8B width (or, `quick`, the tiny Qwen3 of `scan_dir`)."""
    if quick:
        assert scan_dir is not None
        args = ["--scan", str(scan_dir), "--arch", "qwen3", "--batch", "2", "--seq", "128", "--steps", "2"]
    else:
        big = work / "Qwen3-8B"
        scan_model("Qwen/Qwen3-8B", big, device, [16], 16, kl=False, layers=3)
        args = ["--scan", str(big), "--config", "Qwen/Qwen3-8B", "--batch", "2", "--seq", "2048", "--steps", "2"]
    out = work / "step.json"
    run = subprocess.run([sys.executable, str(HERE / "patch_step_benchmark.py"), *args, "--device", device,
                          "--variants", "unpatched,all", "--allow-version-mismatch", "--json", str(out)],
                         capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(HERE.parent), os.environ.get("PYTHONPATH", "")])})
    if run.returncode != 0:
        return {"error": f"rc {run.returncode}", "log": (run.stdout + run.stderr)[-3000:]}
    return json.loads(out.read_text())


def check_arch(arch: str, work: Path, device: str, quick: bool, triton: str) -> dict:
    entry: dict = {}
    scan_dir = work / arch
    shapes, tokens = ([16, 128], 128) if quick else ([16, 512, 2048], 1024)
    guarded(entry, "scan", lambda: scan_model(f"tiny:{arch}", scan_dir, device, shapes, tokens))
    if "error" in entry["scan"]:
        return entry
    guarded(entry, "kernel_replay", lambda: kernel_replay(scan_dir))
    guarded(entry, "gap", lambda: gap(scan_dir))
    guarded(entry, "splices", lambda: splices(scan_dir, device, triton=not triton.startswith("skipped")))
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="small shapes and gap, the tiny model's step (a CPU run)")
    ap.add_argument("--archs", default="qwen3,llama", help="tiny architectures to scan")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--work", type=Path, help="keep the scans here (default: a temporary directory)")
    args = ap.parse_args()
    triton = triton_mode(args.device)
    import torch
    import transformers

    from graphdiff.engines.inductor import check_device

    check_device(args.device)
    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "torch": torch.__version__, "transformers": transformers.__version__, "triton": triton,
                    "quick": args.quick, "archs": {}}
    work = args.work or Path(tempfile.mkdtemp(prefix="gd-inductor-gpu-"))
    t = time.perf_counter()
    for arch in args.archs.split(","):
        result["archs"][arch] = check_arch(arch, work, args.device, args.quick, triton)
        print(json.dumps({arch: result["archs"][arch]}, indent=1, default=str), flush=True)
    first = work / args.archs.split(",")[0]
    guarded(result, "training_step", lambda: training_step(work, args.device, args.quick, first))
    result["seconds"]["total"] = round(time.perf_counter() - t, 1)
    text = json.dumps(result, indent=1, default=str) + "\n"
    if args.json:
        args.json.write_text(text)
    print(json.dumps({"training_step": result["training_step"], "seconds": result["seconds"]}, indent=1,
                     default=str))


if __name__ == "__main__":
    main()
