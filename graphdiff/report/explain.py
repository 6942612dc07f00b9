"""`graphdiff explain SITE` and `graphdiff replay SCAN KERNEL`: one finding, and the command that reproduces it.

Everything `explain` prints is read from the scan directory (the plan's fields, the replay evidence, both
captures' source lines); `replay` re-runs one kernel's fragment on its recorded buffers, as the scan did,
and prints per-output statistics — the way Polygraphy reproduces one comparison.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from graphdiff.artifacts import ScanDir
from graphdiff.errors import GraphdiffError
from graphdiff.records import Decision, KernelEvidence, ScanResult, SideRef, Site
from graphdiff.report.headline import bound_percent


def find_site(scan: ScanResult, query: str) -> Site:
    """A site by its id, or by a part of it that names exactly one site."""
    exact = [s for s in scan.sites if s.id == query]
    close = exact or [s for s in scan.sites if query in s.id]
    if len(close) == 1:
        return close[0]
    if not scan.sites:
        raise GraphdiffError("this scan has no sites to explain")
    shown = ", ".join(s.id for s in (close or scan.sites)[:6])
    what = f"matches {len(close)} sites" if close else "is not a site of this scan"
    raise GraphdiffError(f"{query!r} {what}; e.g. {shown}" + (" ..." if len(close or scan.sites) > 6 else ""))


def _where(ref: SideRef | None) -> str:
    if ref is None or ref.source is None:
        return "(no source line: inside the kernel)"
    return f"{Path(ref.source.file).name}:{ref.source.line}  {ref.source.code}"


def _decision(scan: ScanResult, site: Site) -> Decision:
    return next(d for d in scan.plan if d.id == site.id and d.site)


def replay_command(scan_dir: Path, kernel: str, shape: str) -> str:
    return f"graphdiff replay {shlex.quote(str(scan_dir))} {shlex.quote(kernel)} --shape {shlex.quote(shape)}"


def explain_lines(scan_dir: Path, scan: ScanResult, site: Site) -> list[str]:
    """The site on one screen: both values and their source lines, the rule and its evidence, the kernel and
    its replay at every shape, and the command that replays that kernel alone."""
    d = _decision(scan, site)
    region = next((r for r in scan.regions if r.name == site.region), None)
    e = d.evidence
    engine_how = d.engine.how if d.engine else "-"
    lines = [f"site     {site.id}",
             f"region   {site.region} — {site.kind}: {region.kind_reason if region else ''}",
             f"rounded  on the {site.rounded_on} side only; "
             + ("proven" if site.proven else f"UNPROVEN: {site.unproven}")
             + f"; at shapes {', '.join(site.shapes) or '-'}",
             f"trainer  {site.train.node} = {site.train.op} [{site.train.dtype}]  {d.train.how}",
             f"         {_where(site.train)}"]
    if d.rule == "matched" and site.engine is not None:
        lines += [f"engine   {site.engine.node} = {site.engine.op} [{site.engine.dtype}]  {engine_how}",
                  f"         {_where(site.engine)}",
                  f"rule     matched: sorted-value distance {e.distance:.2e} (runner-up {e.runner_up:.2e}), "
                  f"confidence {e.confidence:.2f}"]
    elif d.rule == "inside-kernel":
        lines += [f"engine   no node of its own (another decomposition): {engine_how}",
                  f"rule     inside-kernel: the engine computes {e.stretch[0]} -> {e.stretch[1]} in one kernel, "
                  f"in FP32 registers; confidence {e.confidence:.2f}"]
    else:
        lines += [f"engine   {engine_how}", f"rule     {d.rule}: {e.registry}"]
    reps = [r for r in scan.replay if r.kernel == e.kernel]
    if reps:
        for r in reps:
            lines.append(f"kernel   {e.kernel} @ {r.shape}: " + (f"not replayed ({r.error})" if r.error else
                         f"predicted {bound_percent(r.predicted_bitexact)} / naive {bound_percent(r.naive_bitexact)} "
                         f"bit-identical over {r.elements} low-precision elements"))
        first = next((r for r in reps if not r.error), reps[0])
        lines.append(f"replay   {replay_command(scan_dir, e.kernel, first.shape)}")
    elif e.kernel:
        lines.append(f"kernel   {e.kernel} (opaque: not replayed; {e.registry or 'see the registry'})")
    return lines


@dataclass
class OneReplay:
    """A kernel's replay evidence at one shape, with the FX node and dtype of each low-precision store."""

    evidence: KernelEvidence
    stores: dict[str, tuple[str, str]]  # buffer -> (node, dtype)


def replay_one(scan_dir: Path, kernel_id: str, shape: str | None = None) -> OneReplay:
    """Re-run one kernel's fragment on its recorded buffers at `shape` (default: the first it ran at), with the
    buffer placements of the other kernels as the scan found them."""
    from graphdiff.analysis.rounding import buffer_nodes
    from graphdiff.replay.kernels import replay_kernel

    d = ScanDir(scan_dir)
    scan = d.load_scan()
    if not d.engine_capture.is_file():
        raise GraphdiffError(f"{d.engine_dir} holds no engine capture with buffers (a scan writes it there)")
    cap, buffers = d.load_engine(None)
    graph = next((g for g in cap.graphs if any(k.id == kernel_id for k in g.kernels)), None)
    if graph is None:
        names = sorted({k.id for g in cap.graphs for k in g.kernels if k.kind == "generated"})
        raise GraphdiffError(f"no kernel call {kernel_id!r} in {d.engine_capture}; e.g. {', '.join(names[:3])}")
    kernel = next(k for k in graph.kernels if k.id == kernel_id)
    if kernel.kind != "generated":
        raise GraphdiffError(f"{kernel_id} is an extern (opaque) call: there is no fragment to replay")
    shape = shape or next((label for label in graph.shapes if kernel_id in buffers.get(label, {})), "")
    record = buffers.get(shape, {}).get(kernel_id)
    if record is None:
        raise GraphdiffError(f"no recorded buffers of {kernel_id} at shape {shape!r}; shapes: "
                             f"{', '.join(label for label in buffers if kernel_id in buffers[label])}")
    known = buffer_nodes(graph)
    for ev in _evidence_at(scan, shape):
        if ev.kernel == kernel_id:
            continue  # its own stores are placed afresh
        for buf, node in ev.outputs.items():
            known.setdefault(buf, node)
    owned = {n for k in graph.kernels if k.kind == "generated" for n in k.nodes}
    rep, _, _ = replay_kernel(graph, kernel, record, known, owned)
    nodes = graph.node_map()
    stores = {b: (n, str(record["out"][b].dtype).removeprefix("torch."))
              for b, n in rep.outputs.items() if b in record["out"] and nodes.get(n) is not None}
    return OneReplay(rep.model_copy(update={"shape": shape}), stores)


def _evidence_at(scan: ScanResult, shape: str) -> list[KernelEvidence]:
    return [r for r in scan.replay if r.shape == shape]
