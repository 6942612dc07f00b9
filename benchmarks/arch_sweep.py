"""The architecture sweep (issue 11): every `graphdiff make-tiny --list` architecture made tiny, scanned with
the patch, and the log-prob gap measured with and without it; one markdown table.

    python benchmarks/arch_sweep.py [ARCH ...] --out /tmp/arch-sweep [--table docs/results/arch_sweep.md]

Per architecture, each step a fresh `graphdiff` process under `timeout` (one engine at a time):
  1. `graphdiff make-tiny ARCH --out OUT/ARCH/model --layers L [--seed S] [--hidden H] [--head-dim D] [--vocab V]`
  2. `graphdiff scan OUT/ARCH/model --out OUT/ARCH/scan --patch`   (the gate measures every region on seed-0 samples)
  3. `graphdiff kl OUT/ARCH/model --manifest OUT/ARCH/scan/patch/manifest.json --random 4 --max-tokens 256 --seed 1`
     (held out: other prompts and sampling seeds than the ones the gate chose the regions on)
  4. where the patch removes less than 90% of the RMS: `graphdiff scan OUT/ARCH/model --manifest
     OUT/ARCH/scan/patch/manifest.json --out OUT/ARCH/departure --tokens 256 --shapes 256`, the patched trainer's
     first departure at the held-out samples' length
The table's last column names what keeps a reduction under 90%: the regions kl lists as left out (each with its
reason), the largest share of the patched gap nothing names ("rest") and that first departure.
It goes on past failures; each step's exit code, wall time, last error line and whether its output holds a
traceback go in OUT/ARCH/result.json (`--resume` keeps the results of architectures already done).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

PROVEN = 0.999
TARGET = 0.90  # the RMS reduction below which the sweep names what keeps it lower
TRACEBACK = "Traceback (most recent call last)"


def graphdiff_cmd() -> list[str]:
    """The CLI of the code this script sits beside (PYTHONPATH as given), in a fresh process."""
    return [sys.executable, "-m", "graphdiff_cli.main"]


def run_step(name: str, args: list[str], log: Path, timeout: int) -> dict:
    """One CLI step under `timeout`; its output saved to `log`; exit code, wall, last error line, traceback."""
    t0 = time.perf_counter()
    cmd = ["timeout", "--kill-after=30", str(timeout), *graphdiff_cmd(), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    text = proc.stdout + "\n" + proc.stderr
    log.write_text(f"$ graphdiff {shlex.join(args)}\n# rc {proc.returncode}, {wall:.0f} s\n{text}")
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    last = errors[-1] if errors else (lines[-1] if lines and proc.returncode else "")
    if proc.returncode in (124, 137):
        last = f"timed out after {timeout} s"
    return dict(step=name, rc=proc.returncode, wall_s=round(wall, 1), error=last[:300],
                traceback=TRACEBACK in text, command="graphdiff " + shlex.join(args))


def scan_summary(scan_dir: Path) -> dict:
    """Sites, regions and the kernel replay from scan.json; regions generated / enabled from the manifest."""
    scan = json.loads((scan_dir / "scan.json").read_text())
    ok = [r for r in scan["replay"] if not r.get("error")]
    bf16 = [r for r in ok if r.get("elements", 0) > 0]  # kernels with low-precision stores (bit-compared)
    worst = min(bf16, key=lambda r: r["predicted_bitexact"]) if bf16 else None
    below = sorted({r["kernel"].split(":")[0] for r in bf16 if r["predicted_bitexact"] < PROVEN})
    out = dict(sites=len(scan["sites"]), regions=len(scan["regions"]),
               unproven_sites=sum(not s.get("proven", True) for s in scan["sites"]),
               worst_replay=worst["predicted_bitexact"] if worst else None,
               worst_kernel=worst["kernel"] if worst else "",
               not_replayed=scan.get("not_replayed", []), unexplained=scan.get("unexplained", []),
               below=below, unregistered=scan.get("unregistered_externs", []),
               kernels=len({r["kernel"] for r in scan["replay"]}))
    manifest = scan_dir / "patch" / "manifest.json"
    if manifest.exists():
        m = json.loads(manifest.read_text())
        out.update(generated=sum(r["generated"] for r in m["regions"]),
                   enabled=sum(r["generated"] and r.get("enabled", True) for r in m["regions"]),
                   manifest_regions=len(m["regions"]),
                   left_out=[r["name"] for r in m["regions"] if r["generated"] and not r.get("enabled", True)],
                   not_generated={r["name"]: r.get("reason", "") for r in m["regions"] if not r["generated"]},
                   gate=[n for n in m.get("notes", []) if n.startswith("measured: on ")])
    return out


def kl_summary(kl_dir: Path) -> dict:
    kl = json.loads((kl_dir / "kl.json").read_text())
    plain = next((m for m in kl["measurements"] if m["regions"] is None and m["trainer_mode"] == "eager"), None)
    fixed = next((m for m in kl["measurements"] if m["regions"] and m["trainer_mode"] == "eager"), None)
    flips = {}
    for a in kl.get("routing", []):  # MoE: tokens whose experts differ from the engine's, all layers
        f = flips.setdefault(a["trainer"], [0, 0])
        f[0], f[1] = f[0] + a["differing"], f[1] + a["tokens"]
    shares = {s["name"]: max(s["share"], default=0.0) for s in kl.get("sources", [])}
    return dict(rms_unpatched=plain["rms"] if plain else None, rms_patched=fixed["rms"] if fixed else None,
                bitexact_unpatched=plain["bitexact_fraction"] if plain else None,
                bitexact_patched=fixed["bitexact_fraction"] if fixed else None,
                k3_unpatched=plain["k3"] if plain else None, k3_patched=fixed["k3"] if fixed else None,
                tokens=plain["tokens"] if plain else 0, routing=flips, kl_left_out=kl.get("left_out", []),
                source_shares=shares, sources_note=kl.get("sources_note", ""))


def reduction(res: dict) -> float | None:
    """The share of the unpatched RMS the patch removes (0 where nothing was enabled)."""
    u, p = res.get("rms_unpatched"), res.get("rms_patched")
    if p is None and u is not None:
        p = u
    return None if u is None or p is None or not u else (u - p) / u


def departure_summary(scan_dir: Path) -> str:
    """What `scan --manifest` finds the patch leaves: its sites by region (where the patched trainer still rounds
    otherwise than the engine), then the patched trainer's first departure from the engine."""
    scan = json.loads((scan_dir / "scan.json").read_text())
    left = [f"{r['name']}: {len(r.get('sites', []))} sites the patch leaves (rounded on "
            f"{', '.join(r.get('rounded_on', []))}, layers {', '.join(str(x) for x in r.get('layers', []))})"
            for r in scan.get("regions", [])]
    d = scan.get("departure")
    if not d:
        return "; ".join([*left, "no departure at the scan's shapes"])
    return "; ".join([*left, f"first departure: layer {d.get('layer')} {d.get('op', '').removeprefix('aten.')} "
                             f"({d.get('module') or d.get('node')}; {d.get('source') or 'no source line'}), "
                             f"{d.get('differing', 0):.1%} of elements differ"])


