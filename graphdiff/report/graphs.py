"""Dataflow pictures for the report: both graphs around a set of rounding sites, as DOT (and SVG).

A picture stays small and readable: the site nodes plus a few hops of inputs/users, with
view-like glue (views, getitem, split, allocations) contracted away, never expanding past a
matmul/attention. The trainer's and the engine's subgraphs sit side by side in one DOT graph, so
each site's two values can be joined by an edge; engine nodes are grouped in one cluster per
fused kernel. Site nodes take the colour of the side that rounds: filled on that side, dashed
outline on the side that keeps FP32. This module must not import torch (reports run anywhere).
"""

from __future__ import annotations

import html
import itertools
import re
import shutil
from collections import defaultdict
from collections.abc import Sequence

import graphviz
from markupsafe import Markup

from graphdiff.ops import ALLOCATIONS, VIEWS, is_heavy, op_name
from graphdiff.records import Graph, Node, Side, Site, layer_of, walk

TRAIN_COLOR, TRAIN_FILL = "#e8710a", "#fde3cc"  # train = orange
ENGINE_COLOR, ENGINE_FILL = "#1a73e8", "#d2e3fc"  # engine = blue
SIDE_COLORS = {"train": (TRAIN_COLOR, TRAIN_FILL), "engine": (ENGINE_COLOR, ENGINE_FILL)}
FONT = "Helvetica,Arial,sans-serif"

GLUE = VIEWS | {"sym_size", "output"}  # hidden in pictures (views, symbolic sizes)
HOPS = 2
MAX_NODES = 28  # per side, for region pictures
MAX_SEEDS = 8  # engine nodes standing in for a site no engine node computes


def dot_binary() -> str | None:
    """Path of Graphviz `dot`; the report degrades to a note without it (tests patch this)."""
    return shutil.which("dot")


def hidden(n: Node) -> bool:
    if n.op == "placeholder":  # symbols and integer handles say nothing about rounding
        return n.dtype is None or not ("float" in n.dtype or n.dtype.startswith("bfloat"))
    return n.op == "output" or op_name(n.target) in GLUE | ALLOCATIONS


