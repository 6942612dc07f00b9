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
import re
import shutil
from collections import defaultdict

import graphviz

from graphdiff.model import Graph, Node, Site

TRAIN_COLOR, TRAIN_FILL = "#e8710a", "#fde3cc"  # train = orange
ENGINE_COLOR, ENGINE_FILL = "#1a73e8", "#d2e3fc"  # engine = blue
SIDE_COLORS = {"train": (TRAIN_COLOR, TRAIN_FILL), "engine": (ENGINE_COLOR, ENGINE_FILL)}
FONT = "Helvetica,Arial,sans-serif"

GLUE = {"getitem", "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "split", "split_with_sizes", "slice",
        "permute", "expand", "alias", "t", "transpose", "select", "clone", "contiguous", "detach", "as_strided",
        "_reshape_alias", "unbind", "chunk", "lift_fresh_copy", "sym_size", "output"}
ALLOC = {"empty", "empty_like", "empty_strided", "zeros", "full", "new_empty"}
HEAVY = {"mm", "addmm", "bmm", "matmul", "linear", "baddbmm", "embedding", "convolution", "onednn_mm"}
HOPS = 2
MAX_NODES = 28  # per side, for region pictures
MAX_SEEDS = 8  # engine nodes standing in for a site no engine node computes
_LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def dot_binary() -> str | None:
    """Path of Graphviz `dot`; the report degrades to a note without it (tests patch this)."""
    return shutil.which("dot")


def op_name(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) >= 2 else parts[0]


def layer_of(module: str | None) -> int | None:
    m = _LAYER.search("." + (module or ""))
    return int(m.group(1)) if m else None


def is_heavy(n: Node) -> bool:
    name = op_name(n.target)
    return name in HEAVY or "attention" in name or "scaled_dot_product" in name


def hidden(n: Node) -> bool:
    if n.op == "placeholder":  # symbols and integer handles say nothing about rounding
        return n.dtype is None or not ("float" in n.dtype or n.dtype.startswith("bfloat"))
    return n.op == "output" or op_name(n.target) in GLUE | ALLOC


