"""Reports over a scan directory: one self-contained HTML file, DOT/SVG pictures, Model Explorer overlay.

A scan directory holds scan.json plus the two captured graphs (engine.capture.json,
train.capture.json) that the pictures are drawn from. The HTML report inlines its CSS, JS and
SVG (no CDN, no web fonts) so it can be mailed or attached to an issue and opened offline.
Templates live in graphdiff/report/templates/ so they ship inside the package.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from graphdiff.artifacts import ScanDir
from graphdiff.errors import GraphdiffError
from graphdiff.records import Capture, Graph, KLResult, Region, ScanResult, Site
from graphdiff.report import graphs as rg
from graphdiff.report.gap import compared, floor_note, gap_table
from graphdiff.report.headline import bound_percent, headline

TEMPLATES = Path(__file__).parent / "templates"
FORMATS = ("html", "dot", "svg", "model-explorer")
MAX_FIGURES = 3  # per region: the first layer plus layers whose sites differ
KIND_HELP = {
    "rope": "depends elementwise on the cos/sin table (rotary embedding)",
    "qk_norm": "inside a normalization whose output flows into attention (q/k norm)",
    "attention": "inside the engine's opaque attention op: what the registry says it keeps in FP32",
    "router": "MoE routing weights: computed from the top-k/softmax of the router logits",
    "expert_combine": "MoE: the weighted sum over the chosen experts",
    "gated_act": "an activation, or elementwise on its output before a matmul (gated MLP), no norm in reach",
    "embedding_scale": "the embedding lookup scaled by a constant",
    "residual_scale": "a branch output scaled by a constant before the residual add",
    "residual_norm": "a residual-stream add that flows into a normalization",
    "norm_weight": "inside a normalization, e.g. the cast before the weight multiply",
    "logit_scale": "the logits scaled or soft-capped by a constant on their way out",
    "sum_order": "no rounding site: a norm the engine sums in its own lane order, the trainer in ATen's",
    "math": "no rounding site: an op the engine computes with Inductor's math library, the trainer with ATen's",
    "stored_copy": "no rounding site: a helper reads the engine's stored BF16 copy of a value held in FP32",
    "other": "not one of the known patterns",
}
ME_VALUES = {"train": 1, "engine": 2}  # Model Explorer node value: which side rounds


def load_scan(scan_dir: Path) -> tuple[ScanResult, Capture | None, Capture | None]:
    """The scan result and, when present beside it, the train and engine captures."""
    d = ScanDir(scan_dir if scan_dir.is_dir() or not scan_dir.name.endswith(".json") else scan_dir.parent)
    scan = d.load_scan()
    return scan, d.load_train() if d.train_capture.is_file() else None, d.load_engine_graphs()


def stretches(scan: ScanResult) -> dict[str, list[str]]:
    """Site id -> the engine values bounding the in-kernel stretch that computes it (from the plan)."""
    return {d.id: d.evidence.stretch for d in scan.plan if d.site and d.evidence.stretch}


def find_region(scan: ScanResult, name: str) -> Region:
    close = [r for r in scan.regions if r.name == name] or [r for r in scan.regions if r.name.endswith(name)] \
        or [r for r in scan.regions if name in r.name]
    if len(close) == 1:
        return close[0]
    names = ", ".join(r.name for r in scan.regions)
    what = "matches several regions" if close else "is not a region of this scan"
    raise GraphdiffError(f"{name!r} {what}; regions: {names}")


def _graphs(cap: Capture | None) -> list[Graph]:
    return cap.graphs if cap else []


def _pick_graphs(train: Capture | None, engine: Capture | None, sites: list[Site]) -> tuple[Graph | None, ...]:
    s = sites[0] if sites else None
    tg = rg.graph_of(_graphs(train), node=s.train.node) if s else None
    eg = rg.graph_of(_graphs(engine), node=s.engine.node, kernel=s.engine.kernel) if s and s.engine else None
    return tg or next(iter(_graphs(train)), None), eg or next(iter(_graphs(engine)), None)


def figure_layers(scan: ScanResult, region: Region) -> list[int | None]:
    """Regions repeat across layers: draw the first layer and the ones whose sites differ."""
    return [*region.layers[:1], *region.differing_layers][:MAX_FIGURES]


def layer_sites(scan: ScanResult, region: Region, layer: int | None) -> list[Site]:
    """A region's sites in one layer, in region order (which is also their S1, S2, ... badge order)."""
    by_id = {s.id: s for s in scan.sites}
    return [by_id[i] for i in region.sites if i in by_id and by_id[i].layer == layer]


