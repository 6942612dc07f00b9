"""The site differences between a single-graph scan and a piecewise scan of the same model, as markdown.

    python benchmarks/piecewise_sites.py SINGLE_SCAN PIECEWISE_SCAN

SINGLE_SCAN from `graphdiff scan MODEL --out DIR` (on CPU: vLLM's one DYNAMO_TRACE_ONCE graph), PIECEWISE_SCAN from
`graphdiff scan MODEL -cc '{"mode": 3}' --out DIR` (VLLM_COMPILE: graphs split at attention). Decisions are paired
by their stable id (scan.json `plan`), so the same trainer value is compared across the two engines. Printed:
- the two engines' structure and kernel replay (every generated kernel call at every shape);
- every site id found in one scan only, with its kind and each side's engine state (why);
- sites in both whose engine side differs: a consumer reading the value as a low-precision copy across a graph
  split (`evidence.read_rounded_by`), which changes what the patch must do although the site stays;
- other values (no site in either scan) whose engine state differs.
Reads only the scan directories (no engine, no torch).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROVEN = 0.999


def load(path: Path) -> dict:
    return json.loads((path / "scan.json" if path.is_dir() else path).read_text())


def engine_summary(scan: dict) -> str:
    """Graphs, kernel calls replayed at every shape, the effective compile mode."""
    cc = scan.get("engine_config") or {}
    graphs = {d["evidence"]["engine_graph"] for d in scan["plan"] if d["evidence"].get("engine_graph")}
    calls = {r["kernel"] for r in scan["replay"]}
    shapes = sorted({r["shape"] for r in scan["replay"]})
    ok = [r for r in scan["replay"] if not r["error"] and r["predicted_bitexact"] >= PROVEN]
    worst = min((r["predicted_bitexact"] for r in scan["replay"] if not r["error"]), default=0.0)
    return (f"mode {cc.get('mode', '?')}, {len(graphs)} graph(s), {len(calls)} generated kernel calls x {len(shapes)} "
            f"shapes: {len(ok)}/{len(scan['replay'])} replays >= {PROVEN:.1%} bit-identical (worst {worst:.4%}); "
            f"not replayed: {len(scan.get('not_replayed') or [])}")


def state(d: dict | None) -> str:
    if d is None:
        return "not decided"
    e = d.get("engine") or {}
    how = e.get("how") or "no engine value"
    return f"{'site' if d['site'] else 'no site'}: {how}"


def signature(d: dict) -> tuple:
    e = d.get("engine") or {}
    return (d["site"], d["rule"], e.get("rounds"), e.get("on_grid"), tuple(d["evidence"].get("read_rounded_by") or []))


def short(ids: list[str]) -> str:
    return ", ".join(f"`{i}`" for i in ids)


def why(a: dict | None, b: dict | None, labels: tuple[str, str]) -> str:
    """The dataflow fact behind a difference, in words, from the plan's fields."""
    for d, label in ((b, labels[1]), (a, labels[0])):
        readers = (d or {}).get("evidence", {}).get("read_rounded_by") or []
        if readers:
            return (f"{label}: live across an attention split, so the engine stores a BF16 copy as a graph output "
                    f"and {short(readers)} (the next graph) reads that copy; its own graph reads the FP32 value")
    if a is None or b is None:
        return f"decided in the {labels[0] if b is None else labels[1]} scan only"
    ea, eb = a.get("engine") or {}, b.get("engine") or {}
    if a["site"] != b["site"]:
        x, label = (ea, labels[0]) if a["site"] else (eb, labels[1])
        return f"one-sided only in the {label} engine: {x.get('how', '')}"
    if ea.get("on_grid") != eb.get("on_grid"):
        label = labels[0] if ea.get("on_grid") else labels[1]
        return (f"the trainer's value is on the BF16 grid either way; the engine value matched to it is a stored BF16 "
                f"value only in the {label} engine")
    return ""


def table(rows: list[tuple[str, str, str, str, str]], head: tuple[str, ...]) -> list[str]:
    if not rows:
        return ["(none)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def compare(single: dict, piecewise: dict, labels: tuple[str, str] = ("single graph", "piecewise")) -> list[str]:
    pa = {d["id"]: d for d in single["plan"]}
    pb = {d["id"]: d for d in piecewise["plan"]}
    sa = {i for i, d in pa.items() if d["site"]}
    sb = {i for i, d in pb.items() if d["site"]}
    lines = [f"### {single['model']} ({single['architecture']})", "",
             f"- {labels[0]}: {engine_summary(single)}; {len(sa)} sites in {len(single['regions'])} regions",
             f"- {labels[1]}: {engine_summary(piecewise)}; {len(sb)} sites in {len(piecewise['regions'])} regions",
             f"- site ids only in the {labels[0]} scan: {len(sa - sb)}, only in the {labels[1]} scan: {len(sb - sa)}",
             "", "Sites in one scan only, or in both with another engine side:", ""]
    rows = []
    for i in sorted(sa | sb):
        a, b = pa.get(i), pb.get(i)
        if i in sa and i in sb and signature(a) == signature(b):
            continue
        where = labels[0] if i not in sb else labels[1] if i not in sa else "both"
        kind = (a if i in sa else b)["kind"]
        rows.append((f"`{i}`", kind, where, f"{state(a)} / {state(b)}", why(a, b, labels)))
    lines += table(rows, ("site id", "kind", "site in", f"{labels[0]} / {labels[1]}", "why"))
    others = []
    for i in sorted((set(pa) | set(pb)) - sa - sb):
        a, b = pa.get(i), pb.get(i)
        if a is not None and b is not None and signature(a) == signature(b):
            continue
        if a is None or b is None:
            continue  # decided in one scan only (no engine evidence in the other): not a difference in rounding
        if (a.get("engine") or {}).get("on_grid") == (b.get("engine") or {}).get("on_grid") \
                and not (a["evidence"].get("read_rounded_by") or b["evidence"].get("read_rounded_by")):
            continue
        others.append((f"`{i}`", "-", "neither", f"{state(a)} / {state(b)}", why(a, b, labels)))
    lines += ["", "Values that are no site in either scan but held differently by the two engines:", ""]
    lines += table(others, ("value id", "kind", "site in", f"{labels[0]} / {labels[1]}", "why"))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("single", type=Path)
    ap.add_argument("piecewise", type=Path)
    args = ap.parse_args()
    print("\n".join(compare(load(args.single), load(args.piecewise))))


if __name__ == "__main__":
    main()
