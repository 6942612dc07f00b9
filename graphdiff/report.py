"""Reports over a scan directory: one self-contained HTML file, DOT/SVG pictures, Model Explorer overlay.

A scan directory holds scan.json plus the two captured graphs (engine.capture.json,
train.capture.json) that the pictures are drawn from. The HTML report inlines its CSS, JS and
SVG (no CDN, no web fonts) so it can be mailed or attached to an issue and opened offline.
Templates live in graphdiff/report_templates/ so they ship inside the package.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from graphdiff import report_graphs as rg
from graphdiff.errors import GraphdiffError
from graphdiff.model import SCHEMA_VERSION, Capture, Graph, Region, ScanResult, Site, load_capture

TEMPLATES = Path(__file__).parent / "report_templates"
FORMATS = ("html", "dot", "svg", "model-explorer")
MAX_FIGURES = 3  # per region: the first layer plus layers whose sites differ
KIND_HELP = {
    "rope": "depends elementwise on the cos/sin table (rotary embedding)",
    "qk_norm": "inside a normalization whose output flows into attention (q/k norm)",
    "gated_act": "an activation, or elementwise on its output before a matmul (gated MLP)",
    "residual_norm": "a residual-stream add that flows into a normalization",
    "norm_weight": "inside a normalization, e.g. the cast before the weight multiply",
    "other": "not one of the known patterns",
}
ME_VALUES = {"train": 1, "engine": 2}  # Model Explorer node value: which side rounds


def load_scan(scan_dir: Path) -> tuple[ScanResult, Capture | None, Capture | None]:
    """The scan result and, when present beside it, the train and engine captures."""
    path = scan_dir / "scan.json" if scan_dir.is_dir() else scan_dir
    if not path.exists():
        raise GraphdiffError(f"no scan.json in {scan_dir}; run `graphdiff scan MODEL --out {scan_dir}` first")
    try:
        scan = ScanResult.model_validate_json(path.read_text())
    except ValueError as e:
        raise GraphdiffError(f"{path} is not a valid graphdiff scan: {str(e).splitlines()[0]}") from None
    if scan.schema_version != SCHEMA_VERSION:
        raise GraphdiffError(f"{path} has scan schema {scan.schema_version}; this graphdiff reads {SCHEMA_VERSION}")
    caps = [load_capture(path.parent / f) if (path.parent / f).exists() else None
            for f in ("train.capture.json", "engine.capture.json")]
    return scan, caps[0], caps[1]


def find_region(scan: ScanResult, name: str) -> Region:
    exact = [r for r in scan.regions if r.name == name]
    close = exact or [r for r in scan.regions if name in r.name]
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


def region_dot(scan: ScanResult, train: Capture | None, engine: Capture | None, region: Region,
               layer: int | None = None, prefix: str = "") -> str:
    layer = figure_layers(scan, region)[0] if layer is None and region.layers else layer
    ids = set(region.sites)
    sites = [s for s in scan.sites if s.id in ids and s.layer == layer]
    tg, eg = _pick_graphs(train, engine, sites)
    title = f"{region.name} (layer {layer})" if layer is not None else region.name
    return rg.region_dot(tg, eg, sites, title, prefix)


def layer_dot(scan: ScanResult, train: Capture | None, engine: Capture | None, layer: int) -> str:
    sites = [s for s in scan.sites if s.layer == layer]
    tg, eg = _pick_graphs(train, engine, sites)
    extra_t = rg.layer_seeds(tg, layer) if tg else []
    extra_e = rg.layer_seeds(eg, layer) if eg else []
    if not extra_t and not extra_e:
        raise GraphdiffError(f"no nodes of layer {layer} in the captured graphs (scanned layers: "
                             f"{sorted({s.layer for s in scan.sites if s.layer is not None})})")
    return rg.region_dot(tg, eg, sites, f"layer {layer}", f"layer{layer}-", extra_t, extra_e, limit=100_000)


def model_explorer(scan: ScanResult, train: Capture | None, engine: Capture | None) -> dict[str, dict]:
    """Model Explorer node data (google-ai-edge/model-explorer, "per-node data") for each side.

    Values: 1 = rounded to BF16 on the train side only, 2 = on the engine side only. One graph
    gives a GraphNodeData ({results, thresholds}); several give a ModelNodeData keyed by graph name.
    """
    thresholds = [{"value": v, "bgColor": rg.SIDE_COLORS[side][0], "textColor": "#ffffff"}
                  for side, v in ME_VALUES.items()]
    files = {}
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
        raise GraphdiffError("the scan directory has no captures (train.capture.json / engine.capture.json)")
    return files


# --- HTML -----------------------------------------------------------------------------------------

def _slug(name: str, used: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", name.replace(".*", "").replace("#", "-")).strip("-") or "region"
    slug, i = base, 2
    while slug in used:
        slug, i = f"{base}-{i}", i + 1
    used.add(slug)
    return slug


def short_path(file: str) -> str:
    return file.split("site-packages/")[-1]


def _kl_view(kl: dict | None) -> tuple[list[tuple[str, object]], list[tuple[str, list[tuple[str, float]]]], dict]:
    """Split a `kl` result generically: (scalar numbers, bar charts of {name: number}, the rest)."""
    scalars: list[tuple[str, object]] = []
    charts: list[tuple[str, list[tuple[str, float]]]] = []
    rest: dict = {}

    def num(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for key, value in (kl or {}).items():
        if num(value) or isinstance(value, (str, bool)):
            scalars.append((key, value))
        elif isinstance(value, dict) and value and all(num(v) for v in value.values()):
            if key in ("shapley", "nonuniformity") or len(value) > 4:
                charts.append((key, sorted(value.items(), key=lambda kv: -abs(kv[1]))))
            else:
                scalars += [(f"{key} · {k}", v) for k, v in value.items()]
        else:
            rest[key] = value
    return scalars, charts, rest


def bar_chart(items: list[tuple[str, float]], color: str, width: int = 760) -> Markup:
    """A horizontal bar chart as inline SVG; negative values grow left of the zero line."""
    label_w, value_w, row = 300, 80, 22
    lo, hi = min(0.0, *(v for _, v in items)), max(0.0, *(v for _, v in items))
    span = (hi - lo) or 1.0
    plot = width - label_w - value_w
    zero = label_w + plot * (-lo / span)
    parts = [f'<svg class="chart" viewBox="0 0 {width} {row * len(items) + 8}" width="{width}" role="img">',
             f'<line x1="{zero:.1f}" x2="{zero:.1f}" y1="0" y2="{row * len(items) + 4}" class="axis"/>']
    for i, (name, v) in enumerate(items):
        y = 4 + i * row
        x0, x1 = sorted((zero, zero + plot * v / span))
        label = name if len(name) <= 44 else name[:20] + "…" + name[-23:]
        parts.append(f'<g><title>{Markup.escape(name)}: {v:.6g}</title>'
                     f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end">{Markup.escape(label)}</text>'
                     f'<rect x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 1):.1f}" height="{row - 8}" rx="2" '
                     f'fill="{color}"/><text x="{max(x1, zero) + 6:.1f}" y="{y + 15}" class="val">{v:.4g}</text></g>')
    parts.append("</svg>")
    return Markup("".join(parts))


def meter(frac: float, color: str) -> Markup:
    """A small inline bar for a fraction in [0, 1]."""
    w = max(0.0, min(1.0, frac)) * 120
    return Markup(f'<svg class="meter" width="120" height="10" viewBox="0 0 120 10"><rect width="120" height="10" '
                  f'rx="2" fill="#e8eaed"/><rect width="{w:.1f}" height="10" rx="2" fill="{color}"/></svg>')


def _figures(scan: ScanResult, train: Capture | None, engine: Capture | None, region: Region, idx: int,
             sites: list[Site]) -> tuple[list[dict], dict[str, str]]:
    """Pictures for a region, and each site's badge (S1, S2, ... in the picture of its layer)."""
    figs, badges = [], {}
    if not (train or engine):
        return figs, badges
    for layer in figure_layers(scan, region):
        prefix = f"r{idx}-L{layer}-"
        src = region_dot(scan, train, engine, region, layer, prefix)
        drawn = [s for s in sites if s.layer == layer]
        badges |= {s.id: f"S{i + 1}" for i, s in enumerate(drawn)}
        figs.append({"layer": layer, "dot": src, "svg": Markup(rg.render_svg(src) or ""), "prefix": prefix})
    return figs, badges