def contracted(graph: Graph, keep: set[str] | frozenset[str] = frozenset()
               ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(inputs, users) between visible nodes, looking through glue. An allocation stands for the
    out-variant ops (onednn_mm, attention_with_output) that wrote it before the reader ran."""
    nodes = graph.node_map()
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    writers: dict[str, list[str]] = defaultdict(list)
    for n in graph.nodes:
        for i in n.inputs:
            if i in nodes and op_name(nodes[i].target) in ALLOCATIONS and not hidden(n):
                writers[i].append(n.name)

    def resolve(name: str, reader: int, seen: set[str]) -> list[str]:
        n = nodes.get(name)
        if n is None or name in seen:
            return []
        seen.add(name)
        if name in keep or not hidden(n):
            return [name]
        if op_name(n.target) in ALLOCATIONS:
            return [w for w in writers[name] if index[w] < reader]
        return [v for i in n.inputs for v in resolve(i, reader, seen)]

    inputs: dict[str, list[str]] = {}
    users: dict[str, list[str]] = defaultdict(list)
    for n in graph.nodes:
        if n.name in keep or not hidden(n):
            ins = list(dict.fromkeys(v for i in n.inputs for v in resolve(i, index[n.name], set())))
            inputs[n.name] = [i for i in ins if i != n.name]
            for i in inputs[n.name]:
                users[i].append(n.name)
    return inputs, users


def neighbourhood(graph: Graph, seeds: list[str], hops: int = HOPS, limit: int = MAX_NODES) -> list[str]:
    """Seeds plus nodes within `hops` (nearest first, at most `limit`), in graph order."""
    nodes = graph.node_map()
    seeds = [s for s in dict.fromkeys(seeds) if s in nodes]
    inputs, users = contracted(graph, set(seeds))
    # Stay in the seeds' layers: shared values (the rotary table) would pull in every layer.
    layers = {layer_of(nodes[s].module) for s in seeds} | {None}
    def step(name: str) -> list[str]:
        return [o for o in inputs.get(name, []) + users.get(name, []) if layer_of(nodes[o].module) in layers]

    # a matmul/attention is the boundary of the picture (a seed is always its centre)
    near = walk(seeds, step, through=lambda name: not is_heavy(nodes[name].target), hops=hops)
    picked = [*seeds, *itertools.islice(near, max(limit - len(seeds), 0))]
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    return sorted(picked, key=order.__getitem__)


def graph_of(graphs: list[Graph], node: str = "", kernel: str | None = None) -> Graph | None:
    for g in graphs:
        if (kernel and any(k.id == kernel for k in g.kernels)) or (node and any(n.name == node for n in g.nodes)):
            return g
    return None


def _between(graph: Graph, above: str, below: str) -> list[str]:
    """Visible nodes on a path from `above` to `below` (exclusive)."""
    nodes, users = graph.node_map(), graph.users()
    down = set(walk([above], lambda n: users.get(n, [])))
    up = set(walk([below], lambda n: [i for i in nodes[n].inputs if i in nodes]))
    return [n.name for n in graph.nodes if n.name in down & up and not hidden(n)]


def stand_ins(engine: Graph, site: Site, taken: set[str], stretch: Sequence[str] = ()) -> list[str]:
    """Engine nodes to draw for a site no engine node computes: the stretch its decision names
    (between the engine values matched above and below it), else same-op nodes of its kernel in
    the site's module subtree, else the kernel's nodes."""
    if site.engine is None or not site.engine.kernel:
        return []
    kernel = next((k for k in engine.kernels if k.id == site.engine.kernel), None)
    if kernel is None:
        return []
    nodes = engine.node_map()
    if len(stretch) == 2 and all(n in nodes for n in stretch):
        between = [n for n in _between(engine, stretch[0], stretch[1]) if n not in taken]
        if between:
            return between[:MAX_SEEDS]
    mod = site.train.module or ""
    inside = [nodes[n] for n in kernel.nodes if n in nodes and not hidden(nodes[n])]
    subtree = [n for n in inside if (n.module or "").startswith(mod) and n.name not in taken]
    same_op = [n for n in subtree if op_name(n.target) == op_name(site.train.op)]
    pick = same_op or subtree or inside
    return [n.name for n in pick[:MAX_SEEDS]]


def _id(side: str, name: str) -> str:
    return f"{side[0]}__{name}"  # no ':' (graphviz reads node:port)


def _short(name: str, width: int = 44) -> str:
    return name if len(name) <= width else name[: width - 16] + "…" + name[-15:]


def _shape(n: Node) -> str:
    return "×".join(str(s) for s in n.shape) if n.shape else ""


_DT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "int64": "i64", "int32": "i32"}


def _label(n: Node, inputs: dict[str, str], badge: str, note: str) -> str:
    if n.op == "placeholder":
        title = _short(".".join(inputs.get(n.name, n.name).split(".")[-2:]), 30)
    else:
        title = op_name(n.target)
    head = f"{badge} · {title}" if badge else title
    meta = " · ".join(x for x in (n.name, _DT.get(n.dtype or "", n.dtype or "")) if x)  # shape: in the tooltip
    rows = [f"<B>{html.escape(head)}</B>", f'<FONT POINT-SIZE="8" COLOR="#5f6368">{html.escape(meta)}</FONT>']
    if note:
        rows.append(f'<FONT POINT-SIZE="8"><I>{html.escape(note)}</I></FONT>')
    return "<" + "<BR/>".join(rows) + ">"


def _tooltip(n: Node) -> str:
    src = n.source
    where = f"{src.file}:{src.line}  {src.code}" if src else ""
    shape = f"  [{_shape(n)}] {n.dtype}" if n.shape is not None else ""
    return f"{n.name} = {n.target}({n.args}){shape}" + (f"\n{where}" if where else "")


def _add_nodes(g: graphviz.Digraph, graph: Graph, names: list[str], side: str, prefix: str,
               marks: dict[str, tuple[str, Side, bool]]) -> None:
    """marks: node -> (badge, rounding side, rounds here)."""
    nodes = graph.node_map()
    for name in names:
        n = nodes[name]
        attrs = {"id": f"{prefix}{side[0]}_{name}", "tooltip": _tooltip(n)}
        badge, note = "", ""
        if name in marks:
            badge, rounding, here = marks[name]
            color, fill = SIDE_COLORS[rounding]
            # an op with several outputs (attention) has no node dtype: it rounds inside
            note = (f"rounds to {_DT.get(n.dtype, n.dtype)}" if n.dtype else "rounds inside") if here else "keeps FP32"
            attrs |= {"color": color, "penwidth": "2", "fillcolor": fill if here else "#ffffff",
                      "style": "rounded,filled" if here else "rounded,filled,dashed"}
        elif n.op == "placeholder":
            attrs |= {"shape": "note", "style": "filled", "fillcolor": "#f1f3f4"}
        elif is_heavy(n.target):
            attrs |= {"fillcolor": "#e8eaed"}
        g.node(_id(side, name), _label(n, graph.inputs, badge, note), **attrs)


def _engine_side(engine: Graph, sites: list[Site],
                 stretches: dict[str, list[str]]) -> tuple[dict[str, list[str]], list[str]]:
    """Stand-in engine nodes per unmatched site id, and the engine nodes of matched sites."""
    enodes = engine.node_map()
    taken = {s.engine.node for s in sites if s.engine and s.engine.node}
    stand = {s.id: stand_ins(engine, s, taken, stretches.get(s.id, ())) for s in sites
             if s.engine and s.engine.node not in enodes and s.engine.kernel}
    return stand, [s.engine.node for s in sites if s.engine and s.engine.node in enodes]


def _engine_names(engine: Graph, sites: list[Site], stretches: dict[str, list[str]], extra: Sequence[str], hops: int,
                  limit: int) -> tuple[dict[str, list[str]], list[str]]:
    """Stand-in engine nodes per unmatched site id, and the engine nodes drawn (in graph order). A stand-in stretch
    gets one hop only: the site has no engine node of its own."""
    stand, matched = _engine_side(engine, sites, stretches)
    near = neighbourhood(engine, [*matched, *extra], hops, limit)
    stretch = neighbourhood(engine, [n for ns in stand.values() for n in ns], min(hops, 1), limit)
    order = {n.name: i for i, n in enumerate(engine.nodes)}
    return stand, sorted(set(near) | set(stretch), key=order.__getitem__)


def _digraph(title: str, prefix: str) -> graphviz.Digraph:
    g = graphviz.Digraph(name=prefix.strip("_") or "region", comment=title)
    g.attr("graph", rankdir="TB", compound="true", newrank="true", fontname=FONT, fontsize="11", nodesep="0.14",
           ranksep="0.28", tooltip=title, bgcolor="transparent")
    g.attr("node", shape="box", style="rounded,filled", fillcolor="#ffffff", color="#9aa0a6", fontname=FONT,
           fontsize="10", margin="0.08,0.03", height="0.3")
    g.attr("edge", color="#9aa0a6", arrowsize="0.6")
    return g


def _add_engine(g: graphviz.Digraph, engine: Graph, enames: list[str], clusters: dict[str, str], prefix: str,
                emarks: dict[str, tuple[str, Side, bool]]) -> None:
    """The engine cluster: nodes outside generated kernels, then one sub-cluster per fused kernel; its edges."""
    enodes = engine.node_map()
    with g.subgraph(name="cluster_engine") as c:
        c.attr(label="engine (compiled)", color=ENGINE_COLOR, fontcolor=ENGINE_COLOR, style="rounded",
               penwidth="1.5")
        _add_nodes(c, engine, [n for n in enames if enodes[n].kernel not in clusters], "engine", prefix, emarks)
        for kid, cname in clusters.items():
            with c.subgraph(name=cname) as kc:
                kname, _, call = kid.partition(":")
                kc.attr(label=f"{_short(kname)}  (call {call})", tooltip=kid, style="rounded,filled",
                        fillcolor="#f3f7fe", color="#a8c7fa", fontcolor="#174ea6", fontsize="9",
                        id=f"{prefix}{cname}")
                _add_nodes(kc, engine, [n for n in enames if enodes[n].kernel == kid], "engine", prefix, emarks)
    _add_edges(g, engine, enames, "engine")


def _link_sites(g: graphviz.Digraph, sites: list[Site], badges: dict[str, str], tnames: list[str],
                enames: list[str], stand: dict[str, list[str]], clusters: dict[str, str],
                enodes: dict[str, Node]) -> None:
    """Join each site's two values across the clusters (an unmatched site: to its kernel)."""
    link = {"style": "dashed", "dir": "none", "constraint": "false", "fontsize": "9", "fontname": FONT}
    for s in sites:
        color, b = SIDE_COLORS[s.rounded_on][0], badges[s.id]
        if s.train.node not in tnames:
            continue
        if s.engine and s.engine.node in enames:
            g.edge(_id("train", s.train.node), _id("engine", s.engine.node), label=b, color=color, fontcolor=color,
                   **link)
        elif target := next((n for n in stand.get(s.id, []) if n in enames), None):
            g.edge(_id("train", s.train.node), _id("engine", target), label=f"{b}: inside kernel", color=color,
                   fontcolor=color, lhead=clusters.get(enodes[target].kernel or "", ""), **link)


def region_dot(train: Graph | None, engine: Graph | None, sites: list[Site], title: str, prefix: str = "",
               extra_train: Sequence[str] = (), extra_engine: Sequence[str] = (), limit: int = MAX_NODES,
               stretches: dict[str, list[str]] | None = None) -> str:
    """DOT source of both graphs around `sites` (plus extra seed nodes, e.g. a whole layer).
    Sites are badged S1, S2, ... in the order given; `stretches`: site id -> the engine values bounding the
    in-kernel stretch that computes it (the plan's evidence)."""
    badges = {s.id: f"S{i + 1}" for i, s in enumerate(sites)}
    tmarks = {s.train.node: (badges[s.id], s.rounded_on, s.rounded_on == "train") for s in sites}
    enodes = engine.node_map() if engine else {}
    emarks = {s.engine.node: (badges[s.id], s.rounded_on, s.rounded_on == "engine")
              for s in sites if s.engine and s.engine.node in enodes}
    hops = 0 if extra_train or extra_engine else HOPS
    tnames = neighbourhood(train, [*tmarks, *extra_train], hops, limit) if train else []
    stand: dict[str, list[str]] = {}
    enames: list[str] = []
    if engine:
        stand, enames = _engine_names(engine, sites, stretches or {}, extra_engine, hops, limit)
    fused = [k for k in dict.fromkeys(enodes[n].kernel for n in enames)
             if k and not k.startswith(("torch.ops", "extern"))]
    clusters = {kid: f"cluster_k{i}" for i, kid in enumerate(fused)}

    g = _digraph(title, prefix)
    if train:
        with g.subgraph(name="cluster_train") as c:
            c.attr(label="HF eager (trainer)", color=TRAIN_COLOR, fontcolor=TRAIN_COLOR, style="rounded",
                   penwidth="1.5")
            _add_nodes(c, train, tnames, "train", prefix, tmarks)
        _add_edges(g, train, tnames, "train")
    if engine:
        _add_engine(g, engine, enames, clusters, prefix, emarks)
    _link_sites(g, sites, badges, tnames, enames, stand, clusters, enodes)
    return g.source


def _add_edges(g: graphviz.Digraph, graph: Graph, names: list[str], side: str) -> None:
    keep = set(names)
    inputs, _ = contracted(graph, keep)
    for n in names:
        for i in inputs.get(n, []):
            if i in keep:
                g.edge(_id(side, i), _id(side, n))


def layer_seeds(graph: Graph, layer: int) -> list[str]:
    return [n.name for n in graph.nodes if layer_of(n.module) == layer and not hidden(n)]


def render_svg(dot_source: str, inline: bool = True) -> str | None:
    """SVG markup (inline: no XML prolog, scales within its container); None without `dot`."""
    if dot_binary() is None:
        return None
    try:
        svg = graphviz.Source(dot_source).pipe(format="svg", encoding="utf-8", quiet=True)
    except graphviz.ExecutableNotFound:
        return None
    if not inline:
        return svg
    svg = svg[svg.index("<svg"):]
    return re.sub(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"',
                  r'<svg class="dataflow" width="\1pt" height="\2pt"', svg, count=1)


# --- charts ---------------------------------------------------------------------------------------

def bar_chart(items: list[tuple[str, float]], color: str, links: dict[str, str] | None = None,
              errors: dict[str, tuple[float, float]] | None = None, width: int = 760) -> Markup:
    """A horizontal bar chart as inline SVG: negative values grow left of the zero line, optional
    error bars (confidence intervals), and labels that name a region link to its section."""
    label_w, value_w, row = 300, 80, 22
    errors = errors or {}
    ends = [v for _, v in items] + [x for lo_hi in errors.values() for x in lo_hi]
    lo, hi = min(0.0, *ends), max(0.0, *ends)
    span = (hi - lo) or 1.0
    plot = width - label_w - value_w

    def x(v: float) -> float:
        return label_w + plot * (v - lo) / span

    parts = [f'<svg class="chart" viewBox="0 0 {width} {row * len(items) + 8}" width="{width}" role="img">',
             f'<line x1="{x(0):.1f}" x2="{x(0):.1f}" y1="0" y2="{row * len(items) + 4}" class="axis"/>']
    for i, (name, v) in enumerate(items):
        y = 4 + i * row
        x0, x1 = sorted((x(0), x(v)))
        label = name if len(name) <= 44 else name[:20] + "…" + name[-23:]
        text = f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end">{Markup.escape(label)}</text>'
        if links and name in links:
            text = f'<a href="#{links[name]}">{text}</a>'
        tip = f"{v:.6g}" + (" [{:.4g}, {:.4g}]".format(*errors[name]) if name in errors else "")
        bar = f'<rect x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 1):.1f}" height="{row - 8}" rx="2" fill="{color}"/>'
        right = max(x1, x(0))
        if name in errors:
            e0, e1 = x(errors[name][0]), x(errors[name][1])
            bar += (f'<path d="M{e0:.1f} {y + 11}H{e1:.1f}M{e0:.1f} {y + 7}V{y + 15}M{e1:.1f} {y + 7}V{y + 15}" '
                    f'class="err"/>')
            right = max(right, e1)
        parts.append(f'<g><title>{Markup.escape(name)}: {tip}</title>{text}{bar}'
                     f'<text x="{right + 6:.1f}" y="{y + 15}" class="val">{v:.4g}</text></g>')
    parts.append("</svg>")
    return Markup("".join(parts))


def meter(frac: float, color: str) -> Markup:
    """A small inline bar for a fraction in [0, 1]."""
    w = max(0.0, min(1.0, frac)) * 120
    return Markup(f'<svg class="meter" width="120" height="10" viewBox="0 0 120 10"><rect width="120" height="10" '
                  f'rx="2" fill="#e8eaed"/><rect width="{w:.1f}" height="10" rx="2" fill="{color}"/></svg>')


def line_chart(series: list[tuple[str, str, list[tuple[float, float]]]], y_label: str, x_label: str,
               y_format: str = "{:.3g}", y_max: float | None = None, width: int = 760, height: int = 240) -> Markup:
    """Lines over a shared x axis as inline SVG: `series` is (label, color, [(x, y), ...]); a legend below."""
    left, right, top, bottom = 64, 16, 10, 40
    points = [p for _, _, ps in series for p in ps]
    if not points:
        return Markup("")
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y1 = y_max if y_max is not None else max(p[1] for p in points) or 1.0
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + plot_w * ((x - x0) / (x1 - x0) if x1 > x0 else 0.5)

    def sy(y: float) -> float:
        return top + plot_h * (1 - min(max(y, 0.0), y1) / y1)

    legend_h = 18 * ((len(series) + 2) // 3)
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height + legend_h}" width="{width}" role="img">',
             f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}" class="axis"/>',
             f'<line x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" y2="{top + plot_h}" class="axis"/>']
    for i in range(5):
        y = y1 * i / 4
        parts.append(f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" class="val">'
                     f'{Markup.escape(y_format.format(y))}</text>')
    for x in sorted({p[0] for p in points}):
        parts.append(f'<text x="{sx(x):.1f}" y="{top + plot_h + 14}" text-anchor="middle" class="val">{x:g}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.0f}" y="{top + plot_h + 30}" text-anchor="middle">'
                 f'{Markup.escape(x_label)}</text>')
    parts.append(f'<text x="12" y="{top + plot_h / 2:.0f}" transform="rotate(-90 12 {top + plot_h / 2:.0f})" '
                 f'text-anchor="middle">{Markup.escape(y_label)}</text>')
    for i, (label, color, ps) in enumerate(series):
        path = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f} {sy(y):.1f}" for j, (x, y) in enumerate(ps))
        dots = "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}">'
                       f'<title>{Markup.escape(label)} @ {x:g}: {Markup.escape(y_format.format(y))}</title></circle>'
                       for x, y in ps)
        parts.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="2"/>{dots}')
        lx, ly = left + (i % 3) * (plot_w / 3), height + 18 * (i // 3) + 4
        parts.append(f'<rect x="{lx:.0f}" y="{ly - 9}" width="12" height="4" fill="{color}"/>'
                     f'<text x="{lx + 18:.0f}" y="{ly - 3}">{Markup.escape(label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
