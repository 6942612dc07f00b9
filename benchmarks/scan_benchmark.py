"""Scan cost vs the engine's own start-up, and analysis time vs depth (numbers go into the README).

    python benchmarks/scan_benchmark.py wall Qwen/Qwen3-8B          # scan wall time vs plain vLLM start-up
    python benchmarks/scan_benchmark.py depth --layers 9 18 36      # analysis time of tiny-width models

`wall` runs, each in a fresh process with fresh compile caches: (1) plain vLLM on the same
config directory the scan uses (LLM(...) construction: load + compile + warm-up), (2) the full
`graphdiff scan`. Peak memory is the scan process's max RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE_ONLY = r"""
import os, sys, time, tempfile
from pathlib import Path
from graphdiff.capture.vllm import engine_env
work = Path(tempfile.mkdtemp())
os.environ.update(engine_env(work)); os.environ.pop("INDUCTOR_PROVENANCE", None)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
from vllm import LLM
t = time.perf_counter()
LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512, max_num_seqs=4, seed=0)
print("ENGINE_STARTUP_S", time.perf_counter() - t)
"""

SCAN = r"""
import resource, sys, json, time
from graphdiff.scan import scan
t = time.perf_counter()
result, run = scan(sys.argv[1], layers=int(sys.argv[2]) if sys.argv[2] != "-" else None)
wall = time.perf_counter() - t
print("SCAN_JSON", json.dumps({**result.timings, "wall_s": wall, "sites": len(result.sites),
      "regions": len(result.regions), "model_dir": run.capture.model,
      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def _run(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    return proc.stdout


def wall(model: str, layers: str) -> dict:
    out = _run(SCAN, model, layers)
    scan = json.loads(out.split("SCAN_JSON", 1)[1].strip().splitlines()[0])
    engine = float(_run(ENGINE_ONLY, scan["model_dir"]).split("ENGINE_STARTUP_S", 1)[1].split()[0])
    return {"model": model, "engine_startup_s": round(engine, 1), "scan_wall_s": round(scan["wall_s"], 1),
            "ratio": round(scan["wall_s"] / engine, 2), "analysis_s": scan["analysis_s"],
            "peak_rss_gib": round(scan["peak_rss_gib"], 1), "sites": scan["sites"], "regions": scan["regions"]}


def depth(layer_counts: list[int]) -> list[dict]:
    from graphdiff.tiny import make_tiny

    rows = []
    root = Path(tempfile.mkdtemp())
    for n in layer_counts:
        model = make_tiny("qwen3", root / f"q3-{n}", layers=n)
        out = _run(SCAN, str(model), "-")
        scan = json.loads(out.split("SCAN_JSON", 1)[1].strip().splitlines()[0])
        rows.append({"layers": n, "analysis_s": scan["analysis_s"], "scan_wall_s": round(scan["wall_s"], 1),
                     "engine_startup_s": scan["engine_startup_s"], "sites": scan["sites"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wall")
    w.add_argument("model")
    w.add_argument("--layers", default="2")
    d = sub.add_parser("depth")
    d.add_argument("--layers", type=int, nargs="+", default=[9, 18, 36])
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    t = time.perf_counter()
    result = wall(args.model, args.layers) if args.cmd == "wall" else depth(args.layers)
    print(json.dumps(result, indent=1))
    print(f"(benchmark took {time.perf_counter() - t:.0f}s)", file=sys.stderr)


if __name__ == "__main__":
    main()