def _node_ids(fig_prefix: str | None, s: Site) -> str:
    if fig_prefix is None:
        return ""
    ids = [f"{fig_prefix}t-{s.train.node}"] + ([f"{fig_prefix}e-{s.engine.node}"] if s.engine and s.engine.node else [])
    return " ".join(ids)


def _sources(sites: list[Site], side: str) -> list[dict]:
    seen: dict[tuple[str, int], dict] = {}
    for s in sites:
        ref = s.train if side == "train" else s.engine
        if ref and ref.source:
            key = (ref.source.file, ref.source.line)
            entry = seen.setdefault(key, {"file": short_path(ref.source.file), "line": ref.source.line,
                                          "code": ref.source.code, "function": ref.source.function, "nodes": []})
            entry["nodes"].append(ref.node)
    return list(seen.values())


def html_context(scan: ScanResult, train: Capture | None, engine: Capture | None,
                 only: Region | None = None) -> dict:
    sites = {s.id: s for s in scan.sites}
    replay = defaultdict(list)
    for r in scan.replay:
        replay[r.kernel.split(":")[0]].append(r)
    used: set[str] = set()
    regions = []
    for idx, region in enumerate(scan.regions):
        if only is not None and region.name != only.name:
            continue
        members = [sites[i] for i in region.sites if i in sites]
        figs, badges = _figures(scan, train, engine, region, idx, members)
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
    scalars, charts, rest = _kl_view(scan.kl)
    region_slugs = {x["r"].name: x["slug"] for x in regions}
    kernels = _kernels(engine, scan, region_slugs)
    return {
        "scan": scan, "regions": regions, "kernels": kernels, "meter": meter,
        "colors": {"train": rg.TRAIN_COLOR, "engine": rg.ENGINE_COLOR},
        "counts": {"train": sum(s.rounded_on == "train" for s in scan.sites),
                   "engine": sum(s.rounded_on == "engine" for s in scan.sites)},
        "replay_min": min((r.predicted_bitexact for r in ok), default=None),
        "naive_max": max((r.naive_bitexact for r in ok), default=None),
        "kl_scalars": scalars, "kl_rest": json.dumps(rest, indent=1) if rest else "",
        "kl_charts": [(k, bar_chart(v, rg.TRAIN_COLOR if k == "shapley" else "#5f6368"), region_slugs)
                      for k, v in charts],
        "has_captures": bool(train or engine), "has_dot": rg.dot_binary() is not None,
        "short_path": short_path, "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _kernels(engine: Capture | None, scan: ScanResult, region_slugs: dict[str, str]) -> list[dict]:
    """Each distinct generated kernel once: its calls, replay evidence, fused ops, code, regions."""
    replay = {r.kernel: r for r in scan.replay}
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
        raise GraphdiffError(f"{base} has no captures to draw (train.capture.json / engine.capture.json)")
    if (reg is None) == (layer is None):
        names = ", ".join(r.name for r in scan.regions)
        raise GraphdiffError(f"--format {fmt} draws one picture: give --region NAME or --layer N (regions: {names})")
    src = region_dot(scan, train, engine, reg) if reg else layer_dot(scan, train, engine, layer)
    stem = f"region-{_slug(reg.name, set())}" if reg else f"layer{layer}"
    if fmt == "dot":
        return [_write(out or base / f"{stem}.dot", src)]
    svg = rg.render_svg(src, inline=False)
    if svg is None:
        raise GraphdiffError("Graphviz `dot` is not installed (apt-get install graphviz); "
                             "--format dot writes the DOT source without it")
    return [_write(out or base / f"{stem}.svg", svg)]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
