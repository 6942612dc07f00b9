"""Every GPU check in one run, into one JSON: what a lent GPU session runs (at most 7 minutes on one H100/H200).

    python benchmarks/inductor_gpu_checks.py --device cuda --json OUT.json
    python benchmarks/inductor_gpu_checks.py --device cpu --quick --json OUT.json   # the rehearsal, on a CPU

The GPU machine has torch, triton and transformers but not pydantic (nor vLLM): carry its wheels. Once, here, in the
repository root: `scripts/gpu_wheels.sh` (it adds `/.whl/` to .git/info/exclude and downloads pydantic,
pydantic-core, annotated-types, typing-inspection and typing-extensions, the versions installed here, for CPython 3.12
manylinux, into .whl/). Then the device call, with `.whl` in its carry, is

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit; export PYTHONUNBUFFERED=1; \
    timeout 450 python3 benchmarks/inductor_gpu_checks.py --device cuda --json $OUT/gpu_checks.json

Steps, in this order, each guarded (its error recorded, the rest goes on), each with its own time budget (the run
stops starting steps at `--budget-s`, 420 s on a GPU), the JSON rewritten (temp file + rename) after each:
0. `imports`: the import chain (torch, triton, transformers, pydantic and its three helpers, graphdiff and every
   graphdiff module a step imports) and torch's CUDA device, written at once: a missing wheel costs seconds, and every
   later step is skipped with the reason;
1. `cuda_gemm`: cuBLAS BF16 GEMM (`F.linear`) with `allow_bf16_reduced_precision_reduction` on and off against
   `replay.cuda_reference.cublas_gemm` (FP32 accumulation, rounded once) and an FP64 sum rounded once;
2. `cuda_sdpa`: torch's flash and memory-efficient SDPA against an FP32 attention rounded once and against
   `cuda_reference.attention_p_bf16` (P rounded to BF16 before P@V) at several key block sizes;
3. `triton_replay`: the recorded H200 dump's Triton kernels (fixtures/dumps/inductor-triton-h200-tiny-qwen3-hf) run
   in Triton's interpreter against the replay (`triton_replay`, `benchmarks/triton_replay.py`; the same kernels
   on the device with the recorded inputs are not wired yet);
4. per tiny architecture (qwen3, then llama last): `ARCH.scan` (`graphdiff scan tiny:ARCH --engine inductor
   --device D --patch --kl`, in this process), then from its outputs `ARCH.kernel_replay` (the predicted rounding
   model's bit-identical fraction per kernel and shape), `ARCH.gap` (per 128-position bucket, unpatched and patched)
   and `ARCH.splices` (`codegen.verify`: each splice's Triton kernels against the PyTorch path and the plan replay on
   D; on a CPU in Triton's interpreter, TRITON_INTERPRET=1, set here before Triton is imported);
5. `training_step` (after qwen3): the step at Qwen3-8B width (2 x 2048 tokens, all 36 layers, random weights made on
   the device), patched and unpatched, with peak memory (`patch_step_benchmark.py`, on a 2-layer scan of that
   config); `--quick` times the tiny Qwen3's step instead (2 x 128).
Each step's time is printed as it ends; the exit status is 1 where a step failed. `--quick` runs every step small
(shapes, GEMM and attention sizes).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DUMP = ROOT / "fixtures" / "dumps" / "inductor-triton-h200-tiny-qwen3-hf"
TRITON_REPLAY_MODULE = "graphdiff.replay.triton_kernels"  # the interpreter run `triton_replay` measures
# what the steps import, in the order a missing one is best named (the wheels carried to the GPU machine first)
IMPORT_CHAIN = ("torch", "triton", "transformers", "typing_extensions", "pydantic_core", "annotated_types",
                "typing_inspection", "pydantic", "graphdiff", "graphdiff.records", "graphdiff.artifacts",
                "graphdiff.capture.shapes", "graphdiff.engines.inductor", "graphdiff.measure.gate",
                "graphdiff.pipeline", "graphdiff.codegen.verify", "graphdiff.replay.cuda_reference")
DISTRIBUTIONS = {"typing_extensions": "typing-extensions", "pydantic_core": "pydantic-core",
                 "annotated_types": "annotated-types", "typing_inspection": "typing-inspection"}


class Skipped(Exception):  # noqa: N818 - a step's outcome, not an error
    """A step that did not run, and why (recorded as `skipped`, not as an error)."""


class StepTimeout(Exception):
    """A step ran past its budget (raised in it by SIGALRM)."""


@dataclass
class Step:
    name: str
    budget_s: float
    fn: Callable[[], object]
    needs: tuple[str, ...] = ()  # earlier steps that must have succeeded


def write_json(path: Path, result: dict) -> None:
    """`result` into `path` by a temp file and a rename: a run killed mid-write leaves the previous JSON whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(tmp, path)


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """StepTimeout raised in the step once `seconds` have passed (SIGALRM: main thread, Python code)."""
    def on_alarm(signum: int, frame: object) -> None:
        raise StepTimeout(f"over its budget of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_step(step: Step, done: dict[str, dict], seconds: float) -> dict:
    """One step's record: `result`, or `error` (+ traceback, + `detail` the exception carries), or `skipped`."""
    failed = [n for n in step.needs if n not in done or "result" not in done[n]]
    if failed:
        return {"skipped": f"needs {', '.join(failed)}, which did not succeed"}
    if seconds < min(1.0, step.budget_s):  # less than a second left: starting it would only be cut off
        return {"skipped": "the run's time budget is spent"}
    try:
        with time_limit(seconds):
            return {"result": step.fn()}
    except Skipped as e:
        return {"skipped": str(e)}
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, the run goes on
        entry: dict[str, Any] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        if getattr(e, "detail", None) is not None:
            entry["detail"] = e.detail  # type: ignore[attr-defined]
        return entry


def run_steps(steps: list[Step], result: dict, path: Path, budget_s: float) -> dict:
    """Each step in turn under min(its budget, what is left of `budget_s`), into result["steps"], the JSON at `path`
    rewritten after each; each step's time printed."""
    start = time.perf_counter()
    done: dict[str, dict] = result.setdefault("steps", {})
    for step in steps:
        t = time.perf_counter()
        allowed = min(step.budget_s, budget_s - (t - start))
        entry = run_step(step, done, allowed)
        entry["seconds"] = round(time.perf_counter() - t, 1)
        entry["budget_s"] = step.budget_s
        done[step.name] = entry
        result["seconds_total"] = round(time.perf_counter() - start, 1)
        write_json(path, result)
        state = "ok" if "result" in entry else "skipped" if "skipped" in entry else "ERROR"
        why = entry.get("skipped") or entry.get("error") or ""
        print(f"[{entry['seconds']:7.1f} s / {step.budget_s:.0f} s] {step.name}: {state} {why}"[:300], flush=True)
    return result


class ImportChainError(Exception):
    def __init__(self, message: str, detail: dict) -> None:
        super().__init__(message)
        self.detail = detail


def version_of(name: str, module: object) -> str:
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return f"imported from {getattr(module, '__file__', '?')}"


def import_chain(device: str) -> dict:
    """Every module the steps import, with its version, and torch's view of the device; ImportChainError (with what
    was found) naming the first missing module, or a CUDA run where torch sees no GPU."""
    found: dict[str, Any] = {"python": sys.version.split()[0], "modules": {}}
    missing = []
    for name in IMPORT_CHAIN:
        try:
            found["modules"][name] = version_of(name, importlib.import_module(name))
        except Exception as e:  # noqa: BLE001 - a broken wheel raises more than ImportError
            found["modules"][name] = f"error: {type(e).__name__}: {e}"
            missing.append(name)
    found["triton_replay_module"] = importlib.util.find_spec(TRITON_REPLAY_MODULE) is not None
    if "torch" not in missing:
        import torch

        found["cuda_available"] = torch.cuda.is_available()
        found["device_name"] = torch.cuda.get_device_name() if found["cuda_available"] else None
    if missing:
        raise ImportChainError(f"cannot import {', '.join(missing)}", found)
    if device == "cuda" and not found["cuda_available"]:
        raise ImportChainError("torch sees no CUDA device", found)
    return found


def triton_mode(device: str) -> str:
    """How the Triton part runs: on the GPU, in the interpreter (CPU), or why it is skipped."""
    if importlib.util.find_spec("triton") is None:
        return "skipped: triton is not importable in this environment"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        return "interpreter (TRITON_INTERPRET=1)"
    return "cuda"


def compare(got: Any, want: Any) -> dict:
    """Fraction of elements bit-identical (BF16) and the largest difference, on the CPU."""
    a, b = got.detach().cpu(), want.detach().cpu().to(got.dtype)
    return {"identical": round(float((a == b).float().mean()), 6),
            "max_abs_diff": float((a.float() - b.float()).abs().max())}


def cuda_gemm(device: str, quick: bool) -> dict:
    """cuBLAS BF16 GEMM with the reduced-precision flag on and off against FP32 accumulation rounded once
    (`cuda_reference.cublas_gemm`, on the device, TF32 off) and an FP64 sum rounded once: where the flag lets cuBLAS
    round partial sums, the on-rows fall below the off-rows at large K."""
    import torch

    from graphdiff.replay.cuda_reference import cublas_gemm

    m, n, ks = (16, 64, (256, 2048)) if quick else (512, 4096, (4096, 14336))
    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction, flags.allow_tf32
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict] = {}
    try:
        flags.allow_tf32 = False  # the FP32 reference must sum in FP32
        for k in ks:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(device)
            fp32, fp64 = cublas_gemm(x, w), (x.double() @ w.double().t()).to(torch.bfloat16)
            row = {}
            for on in (True, False):
                flags.allow_bf16_reduced_precision_reduction = on
                y = torch.nn.functional.linear(x, w)
                row[f"reduced_precision_{'on' if on else 'off'}"] = {"vs_fp32_round_once": compare(y, fp32),
                                                                     "vs_fp64_round_once": compare(y, fp64)}
            out[f"{m}x{n}x{k}"] = row
    finally:
        flags.allow_bf16_reduced_precision_reduction, flags.allow_tf32 = saved
    return out