def shape_options(args: argparse.Namespace) -> list[str]:
    """make-tiny's shape options the sweep was given (none: each recipe's own shape)."""
    return [opt for flag, v in (("--hidden", args.hidden), ("--head-dim", args.head_dim), ("--vocab", args.vocab))
            if v for opt in (flag, str(v))]


def sweep_one(arch: str, root: Path, args: argparse.Namespace) -> dict:
    d = root / arch
    d.mkdir(parents=True, exist_ok=True)
    model, scan, kl = d / "model", d / "scan", d / "kl"
    res: dict = dict(arch=arch, steps=[])
    steps = [("make-tiny", ["make-tiny", arch, "--out", str(model), "--layers", str(args.layers),
                            "--seed", str(args.seed), *shape_options(args)], 300),
             ("scan", ["scan", str(model), "--out", str(scan), "--patch",
                       *(["--exact"] if args.exact else ["--attention", args.attention])], args.timeout)]
    for name, cli, limit in steps:
        step = run_step(name, cli, d / f"{name}.log", limit)
        res["steps"].append(step)
        if step["rc"] != 0:
            return res
    res.update(scan_summary(scan))
    manifest = scan / "patch" / "manifest.json"
    cli = ["kl", str(model), "--random", str(args.kl_prompts), "--max-tokens", str(args.kl_tokens),
           "--seed", str(args.kl_seed), "--out", str(kl)]
    if res.get("enabled"):
        cli += ["--manifest", str(manifest)]
    step = run_step("kl", cli, d / "kl.log", args.timeout)
    res["steps"].append(step)
    if step["rc"] != 0:
        return res
    res.update(kl_summary(kl))
    red = reduction(res)
    if res.get("enabled") and red is not None and red < TARGET:
        length = str(args.kl_tokens)  # the departure at the held-out samples' length, not only at 16 tokens
        step = run_step("departure", ["scan", str(model), "--manifest", str(manifest), "--out", str(d / "departure"),
                                      "--tokens", length, "--shapes", length], d / "departure.log", args.timeout)
        res["steps"].append(step)
        res["departure"] = departure_summary(d / "departure") if step["rc"] == 0 else f"not found: {step['error']}"
    return res