def region_dot(scan: ScanResult, train: Capture | None, engine: Capture | None, region: Region,
               layer: int | None = None, prefix: str = "") -> str:
    layer = figure_layers(scan, region)[0] if layer is None and region.layers else layer
    sites = layer_sites(scan, region, layer)
    tg, eg = _pick_graphs(train, engine, sites)
    title = f"{region.name} (layer {layer})" if layer is not None else region.name
    return rg.region_dot(tg, eg, sites, title, prefix, stretches=stretches(scan))


def layer_dot(scan: ScanResult, train: Capture | None, engine: Capture | None, layer: int) -> str:
    sites = [s for s in scan.sites if s.layer == layer]
    tg, eg = _pick_graphs(train, engine, sites)
    extra_t = rg.layer_seeds(tg, layer) if tg else []
    extra_e = rg.layer_seeds(eg, layer) if eg else []
    if not extra_t and not extra_e:
        raise GraphdiffError(f"no nodes of layer {layer} in the captured graphs (scanned layers: "
                             f"{sorted({s.layer for s in scan.sites if s.layer is not None})})")
    return rg.region_dot(tg, eg, sites, f"layer {layer}", f"layer{layer}_", extra_t, extra_e, limit=100_000,
                         stretches=stretches(scan))


def model_explorer(scan: ScanResult, train: Capture | None, engine: Capture | None) -> dict[str, dict]:
    """Model Explorer node data (google-ai-edge/model-explorer, "per-node data") for each side.

    Values: 1 = rounded to BF16 on the train side only, 2 = on the engine side only. One graph
    gives a GraphNodeData ({results, thresholds}); several give a ModelNodeData keyed by graph name.
    """
    thresholds = [{"value": v, "bgColor": rg.SIDE_COLORS[side][0], "textColor": "#ffffff"}
                  for side, v in ME_VALUES.items()]
    files: dict[str, dict] = {}
    for fname, cap, node_of in (("node_data.json", train, lambda s: s.train.node),
                                ("node_data.engine.json", engine, lambda s: s.engine.node if s.engine else "")):
        graphs = {}
        for g in _graphs(cap):
            names = {n.name for n in g.nodes}
            results = {node_of(s): {"value": ME_VALUES[s.rounded_on]} for s in scan.sites if node_of(s) in names}
            graphs[g.name] = {"results": results, "thresholds": thresholds}
        if len(graphs) == 1:
            files[fname] = next(iter(graphs.values()))
        elif graphs:
            files[fname] = graphs
    if not files:
        raise GraphdiffError("the scan directory has no captures (train.capture.json / engine/capture.json)")
    return files


# --- HTML -----------------------------------------------------------------------------------------