def cuda_sdpa(device: str, quick: bool) -> dict:
    """torch's flash and memory-efficient SDPA (causal, BF16) against FP32 attention rounded once and against
    `cuda_reference.attention_p_bf16` (P in BF16 before P@V) with one key block and with blocks of 64 and 128 keys;
    the references on the CPU."""
    import torch
    import torch.nn.functional as F  # noqa: N812
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from graphdiff.replay.cuda_reference import attention_p_bf16

    h, t, d = (2, 256, 64) if quick else (8, 1024, 128)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, t, d, generator=gen).to(torch.bfloat16) for _ in range(3))
    scale = d ** -0.5
    s = (q[0].float() @ k[0].float().transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    refs = {"fp32_round_once": (torch.softmax(s, -1) @ v[0].float()).to(torch.bfloat16)}
    for block in (None, 64, 128):
        refs[f"p_bf16_block_{block or 'all'}"] = attention_p_bf16(q[0], k[0], v[0], scale, block_n=block)
    out: dict[str, dict] = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                y = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device), is_causal=True,
                                                   scale=scale)[0]
        except RuntimeError as e:  # a backend the device or the shapes do not have
            out[backend.name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        out[backend.name] = {name: compare(y, ref) for name, ref in refs.items()}
    return {"shape": [1, h, t, d], **out}


def triton_replay(dump: Path, device: str) -> dict:
    """The recorded dump's Triton kernels in Triton's interpreter against the replay (`benchmarks/triton_replay.py`,
    its own process: TRITON_INTERPRET=1 must be set before Triton is imported): per interpreter variant, the calls
    that replay bit for bit. Running the same kernels on `device` with the recorded inputs is not wired yet."""
    if importlib.util.find_spec(TRITON_REPLAY_MODULE) is None:
        raise Skipped(f"not available: {TRITON_REPLAY_MODULE} is not importable")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "triton_replay.json"
        proc = subprocess.run([sys.executable, str(HERE / "triton_replay.py"), "--json", str(out)],
                              env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                              timeout=300)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        measured = json.loads(out.read_text())
    return {"dump": dump.name, "on_device": f"not run on {device} yet: the interpreter against the replay only",
            **{variant: {"calls": len(rows), "bit_identical": sum(r["bitexact"] == 1.0 for r in rows)}
               for variant, rows in measured.items()}}


def scan_model(model: str, out: Path, device: str, shapes: list[int], gap_tokens: int, kl: bool = True,
               layers: int | None = None) -> dict:
    """`scan MODEL --engine inductor --device D --patch [--kl]` into `out`, with the gap measured on
    `gap_tokens`-token teacher-forced continuations of the gate's prompts."""
    from graphdiff.artifacts import ScanDir, staged
    from graphdiff.capture.shapes import prefill
    from graphdiff.engines.base import EngineOptions
    from graphdiff.measure.gate import GATE_PROMPTS
    from graphdiff.pipeline import Extras, run_extras, scan
    from graphdiff.records import SampleAsk

    with staged(out, "scan") as tmp:
        outcome = scan(model, options=EngineOptions(engine="inductor", device=device), layers=layers, tokens=shapes[0],
                       shapes=[prefill(n) for n in shapes], out=ScanDir(tmp),
                       sample=SampleAsk(count=GATE_PROMPTS, prompt_tokens=16, max_tokens=gap_tokens))
        run_extras(ScanDir(tmp), outcome, Extras(patch=True, kl=kl, gap_tokens=gap_tokens))
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
        raise RuntimeError("no gap measured")
    rows: dict[str, Any] = {}
    for m in kl.measurements:
        rows["patched" if m.regions else "unpatched"] = {
            "rms": m.rms, "k3": m.k3, "bitexact_fraction": m.bitexact_fraction, "tokens": m.tokens,
            "buckets": [{"positions": f"{b.start}-{b.stop - 1}", "rms": b.rms, "bitexact_fraction": b.bitexact_fraction}
                        for b in m.position]}
    equal = "patched" in rows and all(b["bitexact_fraction"] == 1.0 for b in rows["patched"]["buckets"])
    return {**rows, "patched_equal_in_every_bucket": equal}


def training_step(work: Path, device: str, quick: bool, scan_dir: Path, timeout: float) -> dict:
    """patch_step_benchmark.py on the Qwen3-8B width (or, `quick`, the tiny Qwen3 of `scan_dir`)."""
    t = time.perf_counter()
    if quick:
        args = ["--scan", str(scan_dir), "--arch", "qwen3", "--batch", "2", "--seq", "128", "--steps", "2"]
    else:
        big = work / "Qwen3-8B"
        scan_model("Qwen/Qwen3-8B", big, device, [16], 16, kl=False, layers=2)
        args = ["--scan", str(big), "--config", "Qwen/Qwen3-8B", "--batch", "2", "--seq", "2048", "--steps", "2"]
    out = work / "step.json"
    run = subprocess.run([sys.executable, str(HERE / "patch_step_benchmark.py"), *args, "--device", device,
                          "--variants", "unpatched,all", "--allow-version-mismatch", "--json", str(out)],
                         capture_output=True, text=True, timeout=max(timeout - (time.perf_counter() - t), 1),
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                                      "")])})
    if run.returncode != 0:
        raise RuntimeError(f"rc {run.returncode}: {(run.stdout + run.stderr)[-3000:]}")
    return json.loads(out.read_text())