def sweep_portable(arch: str, root: Path, args: argparse.Namespace, res: dict) -> None:
    """The portable patch (rounding locations only, no engine op) from the same scan, gated on the scan's cached
    samples, and its held-out gap on the engine samples the `--exact` kl drew (copied, so the engine is not re-run):
    the "without --exact" row of the same architecture."""
    d = root / arch
    scan, patch, kl = d / "scan", d / "portable", d / "kl-portable"
    res["steps"] = [s for s in res["steps"] if not s["step"].startswith("portable-")]  # a resumed try replaces them
    step = run_step("portable-patch", ["patch", str(scan), "--out", str(patch)], d / "portable-patch.log",
                    args.timeout)
    res["steps"].append(step)
    if step["rc"] != 0:
        return
    m = json.loads((patch / "manifest.json").read_text())
    res["portable_enabled"] = sum(r["generated"] and r.get("enabled", True) for r in m["regions"])
    kl.mkdir(parents=True, exist_ok=True)
    for name in ("kl.json", "engine_samples.json"):  # a kl directory of its own, so kl reads its cached samples
        if (d / "kl" / name).exists():
            (kl / name).write_bytes((d / "kl" / name).read_bytes())
    cli = ["kl", str(d / "model"), "--random", str(args.kl_prompts), "--max-tokens", str(args.kl_tokens),
           "--seed", str(args.kl_seed), "--out", str(kl)]
    if res["portable_enabled"]:
        cli += ["--manifest", str(patch / "manifest.json")]
    step = run_step("portable-kl", cli, d / "portable-kl.log", args.timeout)
    res["steps"].append(step)
    if step["rc"] == 0:
        s = kl_summary(kl)
        res["portable"] = dict(rms_patched=s["rms_patched"] if res["portable_enabled"] else s["rms_unpatched"],
                               bitexact_patched=s["bitexact_patched"] if res["portable_enabled"]
                               else s["bitexact_unpatched"], routing=s["routing"])


def kept_lower(res: dict) -> str:
    """What keeps the reduction under TARGET, as kl and the departure scan name it; empty at or above it."""
    red = reduction(res)
    if red is None or red >= TARGET:
        return ""
    if not res.get("enabled"):
        return "no region generated and kept: " + "; ".join(f"{k}: {v}" for k, v in
                                                          res.get("not_generated", {}).items())
    parts = list(res.get("kl_left_out", []))
    rest = res.get("source_shares", {}).get("rest")
    if rest is not None:
        parts.append(f"rest up to {rest:.0%} of the patched gap")
    if res.get("sources_note"):
        parts.append(res["sources_note"])
    if res.get("departure"):
        parts.append(res["departure"])
    return "; ".join(parts)


def outcome(res: dict) -> str:
    bad = next((s for s in res["steps"] if s["rc"] != 0), None)
    tb = [s["step"] for s in res["steps"] if s["traceback"]]
    if bad is None:
        text = "scanned"
        if res.get("unexplained") or res.get("not_replayed"):
            text += f" ({res.get('unproven_sites', 0)} sites unproven)"
    elif "killed by SIG" in bad["error"]:  # the engine (or the trainer) died: a crash, not a refusal
        text = f"CRASHED ({bad['step']}): {bad['error'].removeprefix('error:').strip()}"
    elif bad["error"].startswith("error:"):
        text = f"refused ({bad['step']}): {bad['error'].removeprefix('error:').strip()}"
    else:
        text = f"FAILED {bad['step']} rc {bad['rc']}: {bad['error']}"
    if tb:
        text += f" TRACEBACK in {', '.join(tb)}"
    return text.replace("|", "\\|")


