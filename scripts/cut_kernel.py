"""Cut one generated kernel call out of a scan into a small replay fixture: the nodes of its fragment (the
inputs computed elsewhere as placeholders), the kernel with its code, the buffer -> node names the scan knows,
and its recorded buffers at one shape.

    python scripts/cut_kernel.py SCANDIR KERNEL_ID SHAPE OUTDIR   (writes OUTDIR/kernel.json, OUTDIR/buffers.pt)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from graphdiff.analysis.rounding import buffer_nodes
from graphdiff.artifacts import ScanDir
from graphdiff.records import Graph, Node
from graphdiff.replay.kernel_fragment import kernel_fragment
from graphdiff.report.explain import _evidence_at


def main(scan_dir: Path, kid: str, shape: str, out: Path) -> None:
    d = ScanDir(scan_dir)
    cap, buffers = d.load_engine(None)
    graph = next(g for g in cap.graphs if any(k.id == kid for k in g.kernels))
    k = next(k for k in graph.kernels if k.id == kid)
    known = buffer_nodes(graph)
    for ev in _evidence_at(d.load_scan(), shape):
        if ev.kernel != kid:
            for b, n in ev.outputs.items():
                known.setdefault(b, n)
    owned = {n for kk in graph.kernels if kk.kind == "generated" for n in kk.nodes}
    frag, external = kernel_fragment(graph, k, owned)
    keep = {n.name for n in frag} | set(external)
    # the kernel's listed nodes the fragment leaves out (views of an extern's out buffer) with what they view, so the
    # fixture's fragment is cut as the scan's was
    by, idle = graph.node_map(), [n for n in k.nodes if n not in keep]
    for name in idle:
        keep.add(name)
        idle += [i for i in by[name].inputs if i not in keep and i not in idle]
    nodes = []
    for n in (n for n in graph.nodes if n.name in keep):
        if n.name in external and n.op != "placeholder":  # computed by another kernel: an input here
            n = Node(name=n.name, op="placeholder", target="", dtype=n.dtype, shape=n.shape, sym=n.sym)
        nodes.append(n.model_copy(update={"source": None}))
    sub = Graph(name=graph.name, nodes=nodes, kernels=[k])
    args = {a.name for a in k.args}
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel.json").write_text(json.dumps({
        "kernel_id": kid, "shape": shape, "graph": sub.model_dump(mode="json"),
        "known": {b: n for b, n in known.items() if b in args and n in keep}, "owned": sorted(owned & keep)}, indent=1))
    torch.save(buffers[shape][kid], out / "buffers.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]))