# seconds per step: (on a GPU, --quick on a CPU); on a GPU they sum to more than the 420 s run: llama, last, is
# what a slow machine leaves out
BUDGETS = {"imports": (30, 120), "cuda_gemm": (20, 60), "cuda_sdpa": (30, 60), "triton_replay": (45, 300),
           "scan": (75, 600), "kernel_replay": (10, 30), "gap": (5, 30), "splices": (40, 300),
           "training_step": (120, 300)}


def arch_steps(arch: str, work: Path, device: str, quick: bool, triton: str, budget: Callable[[str], float]) -> list:
    scan_dir = work / arch
    shapes, tokens = ([16, 128], 128) if quick else ([16, 1024], 512)
    scan = f"{arch}.scan"
    return [Step(scan, budget("scan"), lambda: scan_model(f"tiny:{arch}", scan_dir, device, shapes, tokens),
                 ("imports",)),
            Step(f"{arch}.kernel_replay", budget("kernel_replay"), lambda: kernel_replay(scan_dir), (scan,)),
            Step(f"{arch}.gap", budget("gap"), lambda: gap(scan_dir), (scan,)),
            Step(f"{arch}.splices", budget("splices"),
                 lambda: splices(scan_dir, device, triton=not triton.startswith("skipped")), (scan,))]


