"""Where the patched training step's added time goes, splice by splice: forward, backward, dispatch.

    python benchmarks/patch_region_cost.py --scan SCAN_DIR --config Qwen/Qwen3-0.6B --batch 1 --seq 1024
    python benchmarks/patch_region_cost.py --scan SCAN_DIR --config Qwen/Qwen3-0.6B --seq 1024 --exact

Each splice timed alone on the inputs it gets in the model, patched and as HF runs it, in CPU time at --threads 1
(`graphdiff.measure.splice_cost`, which `scan --patch` also runs per region): one JSON row per splice as it is done.
`calls` is how often one step calls it; `added_ms` is (patched - unpatched) forward + backward times calls, the
splice's share of the step's added time. The carry (the FP32 residual stream) and the runtime's nn.Linear input
hooks are not splices of their own: their cost is the step's added time less the splices' sum (`rest_ms`,
printed when --step is given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from patch_step_benchmark import load_model, model_arguments, step  # beside this script

from graphdiff import runtime
from graphdiff.codegen import generate
from graphdiff.measure.splice_cost import splice_costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(ap)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--attention", default="fp32", choices=("fp32", "engine"))
    ap.add_argument("--best", action="store_true",
                    help="each time the least of --repeat runs (a machine running other work), not the median")
    ap.add_argument("--autograd", action="store_true",
                    help="also time each patched splice with its gradient by autograd (not its closed form)")
    ap.add_argument("--step", action="store_true", help="also time whole steps, unpatched and patched (3 each)")
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (CPU time: 1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="gd-cost-"))
    generate(args.scan, work / "patch", attention=args.attention, exact=args.exact)
    model, label = load_model(args, work)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    rows = splice_costs(model, work / "patch", ids, args.repeat, best=args.best, autograd=args.autograd,
                        on_row=lambda key, row: print(key, json.dumps(row), flush=True))
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