def portable_cell(r: dict) -> str:
    """The portable patch's held-out RMS, reduction, bit-identical share and expert flips ("-" where not run)."""
    port = r.get("portable")
    if not port:
        return "-"
    flips = (port.get("routing") or {}).get("patched")
    red = reduction(dict(rms_unpatched=r.get("rms_unpatched"), rms_patched=port["rms_patched"]))
    return (f"{fmt(port['rms_patched'], '.4f')} / {fmt(red, '.1%')} / {fmt(port['bitexact_patched'], '.1%')}"
            + (f" / {flips[0]} of {flips[1]}" if flips else ""))


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict]) -> str:
    head = ("| arch | outcome | sites | regions | worst kernel replay | kernels not replayed / below 99.9% | "
            "regions patched / kept by the gate | RMS unpatched | RMS patched | RMS reduction | bit-identical | "
            "MoE: tokens × layers with other experts, unpatched → patched | portable patch: RMS / reduction / "
            "bit-identical / MoE | what keeps it under 90% |")
    rows = [head, "|" + "---|" * 14]
    for r in results:
        if "sites" not in r:
            rows.append(f"| {r['arch']} | {outcome(r)} |" + " - |" * 12)
            continue
        flips = r.get("routing") or {}
        moe = " → ".join(f"{d} of {t}" for d, t in (flips.get(k) for k in ("unpatched", "patched")
                                                     if k in flips)) or "-"
        worst = fmt(r.get("worst_replay"), ".2%")
        nr = len(r.get("not_replayed", []))
        below = ", ".join(r.get("below", [])) or ""
        kern = f"{nr} / {len(r.get('below', []))}" + (f" ({below})" if below else "")
        patched = f"{r.get('generated', 0)} of {r.get('manifest_regions', 0)} / {r.get('enabled', 0)}"
        u, p = r.get("rms_unpatched"), r.get("rms_patched")
        if p is None and u is not None:  # nothing enabled: the trainer runs unpatched
            p = u
        red = fmt(reduction(r), ".1%")
        bit = fmt(r.get("bitexact_patched") if r.get("enabled") else r.get("bitexact_unpatched"), ".1%")
        why = kept_lower(r).replace("|", "\\|")
        rows.append(f"| {r['arch']} | {outcome(r)} | {r['sites']} | {r['regions']} | {worst} | {kern} | {patched} | "
                    f"{fmt(u, '.4f')} | {fmt(p, '.4f')} | {red} | {bit} | {moe} | {portable_cell(r)} | {why} |")
    return "\n".join(rows) + "\n"


def machine() -> str:
    """The CPU and whether it has AMX tiles: vLLM CPU then runs other kernels (AMX attention, small-weight GEMMs)."""
    import platform

    import torch

    name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    amx = "with AMX" if torch.cpu._is_amx_tile_supported() else "without AMX"
    return f"{name} ({amx}), {torch.get_num_threads()} threads"


def main() -> None:
    from graphdiff.models.tiny import ARCHS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archs", nargs="*", help="architectures (default: all of `graphdiff make-tiny --list`)")
    p.add_argument("--out", type=Path, default=Path("/tmp/arch-sweep"))
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="the tiny checkpoints' weight seed")
    p.add_argument("--hidden", type=int, help="the tiny checkpoints' hidden size (default: each recipe's own)")
    p.add_argument("--head-dim", type=int, help="the tiny checkpoints' head size (default 64)")
    p.add_argument("--vocab", type=int, help="the tiny checkpoints' vocabulary (default: each recipe's own)")
    p.add_argument("--timeout", type=int, default=1500, help="seconds per scan / kl step")
    p.add_argument("--kl-prompts", type=int, default=4)
    p.add_argument("--kl-tokens", type=int, default=256)
    p.add_argument("--kl-seed", type=int, default=1, help="held out from the gate's seed 0")
    p.add_argument("--resume", action="store_true", help="keep OUT/ARCH/result.json of archs already swept")
    p.add_argument("--table", type=Path, help="also write the markdown table here")
    p.add_argument("--attention", choices=("fp32", "engine"), default="fp32",
                   help="the attention splice's form (`graphdiff patch --attention`)")
    p.add_argument("--exact", action="store_true", help="the patch runs the engine's own ops where no rounding plan "
                   "makes the forward equal (`graphdiff patch --exact`)")
    p.add_argument("--portable", action="store_true", help="also the portable patch (`graphdiff patch SCAN`, no "
                   "engine op) from the same scan, and its held-out gap: the row without --exact")
    args = p.parse_args()
    archs = args.archs or list(ARCHS)
    results = []
    for arch in archs:
        path = args.out / arch / "result.json"
        t0 = time.perf_counter()
        if args.resume and path.exists():
            res = json.loads(path.read_text())
            if not (args.portable and "portable" not in res and res.get("rms_unpatched") is not None):
                results.append(res)
                continue
            sweep_portable(arch, args.out, args, res)  # a row swept before without its portable patch
        else:
            res = sweep_one(arch, args.out, args)
            if args.portable and res.get("rms_unpatched") is not None:
                sweep_portable(arch, args.out, args, res)
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(res, indent=1))
        results.append(res)
        print(f"{arch}: {outcome(res)} ({res['wall_s']:.0f} s)", flush=True)
    date = datetime.date.today().isoformat()
    text = (f"Made {date} by `python benchmarks/arch_sweep.py {shlex.join(sys.argv[1:])}` on {machine()}\n\n"
            + table(results))
    (args.out / "table.md").write_text(text)
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(text)
    print(text)
    if any(re.search("TRACEBACK|FAILED|CRASHED", outcome(r)) for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