def all_steps(args: argparse.Namespace, work: Path, triton: str) -> list[Step]:
    """The steps in run order: the import chain, the cheap new checks, the first arch and the training step on its
    scan, the other archs last (what the 7 minutes leave out is the least new)."""
    def budget(name: str) -> float:
        return BUDGETS[name][1 if args.quick else 0]

    archs = args.archs.split(",")
    first = archs[0]
    steps = [Step("imports", budget("imports"), lambda: import_chain(args.device)),
             Step("cuda_gemm", budget("cuda_gemm"), lambda: cuda_gemm(args.device, args.quick), ("imports",)),
             Step("cuda_sdpa", budget("cuda_sdpa"), lambda: cuda_sdpa(args.device, args.quick), ("imports",)),
             Step("triton_replay", budget("triton_replay"), lambda: triton_replay(DUMP, args.device), ("imports",))]
    steps += arch_steps(first, work, args.device, args.quick, triton, budget)
    steps.append(Step("training_step", budget("training_step"), lambda: training_step(
        work, args.device, args.quick, work / first, budget("training_step")), (f"{first}.scan",)))
    for arch in archs[1:]:
        steps += arch_steps(arch, work, args.device, args.quick, triton, budget)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="small sizes, the tiny model's step (the CPU rehearsal)")
    ap.add_argument("--archs", default="qwen3,llama", help="tiny architectures to scan")
    ap.add_argument("--json", type=Path, default=Path("gpu_checks.json"), help="rewritten after each step")
    ap.add_argument("--work", type=Path, help="keep the scans here (default: a temporary directory)")
    ap.add_argument("--budget-s", type=float, help="no step starts after this (default 420 s; --quick 3600 s)")
    args = ap.parse_args()
    if str(ROOT) not in sys.path:  # graphdiff from this checkout, as on the GPU machine (no install there)
        sys.path.insert(0, str(ROOT))
    triton = triton_mode(args.device)
    work = args.work or Path(tempfile.mkdtemp(prefix="gd-gpu-checks-"))
    result: dict = {"device": args.device, "quick": args.quick, "triton": triton, "archs": args.archs.split(","),
                    "work": str(work), "steps": {}}
    write_json(args.json, result)
    budget_s = args.budget_s or (3600.0 if args.quick else 420.0)
    run_steps(all_steps(args, work, triton), result, args.json, budget_s)
    steps = result["steps"].items()
    states = {n: "ok" if "result" in e else "skipped" if "skipped" in e else "error" for n, e in steps}
    print(json.dumps({"json": str(args.json), "seconds_total": result["seconds_total"], "steps": states}, indent=1))
    sys.exit(1 if "error" in states.values() else 0)  # a device call's rc says whether a step failed


if __name__ == "__main__":
    main()