def contracted(graph: Graph, keep: set[str] = frozenset()) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(inputs, users) between visible nodes, looking through glue. An allocation stands for the
    out-variant ops (onednn_mm, attention_with_output) that wrote it before the reader ran."""
    nodes = graph.node_map()
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    writers: dict[str, list[str]] = defaultdict(list)
    for n in graph.nodes:
        for i in n.inputs:
            if i in nodes and op_name(nodes[i].target) in ALLOC and not hidden(n):
                writers[i].append(n.name)

    def resolve(name: str, reader: int, seen: set[str]) -> list[str]:
        n = nodes.get(name)
        if n is None or name in seen:
            return []
        seen.add(name)
        if name in keep or not hidden(n):
            return [name]
        if op_name(n.target) in ALLOC:
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
    picked, frontier = list(seeds), list(seeds)
    for _ in range(hops):
        nxt = []
        for name in frontier:
            if is_heavy(nodes[name]) and name not in seeds:
                continue  # a matmul/attention is the boundary of the picture
            for other in inputs.get(name, []) + users.get(name, []):
                if layer_of(nodes[other].module) not in layers:
                    continue
                if other not in picked and len(picked) < max(limit, len(seeds)):
                    picked.append(other)
                    nxt.append(other)
        frontier = nxt
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    return sorted(picked, key=order.__getitem__)


def graph_of(graphs: list[Graph], node: str = "", kernel: str | None = None) -> Graph | None:
    for g in graphs:
        if (kernel and any(k.id == kernel for k in g.kernels)) or (node and any(n.name == node for n in g.nodes)):
            return g
    return None


_STRETCH = re.compile(r"computes (\S+) -> (\S+) inside")  # the evidence sites.py writes for unmatched sites


def _between(graph: Graph, above: str, below: str) -> list[str]:
    """Visible nodes on a path from `above` to `below` (exclusive)."""
    nodes = graph.node_map()
    down, frontier = set(), [above]
    users: dict[str, list[str]] = defaultdict(list)
    for n in graph.nodes:
        for i in n.inputs:
            users[i].append(n.name)
    while frontier:
        frontier = [u for n in frontier for u in users[n] if u not in down and not down.add(u)]
    up, frontier = set(), [below]
    while frontier:
        frontier = [i for n in frontier for i in nodes[n].inputs if i in nodes and i not in up and not up.add(i)]
    return [n.name for n in graph.nodes if n.name in down & up and not hidden(n)]


def stand_ins(engine: Graph, site: Site, taken: set[str]) -> list[str]:
    """Engine nodes to draw for a site no engine node computes: the stretch its evidence names
    (between the engine values matched above and below it), else same-op nodes of its kernel in
    the site's module subtree, else the kernel's nodes."""
    if site.engine is None or not site.engine.kernel:
        return []
    kernel = next((k for k in engine.kernels if k.id == site.engine.kernel), None)
    if kernel is None:
        return []
    nodes = engine.node_map()
    m = _STRETCH.search(site.evidence)
    if m and m.group(1) in nodes and m.group(2) in nodes:
        stretch = [n for n in _between(engine, m.group(1), m.group(2)) if n not in taken]
        if stretch:
            return stretch[:MAX_SEEDS]
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
    meta = " · ".join(x for x in (n.name, _DT.get(n.dtype or "", n.dtype or ""), _shape(n)) if x)
    rows = [f"<B>{html.escape(head)}</B>", f'<FONT POINT-SIZE="8" COLOR="#5f6368">{html.escape(meta)}</FONT>']
    if note:
        rows.append(f'<FONT POINT-SIZE="8"><I>{html.escape(note)}</I></FONT>')
    return "<" + "<BR/>".join(rows) + ">"


def _tooltip(n: Node) -> str:
    src = n.source
    where = f"{src.file.split('site-packages/')[-1]}:{src.line}  {src.code}" if src else ""
    return f"{n.name} = {n.target}({n.args})" + (f"\n{where}" if where else "")


def _add_nodes(g: graphviz.Digraph, graph: Graph, names: list[str], side: str, prefix: str,
               marks: dict[str, tuple[str, str, bool]]) -> None:
    """marks: node -> (badge, rounding side, rounds here)."""
    nodes = graph.node_map()
    for name in names:
        n = nodes[name]
        attrs = {"id": f"{prefix}{side[0]}-{name}", "tooltip": _tooltip(n)}
        badge, note = "", ""
        if name in marks:
            badge, rounding, here = marks[name]
            color, fill = SIDE_COLORS[rounding]
            note = f"rounds to {_DT.get(n.dtype or '', n.dtype)}" if here else "keeps FP32"
            attrs |= {"color": color, "penwidth": "2", "fillcolor": fill if here else "#ffffff",
                      "style": "rounded,filled" if here else "rounded,filled,dashed"}
        elif n.op == "placeholder":
            attrs |= {"shape": "note", "style": "filled", "fillcolor": "#f1f3f4"}
        elif is_heavy(n):
            attrs |= {"fillcolor": "#e8eaed"}
        g.node(_id(side, name), _label(n, graph.inputs, badge, note), **attrs)


def region_dot(train: Graph | None, engine: Graph | None, sites: list[Site], title: str, prefix: str = "",
               extra_train: list[str] = (), extra_engine: list[str] = (), limit: int = MAX_NODES) -> str:
    """DOT source of both graphs around `sites` (plus extra seed nodes, e.g. a whole layer)."""
    badges = {s.id: f"S{i + 1}" for i, s in enumerate(sites)}
    tmarks: dict[str, tuple[str, str, bool]] = {}
    emarks: dict[str, tuple[str, str, bool]] = {}
    links: list[tuple[str, str, str, str]] = []  # train node, engine node, badge, rounding side
    anchors: dict[str, list[str]] = defaultdict(list)  # kernel id -> stand-in nodes of unmatched sites
    enodes = engine.node_map() if engine else {}
    taken = {s.engine.node for s in sites if s.engine and s.engine.node}
    for s in sites:
        b = badges[s.id]
        tmarks[s.train.node] = (b, s.rounded_on, s.rounded_on == "train")
        if s.engine and s.engine.node in enodes:
            emarks[s.engine.node] = (b, s.rounded_on, s.rounded_on == "engine")
            links.append((s.train.node, s.engine.node, b, s.rounded_on))
        elif engine is not None and s.engine and s.engine.kernel:
            anchors[s.engine.kernel] += stand_ins(engine, s, taken)
            links.append((s.train.node, "", b, s.rounded_on))
    hops = 0 if extra_train or extra_engine else HOPS
    tnames = neighbourhood(train, [*tmarks, *extra_train], hops, limit) if train else []
    eseeds = [*emarks, *(n for ns in anchors.values() for n in ns), *extra_engine]
    enames = neighbourhood(engine, eseeds, hops, limit) if engine else []

    g = graphviz.Digraph(name=prefix.strip("-") or "region", comment=title)
    g.attr("graph", rankdir="TB", compound="true", newrank="true", fontname=FONT, fontsize="11", nodesep="0.18",
           ranksep="0.28", tooltip=title, bgcolor="transparent")
    g.attr("node", shape="box", style="rounded,filled", fillcolor="#ffffff", color="#9aa0a6", fontname=FONT,
           fontsize="10", margin="0.08,0.03", height="0.3")
    g.attr("edge", color="#9aa0a6", arrowsize="0.6")
    if train:
        with g.subgraph(name="cluster_train") as c:
            c.attr(label="HF eager (trainer)", color=TRAIN_COLOR, fontcolor=TRAIN_COLOR, style="rounded",
                   penwidth="1.5")
            _add_nodes(c, train, tnames, "train", prefix, tmarks)
        _add_edges(g, train, tnames, "train")
    if engine:
        with g.subgraph(name="cluster_engine") as c:
            c.attr(label="engine (compiled)", color=ENGINE_COLOR, fontcolor=ENGINE_COLOR, style="rounded",
                   penwidth="1.5")
            by_kernel: dict[str | None, list[str]] = defaultdict(list)
            for name in enames:
                k = enodes[name].kernel
                by_kernel[k if k and not k.startswith(("torch.ops", "extern")) else None].append(name)
            _add_nodes(c, engine, by_kernel.pop(None, []), "engine", prefix, emarks)
            for i, (kid, names) in enumerate(by_kernel.items()):
                with c.subgraph(name=f"cluster_k{i}") as kc:
                    kname, _, call = kid.partition(":")
                    kc.attr(label=f"{_short(kname)}  (call {call})", tooltip=kid, style="rounded,filled",
                            fillcolor="#f3f7fe", color="#a8c7fa", fontcolor="#174ea6", fontsize="9", id=f"{prefix}k{i}")
                    _add_nodes(kc, engine, names, "engine", prefix, emarks)
        _add_edges(g, engine, enames, "engine")
    kernel_cluster = {kid: f"cluster_k{i}" for i, kid in enumerate(k for k in dict.fromkeys(
        enodes[n].kernel for n in enames) if k and not k.startswith(("torch.ops", "extern")))}
    for t, e, b, side in links:
        color = SIDE_COLORS[side][0]
        if t not in tnames:
            continue
        if e:
            if e in enames:
                g.edge(_id("train", t), _id("engine", e), style="dashed", color=color, dir="none", constraint="false",
                       label=b, fontcolor=color, fontsize="9", fontname=FONT)
            continue
        site = next(s for s in sites if badges[s.id] == b)
        target = next((n for n in anchors.get(site.engine.kernel, []) if n in enames), None)
        if target:
            g.edge(_id("train", t), _id("engine", target), style="dashed", color=color, dir="none", constraint="false",
                   label=f"{b}: inside kernel", fontcolor=color, fontsize="9", fontname=FONT,
                   lhead=kernel_cluster.get(site.engine.kernel, ""))
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
