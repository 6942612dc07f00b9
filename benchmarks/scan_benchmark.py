"""Scan cost vs the engine's own start-up, and analysis time vs depth (numbers go into the README).

    python benchmarks/scan_benchmark.py wall tiny:qwen3 Qwen/Qwen3-8B   # scan wall time vs plain vLLM start-up
    python benchmarks/scan_benchmark.py wall Qwen/Qwen3-8B --shapes 16  # one shape only, for comparison
    python benchmarks/scan_benchmark.py depth --layers 9 18 36          # analysis time of tiny-width models

`wall` runs, each in a fresh process with fresh compile caches: (1) the full `graphdiff scan` with the default
shape set (or --shapes), (2) plain vLLM on the same config directory, sized as the scan sizes it
(LLM(...) construction: load + compile + warm-up). Peak memory: the scan process's max RSS, and the largest
max RSS of its child processes (the engine's).
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
import json, os, sys, time, tempfile
from pathlib import Path
from graphdiff.engines.vllm.start import engine_env
from graphdiff.records import Shape
from graphdiff.capture.shapes import engine_limits
work = Path(tempfile.mkdtemp())
os.environ.update(engine_env(work)); os.environ.pop("INDUCTOR_PROVENANCE", None)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
from vllm import LLM
limits = engine_limits([Shape.model_validate(s) for s in json.loads(sys.argv[2])])
t = time.perf_counter()
LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", seed=0, **limits)
print("ENGINE_STARTUP_S", time.perf_counter() - t)
"""

SCAN = r"""
import resource, sys, json, time
from graphdiff.pipeline import scan
from graphdiff.capture.shapes import parse_shapes
t = time.perf_counter()
shapes = parse_shapes(sys.argv[3], 16) if sys.argv[3] != "-" else None
outcome = scan(sys.argv[1], layers=int(sys.argv[2]) if sys.argv[2] != "-" else None, shapes=shapes)
wall = time.perf_counter() - t
result = outcome.result
print("SCAN_JSON", json.dumps({**result.timings, "wall_s": wall, "sites": len(result.sites),
      "regions": len(result.regions), "model_dir": str(outcome.model_dir),
      "shapes": [s.label for s in result.shapes], "replayed": len(result.replay),
      "shape_specs": [s.model_dump(exclude={"prompts"}) for s in result.shapes],
      "not_replayed": len(result.not_replayed),
      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
      "child_peak_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}))
"""


def _run(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    return proc.stdout


def wall(model: str, layers: str, shapes: str) -> dict:
    out = _run(SCAN, model, layers, shapes)
    scan = json.loads(out.split("SCAN_JSON", 1)[1].strip().splitlines()[0])
    ran = json.dumps(scan["shape_specs"])
    engine = float(_run(ENGINE_ONLY, scan["model_dir"], ran).split("ENGINE_STARTUP_S", 1)[1].split()[0])
    return {"model": model, "shapes": scan["shapes"], "engine_startup_s": round(engine, 1),
            "scan_wall_s": round(scan["wall_s"], 1), "ratio": round(scan["wall_s"] / engine, 2),
            "analysis_s": scan["analysis_s"], "peak_rss_gib": round(scan["peak_rss_gib"], 2),
            "engine_child_peak_rss_gib": round(scan["child_peak_rss_gib"], 2), "sites": scan["sites"],
            "regions": scan["regions"], "kernel_replays": scan["replayed"], "not_replayed": scan["not_replayed"]}


def depth(layer_counts: list[int]) -> list[dict]:
    from graphdiff.models.tiny import make_tiny

    rows = []
    root = Path(tempfile.mkdtemp())
    for n in layer_counts:
        model = make_tiny("qwen3", root / f"q3-{n}", layers=n)
        out = _run(SCAN, str(model), "-", "16")
        scan = json.loads(out.split("SCAN_JSON", 1)[1].strip().splitlines()[0])
        rows.append({"layers": n, "analysis_s": scan["analysis_s"], "scan_wall_s": round(scan["wall_s"], 1),
                     "engine_startup_s": scan["engine_startup_s"], "sites": scan["sites"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wall")
    w.add_argument("models", nargs="+")
    w.add_argument("--layers", default="2")
    w.add_argument("--shapes", default="-", help="as scan --shapes (default: the scan's default set)")
    d = sub.add_parser("depth")
    d.add_argument("--layers", type=int, nargs="+", default=[9, 18, 36])
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    t = time.perf_counter()
    result = ([wall(m, args.layers if "/" in m else "-", args.shapes) for m in args.models] if args.cmd == "wall"
              else depth(args.layers))
    print(json.dumps(result, indent=1))
    print(f"(benchmark took {time.perf_counter() - t:.0f}s)", file=sys.stderr)


if __name__ == "__main__":
    main()