def _slug(name: str, used: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", name.replace(".*", "").replace("#", "-")).strip("-") or "region"
    slug, i = base, 2
    while slug in used:
        slug, i = f"{base}-{i}", i + 1
    used.add(slug)
    return slug


KL_RUN = ("prompts", "max_tokens", "temperature", "seed", "method")  # how the gap was measured
SERIES = (("unpatched", "#d93025"), ("patched", "#1a73e8"), ("patched, the engine's attention op", "#188038"),
          ("floor: engine decode vs its prefill", "#5f6368"))


def kl_view(kl: KLResult | None, nonuniformity: dict[str, float] | None = None) -> dict:
    """Lay out the measured gap: the measurements, a k3 card for each of the first four, the Shapley attribution and
    the non-uniformity per region as charts, how it was measured, the compilation config and manifest it ran."""
    view: dict = {"cards": [], "measurements": [], "charts": [], "run": ""}
    if nonuniformity:
        view["charts"].append(("nonuniformity", sorted(nonuniformity.items(), key=lambda kv: -abs(kv[1])), {}, ""))
    if kl is None:
        return view
    view["measurements"] = kl.measurements
    for m in kl.measurements[:4]:  # k3 with its standard error: >= 0 per token, stable where k1 is mostly noise
        what = "unpatched" if m.regions is None else f"{len(m.regions)} regions patched"
        se = f" ± {m.k3_se:.2g}" if m.k3_se is not None else ""
        view["cards"].append((f"KL (k3 ± se) · {m.engine_mode} engine vs {m.trainer_mode} trainer, {what}",
                              f"{m.k3:.3g}{se}"))
    att = kl.attribution
    if att is not None:
        items = sorted(((v.region, v.value) for v in att.values), key=lambda kv: -abs(kv[1]))
        errors = {v.region: (v.ci_low, v.ci_high) for v in att.values}
        note = (f"Shapley values of the {att.metric} gap reduction {att.reduction:.4g} "
                f"({att.baseline:.4g} → {att.aligned:.4g}, {att.method}); "
                f"bars show {att.confidence:.0%} bootstrap intervals.")
        if att.minimal_set is not None:
            note += f" Minimal set: {', '.join(att.minimal_set) or '(none)'}."
        view["charts"].insert(0, ("shapley", items, errors, note))
    run = [f"{k.replace('_', ' ')} {getattr(kl, k)}" for k in KL_RUN]
    if kl.compilation_config:
        run.append(f"compilation config {json.dumps(kl.compilation_config, sort_keys=True)}")
    view["run"] = " · ".join(run)
    if kl.manifest:
        view["cards"].append(("manifest", kl.manifest))
    return view


def position_view(kl: KLResult | None) -> dict | None:
    """The gap by continuation position: RMS and bit-identical fraction per bucket for the unpatched and patched
    trainer, the patched one with the engine's attention op, and the engine's own floor as charts; the table the
    terminal shows (report.gap.gap_table)."""
    table = gap_table(kl)
    if kl is None or table is None:
        return None
    plain, fixed = compared(kl)
    rows = [plain, fixed, kl.engine_attention, kl.floor]
    named = [(label, color, m) for (label, color), m in zip(SERIES, rows) if m and m.position]

    def series(key: str) -> list:
        return [(label, color, [(b.start, getattr(b, key)) for b in m.position]) for label, color, m in named]

    x_label = f"continuation position (bucket start; {kl.bucket} tokens per bucket)"
    notes = [floor_note(kl), kl.sources_note, *(f"in the patched gap, not patched: {r}" for r in kl.left_out),
             kl.departure_note]
    return {"buckets": table.buckets, "table": table.rows, "note": " · ".join(n for n in notes if n),
            "rms": rg.line_chart(series("rms"), "RMS of logp_engine − logp_train", x_label, "{:.3f}"),
            "exact": rg.line_chart(series("bitexact_fraction"), "bit-identical fraction", x_label, "{:.0%}", 1.0)}


_KERNEL = re.compile(r"\b(?:cpp|triton)_\w{36,}")


def abbrev(text: str) -> Markup:
    """Long Inductor kernel names shortened (the full name on hover and in the kernels section)."""
    return Markup(_KERNEL.sub(lambda m: f'<span title="{m.group(0)}">{m.group(0)[:20]}…{m.group(0)[-12:]}</span>',
                              str(Markup.escape(text))))


def _figures(scan: ScanResult, train: Capture | None, engine: Capture | None, region: Region,
             idx: int) -> tuple[list[dict], dict[str, str]]:
    """Pictures for a region, and each site's badge (S1, S2, ... in the picture of its layer)."""
    figs: list[dict] = []
    badges: dict[str, str] = {}
    if not (train or engine):
        return figs, badges
    for layer in figure_layers(scan, region):
        prefix = f"r{idx}L{layer}_"
        src = region_dot(scan, train, engine, region, layer, prefix)
        badges |= {s.id: f"S{i + 1}" for i, s in enumerate(layer_sites(scan, region, layer))}
        figs.append({"layer": layer, "dot": src, "svg": Markup(rg.render_svg(src) or ""), "prefix": prefix})
    return figs, badges


def _node_ids(fig_prefix: str | None, s: Site) -> str:
    if fig_prefix is None:
        return ""
    ids = [f"{fig_prefix}t_{s.train.node}"] + ([f"{fig_prefix}e_{s.engine.node}"] if s.engine and s.engine.node else [])
    return " ".join(ids)


def _sources(sites: list[Site], side: str) -> list[dict]:
    seen: dict[tuple[str, int], dict] = {}
    for s in sites:
        ref = s.train if side == "train" else s.engine
        if ref and ref.source:
            key = (ref.source.file, ref.source.line)
            entry = seen.setdefault(key, {"file": ref.source.file, "line": ref.source.line,
                                          "code": ref.source.code, "function": ref.source.function, "nodes": []})
            entry["nodes"].append(ref.node)
    return list(seen.values())


def html_context(scan: ScanResult, train: Capture | None, engine: Capture | None,
                 only: Region | None = None) -> dict:
    sites = {s.id: s for s in scan.sites}
    replay = defaultdict(list)
    for r in scan.replay:
        replay[r.kernel.split(":")[0]].append(r)
    used = {"summary", "regions", "attribution", "details", "kernels", "coverage"}  # the page's own anchors
    regions: list[dict[str, Any]] = []  # the template's view of each region
    for idx, region in enumerate(scan.regions):
        if only is not None and region.name != only.name:
            continue
        members = [sites[i] for i in region.sites if i in sites]
        figs, badges = _figures(scan, train, engine, region, idx)
        prefix_of = {f["layer"]: f["prefix"] for f in figs}
        reps = [r for k in region.kernels for r in replay.get(k, [])]
        regions.append({
            "r": region, "slug": _slug(region.name, used), "help": KIND_HELP.get(region.kind, ""),
            "figures": figs, "replay": reps,
            "sites": [{"s": s, "badge": badges.get(s.id, ""), "nodes": _node_ids(prefix_of.get(s.layer), s)}
                      for s in members],
            "train_sources": _sources(members, "train"), "engine_sources": _sources(members, "engine"),
            "predicted": min((r.predicted_bitexact for r in reps), default=None),
            "naive": max((r.naive_bitexact for r in reps), default=None),
        })
    ok = [r for r in scan.replay if not r.error]
    kl = kl_view(scan.kl, scan.nonuniformity)
    region_slugs = {x["r"].name: x["slug"] for x in regions}
    kernels = _kernels(engine, scan, region_slugs)
    return {
        "scan": scan, "headline": headline(scan), "regions": regions, "kernels": kernels, "meter": rg.meter,
        "abbrev": abbrev,
        "colors": {"train": rg.TRAIN_COLOR, "engine": rg.ENGINE_COLOR},
        "counts": {"train": sum(s.rounded_on == "train" for s in scan.sites),
                   "engine": sum(s.rounded_on == "engine" for s in scan.sites)},
        "replay_min": min((r.predicted_bitexact for r in ok), default=None), "bound_percent": bound_percent,
        "naive_max": max((r.naive_bitexact for r in ok), default=None),
        "position": position_view(scan.kl),
        # the scan's own tokens, then the gap's samples (kl: unpatched and patched trainer)
        "routing": [*scan.routing, *(scan.kl.routing if scan.kl else [])],
        "kl": kl, "kl_charts": [(k, rg.bar_chart(v, "#1a73e8" if k == "shapley" else "#5f6368", region_slugs, errors),
                                 note) for k, v, errors, note in kl["charts"]],
        "has_captures": bool(train or engine), "has_dot": rg.dot_binary() is not None,
        "fmt_layers": lambda ls: ", ".join("–" if x is None else str(x) for x in ls),
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _kernels(engine: Capture | None, scan: ScanResult, region_slugs: dict[str, str]) -> list[dict]:
    """Each distinct generated kernel once: its calls, replay evidence (the worst shape), fused ops, code, regions."""
    replay: dict[str, object] = {}
    for r in sorted(scan.replay, key=lambda r: (r.error == "", r.predicted_bitexact), reverse=True):
        replay[r.kernel] = r  # the worst last, so it stays
    by_name: dict[str, dict] = {}
    for g in _graphs(engine):
        nodes = g.node_map()
        for k in g.kernels:
            if k.kind != "generated":
                continue
            entry = by_name.setdefault(k.name, {"name": k.name, "calls": [], "code": k.code, "ops": {}, "regions": [
                (r.name, region_slugs.get(r.name, "")) for r in scan.regions if k.name in r.kernels]})
            entry["calls"].append((k.id, replay.get(k.id)))
            for n in k.nodes:
                if n in nodes and not rg.hidden(nodes[n]):
                    op = rg.op_name(nodes[n].target)
                    entry["ops"][op] = entry["ops"].get(op, 0) + 1
    return list(by_name.values())


def render_html(scan: ScanResult, train: Capture | None, engine: Capture | None, region: Region | None = None) -> str:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(("html", "j2")),
                      trim_blocks=True, lstrip_blocks=True)
    return env.get_template("report.html.j2").render(**html_context(scan, train, engine, region))


def write_html(scan: ScanResult, train: Capture | None, engine: Capture | None, path: Path) -> Path:
    """The HTML report of `scan`, drawn from both captures, written to `path`."""
    return _write(path, render_html(scan, train, engine))


def write_report(scan_dir: Path, fmt: str = "html", *, region: str | None = None, layer: int | None = None,
                 out: Path | None = None) -> list[Path]:
    """Render one format; returns the files written."""
    if fmt not in FORMATS:
        raise GraphdiffError(f"unknown format {fmt!r}; choose {', '.join(FORMATS)}")
    scan, train, engine = load_scan(scan_dir)
    base = scan_dir if scan_dir.is_dir() else scan_dir.parent
    reg = find_region(scan, region) if region else None
    if fmt == "html":
        if layer is not None:
            raise GraphdiffError("--layer draws one layer as --format dot or svg; the HTML report shows all layers")
        return [_write(out or base / "report.html", render_html(scan, train, engine, reg))]
    if fmt == "model-explorer":
        files = model_explorer(scan, train, engine)
        first = out or base / "node_data.json"
        paths = {"node_data.json": first, "node_data.engine.json": first.with_name(first.stem + ".engine.json")}
        return [_write(paths[name], json.dumps(data, indent=1)) for name, data in files.items()]
    if not (train or engine):
        raise GraphdiffError(f"{base} has no captures to draw (train.capture.json / engine/capture.json)")
    if (reg is None) == (layer is None):
        names = ", ".join(r.name for r in scan.regions)
        raise GraphdiffError(f"--format {fmt} draws one picture: give --region NAME or --layer N (regions: {names})")
    if reg is not None:
        src, stem = region_dot(scan, train, engine, reg), f"region-{_slug(reg.name, set())}"
    else:
        assert layer is not None  # one of the two (checked above)
        src, stem = layer_dot(scan, train, engine, layer), f"layer{layer}"
    if fmt == "dot":
        return [_write(out or base / f"{stem}.dot", src)]
    svg = rg.render_svg(src, inline=False)
    if svg is None:
        raise GraphdiffError("Graphviz `dot` is not installed (apt-get install graphviz); "
                             "--format dot writes the DOT source without it")
    return [_write(out or base / f"{stem}.svg", svg)]


def _write(path: Path, text: str) -> Path:
    from graphdiff.artifacts import write_file

    return write_file(path, text)
