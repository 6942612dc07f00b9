"""`--exact` on mixture-of-experts checkpoints no recipe makes: other expert counts and top-k, shared experts, a
DeepSeek-style grouped sigmoid router with a correction bias and a routed scaling factor. Issue 35's must-show.

    python benchmarks/moe_unseen.py [NAME ...] --out /tmp/moe-unseen [--resume] [--table FILE]

Per checkpoint (a fresh `graphdiff` process per step, one engine at a time):
  1. the recipe's config with the variant's overrides, seeded weights (`make_tiny`), the router's correction bias
     drawn too (HF initializes it to zeros);
  2. `graphdiff scan MODEL --out OUT/NAME/scan --patch --exact`;
  3. `graphdiff kl MODEL --manifest OUT/NAME/scan/patch/manifest.json --random 8 --max-tokens 512 --seed 1`: the
     engine's decode log-probs against the patched trainer on 8 x 512 sampled tokens (held out from the gate's seed).
The verdict per 128-position bucket: the patched RMS is at most the larger of 0.05 x unpatched and 1.1 x the engine's
floor (its decode against its own prefill), bit-identical where that floor is 0; and no token takes another expert
than the engine's. OUT/NAME/result.json holds each step and the verdict (`--resume` keeps those already done).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# name -> (recipe, config overrides, seed); layer 0 of glm4_moe stays dense (first_k_dense_replace=1)
VARIANTS: dict[str, tuple[str, dict, int]] = {
    "deepseek-style-16x4": ("glm4_moe", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                             n_shared_experts=2, routed_scaling_factor=2.5), 11),
    "qwen3_moe-16x4": ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=4), 12),
    "qwen2_moe-12x3-shared": ("qwen2_moe", dict(num_experts=12, num_experts_per_tok=3,
                                                shared_expert_intermediate_size=192), 13),
    "mixtral-6x3": ("mixtral", dict(num_local_experts=6, num_experts_per_tok=3), 14),
    "olmoe-16x4": ("olmoe", dict(num_experts=16, num_experts_per_tok=4), 15),
    # issue 47's shape: two groups of which one is kept, attention bias, a scaling that is not a power of two
    "glm4-grouped-8x2": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                          n_shared_experts=1, routed_scaling_factor=1.5, attention_bias=True), 21),
    "glm4-grouped-12x3": ("glm4_moe", dict(n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2,
                                           n_shared_experts=2, routed_scaling_factor=2.0, attention_bias=True), 23),
    "qwen3_moe-12x3": ("qwen3_moe", dict(num_experts=12, num_experts_per_tok=3), 24),
    # router settings no recipe or variant above has: unnormalized top-k weights, eight groups, top-1, ERNIE's
    # shared expert
    "glm4-grouped-16x6-raw": ("glm4_moe", dict(n_routed_experts=16, num_experts_per_tok=6, n_group=8, topk_group=4,
                                               n_shared_experts=1, routed_scaling_factor=1.0,
                                               norm_topk_prob=False), 31),
    "qwen3_moe-10x2-raw": ("qwen3_moe", dict(num_experts=10, num_experts_per_tok=2, norm_topk_prob=False), 32),
    "qwen2_moe-6x1-shared": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=1, norm_topk_prob=True), 33),
    "qwen2_moe-6x2-norm": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=True), 33),
    "qwen2_moe-6x1-raw": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=1, norm_topk_prob=False), 33),
    # an unrolled router kernel at top-2, and at top-1 on an odd expert count (OLMoE never renormalizes)
    "qwen2_moe-6x2-raw": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=False), 35),
    "olmoe-7x1": ("olmoe", dict(num_experts=7, num_experts_per_tok=1), 36),
    # stop 57: top-1 with eight experts, odd expert counts at top-2/3, GraniteMoE, one group of four, twenty experts
    "qwen3_moe-8x1-norm": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=1, norm_topk_prob=True), 41),
    "mixtral-5x2": ("mixtral", dict(num_local_experts=5, num_experts_per_tok=2), 42),
    "granitemoe-6x2": ("granitemoe", dict(num_local_experts=6, num_experts_per_tok=2), 43),
    "glm4-grouped-4x1-shared": ("glm4_moe", dict(n_routed_experts=4, num_experts_per_tok=1, n_group=1, topk_group=1,
                                                 n_shared_experts=1, routed_scaling_factor=2.5), 44),
    "olmoe-9x3": ("olmoe", dict(num_experts=9, num_experts_per_tok=3), 45),
    "qwen2_moe-20x5-raw": ("qwen2_moe", dict(num_experts=20, num_experts_per_tok=5, norm_topk_prob=False,
                                             shared_expert_intermediate_size=128), 46),
    "ernie-12x3-shared": ("ernie4_5_moe", dict(moe_num_experts=12, moe_k=3, moe_num_shared_experts=1), 34),
}
BIAS_SCALE = 0.05  # the correction bias drawn ~ N(0, 0.05): large enough to change which experts win


def make_checkpoint(name: str, out: Path) -> None:
    """The variant's seeded checkpoint in `out`: the recipe with the overrides, its correction biases drawn."""
    import torch
    from safetensors.torch import load_file, save_file

    from graphdiff.models import recipes
    from graphdiff.models.tiny import make_tiny

    arch, overrides, seed = VARIANTS[name]
    config_cls, base = recipes.ARCHS[arch]
    recipes.ARCHS[arch] = (config_cls, {**base, **overrides})
    try:
        make_tiny(arch, out, layers=3, seed=seed)
    finally:
        recipes.ARCHS[arch] = (config_cls, base)
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(seed + 2)
    for key, t in tensors.items():
        if key.endswith("e_score_correction_bias"):
            tensors[key] = (BIAS_SCALE * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(tensors, weights, metadata={"format": "pt"})


def run_step(args: list[str], log: Path, timeout: int) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(["timeout", "--kill-after=30", str(timeout), sys.executable, "-m", "graphdiff_cli.main",
                           *args], capture_output=True, text=True)
    log.write_text(f"$ graphdiff {' '.join(args)}\n# rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    return dict(command="graphdiff " + " ".join(args), rc=proc.returncode, wall_s=round(time.perf_counter() - t0, 1),
                error=(errors[-1] if errors else "")[:300])


def verdict(kl: dict) -> dict:
    """Per 128-position bucket: unpatched, patched and floor RMS, the patched bit-identical fraction, and whether
    the bucket passes; the flipped expert choices unpatched and patched."""
    rows = {(m["engine_mode"], m["trainer_mode"], bool(m["regions"])): m for m in kl["measurements"]}
    plain = next(m for (e, t, r), m in rows.items() if e == "compiled" and t == "eager" and not r)
    patched = next((m for (e, t, r), m in rows.items() if e == "compiled" and t == "eager" and r), None)
    if patched is None:  # the gate enabled no region: kl had nothing to patch
        return dict(rms_unpatched=plain["rms"], ok=False, note="the patch enables no region")
    floor = kl["floor"]
    buckets = []
    for u, p, f in zip(plain["position"], patched["position"], floor["position"]):
        bound = max(0.05 * u["rms"], 1.1 * f["rms"])
        exact = f["rms"] > 0 or p["bitexact_fraction"] == 1.0
        buckets.append(dict(start=u["start"], stop=u["stop"], unpatched=u["rms"], patched=p["rms"], floor=f["rms"],
                            bitexact=p["bitexact_fraction"], ok=p["rms"] <= bound and exact))
    flips = {t: sum(a["differing"] for a in kl.get("routing", []) if a["trainer"] == t) for t in ("unpatched",
                                                                                                 "patched")}
    return dict(rms_unpatched=plain["rms"], rms_patched=patched["rms"], bitexact=patched["bitexact_fraction"],
                buckets=buckets, flips=flips, ok=all(b["ok"] for b in buckets) and flips["patched"] == 0)


def sweep_one(name: str, root: Path, timeout: int) -> dict:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    model, scan, kl = d / "model", d / "scan", d / "kl"
    make_checkpoint(name, model)
    res: dict = dict(name=name, recipe=VARIANTS[name][0], overrides=VARIANTS[name][1], seed=VARIANTS[name][2],
                     steps=[])
    res["steps"].append(run_step(["scan", str(model), "--out", str(scan), "--patch", "--exact"], d / "scan.log",
                                 timeout))
    if res["steps"][-1]["rc"] == 0:
        res["steps"].append(run_step(["kl", str(model), "--manifest", str(scan / "patch" / "manifest.json"),
                                      "--random", "8", "--max-tokens", "512", "--seed", "1", "--out", str(kl)],
                                     d / "kl.log", timeout))
    if (kl / "kl.json").is_file() and res["steps"][-1]["rc"] == 0:
        res.update(verdict(json.loads((kl / "kl.json").read_text())))
    (d / "result.json").write_text(json.dumps(res, indent=1))
    return res


def table(results: list[dict]) -> str:
    rows = ["| checkpoint | recipe and overrides | RMS unpatched → patched | bit-identical patched | flipped expert "
            "choices unpatched → patched | buckets passing | verdict |", "|" + "---|" * 7]
    for r in results:
        if "note" in r:
            rows.append(f"| {r['name']} | {r['recipe']} | {r['rms_unpatched']:.4f} → - | - | - | - | "
                        f"FAIL: {r['note']} |")
            continue
        if "buckets" not in r:
            failed = next((s for s in r["steps"] if s["rc"]), r["steps"][-1])
            rows.append(f"| {r['name']} | {r['recipe']} | - | - | - | - | {failed['command'].split()[1]} failed: "
                        f"{failed['error'] or 'rc ' + str(failed['rc'])} |")
            continue
        over = ", ".join(f"{k}={v}" for k, v in r["overrides"].items())
        passing = sum(b["ok"] for b in r["buckets"])
        rows.append(f"| {r['name']} | {r['recipe']}: {over} | {r['rms_unpatched']:.4f} → {r['rms_patched']:.4f} | "
                    f"{r['bitexact']:.1%} | {r['flips']['unpatched']} → {r['flips']['patched']} | "
                    f"{passing} of {len(r['buckets'])} | {'pass' if r['ok'] else 'FAIL'} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help=f"checkpoints (default all: {', '.join(VARIANTS)})")
    p.add_argument("--out", type=Path, default=Path("/tmp/moe-unseen"))
    p.add_argument("--timeout", type=int, default=1500, help="seconds per scan / kl step")
    p.add_argument("--resume", action="store_true", help="keep OUT/NAME/result.json of checkpoints already done")
    p.add_argument("--table", type=Path, help="also write the markdown table here")
    args = p.parse_args()
    unknown = [n for n in args.names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown checkpoint {', '.join(unknown)}: one of {', '.join(VARIANTS)}")
    results = []
    for name in args.names or list(VARIANTS):
        done = args.out / name / "result.json"
        if args.resume and done.is_file():
            results.append(json.loads(done.read_text()))
            continue
        t0 = time.perf_counter()
        results.append(sweep_one(name, args.out, args.timeout))
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    text = table(results)
    print(text)
    if args.table:
        args.table.write_text(text)


if __name__ == "__main__":
    main()
