"""What the command line prints: rich tables of a scan, a capture, a patch, a gap; progress; one-line user errors."""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from graphdiff.analysis.opaque import truncates_output
from graphdiff.errors import GraphdiffError

console = Console(stderr=True)  # progress and errors
out = Console(width=None if sys.stdout.isatty() else 160)  # what a command reports


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    try:
        yield
    except GraphdiffError as e:
        print_error(e)
        raise typer.Exit(2) from None


def print_error(e: GraphdiffError) -> None:
    console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)


@contextlib.contextmanager
def progress(title: str) -> Iterator:
    """A spinner with elapsed time; the callback replaces its message."""
    t0 = time.perf_counter()
    with console.status(title) as status:
        def update(msg: str) -> None:
            status.update(f"{msg}  [dim]({time.perf_counter() - t0:.0f}s)[/]")
            console.log(msg)
        yield update


def print_scan_outputs(result, d, kl_result, made, report: bool) -> None:  # noqa: ANN001 - records
    print_scan(result, d.root)
    if kl_result is not None:
        print_kl(kl_result)
    out.print(f"wrote {d.scan_json}")
    if report:
        out.print(f"wrote {d.report_html}")
    if made is not None:
        print_patch(made)
        print_patch_notes(made, d.patch_dir)


def print_scan(result, scan_dir: Path) -> None:  # noqa: ANN001 - ScanResult
    from graphdiff.report.headline import headline

    evidence: dict[str, list] = {}
    for r in result.replay:
        evidence.setdefault(r.kernel.split(":")[0], []).append(r)
    t = Table(title=f"rounding sites: {result.model} ({result.architecture})", show_lines=False)
    for col in ("region", "kind", "layers", "sites", "rounded on", "replay (predicted / naive)", "shapes",
                "train source", "engine source"):
        t.add_column(col, overflow="fold")
    sites = {s.id: s for s in result.sites}
    every = [s.label for s in result.shapes]
    for r in result.regions:
        reps = [x for k in r.kernels for x in evidence.get(k, []) if not x.error]
        rep = (f"{min(x.predicted_bitexact for x in reps):.2%} / {max(x.naive_bitexact for x in reps):.2%}"
               if reps else "-")
        if not r.proven:
            rep += " UNPROVEN"
        first = sites[r.sites[0]]
        src = first.train.source
        esrc = next((s.engine.source for s in (sites[i] for i in r.sites) if s.engine and s.engine.source), None)
        layers = ",".join("-" if x is None else str(x) for x in r.layers)
        if r.differing_layers:
            layers += f" (differs: {','.join(map(str, r.differing_layers))})"
        where = "all" if r.shapes == every and not r.shape_dependent else ("only " + ",".join(r.shapes))
        t.add_row(r.name, r.kind, layers, str(len(r.sites)), "/".join(r.rounded_on), rep, where,
                  f"{Path(src.file).name}:{src.line} {src.code[:48]}" if src else "-",
                  f"{Path(esrc.file).name}:{esrc.line} {esrc.code[:48]}" if esrc else
                  first.engine.how if first.engine and r.kind == "attention" else "(inside the kernel)")
    out.print(t)
    if result.shapes:
        out.print("shapes: " + ", ".join(s.label for s in result.shapes) + " (the trainer ran the first)")
    if result.engine_device and result.engine_device != "cpu":  # the analysis read its buffers on this CPU
        out.print(f"engine tensors recorded on {result.engine_device}; its kernels replayed on the CPU where their "
                  "code allows")
    attn = result.engine_attention
    if attn.get("cpu"):  # the CPU kind decides vLLM CPU's kernels: the scan holds for this kind
        out.print(f"engine kernels of a {attn['cpu']} CPU: {attn.get('backend')} ({attn.get('isa')}) attention, "
                  f"vLLM ops build {attn.get('build')}"
                  + (" (stores BF16 by truncation)" if truncates_output(attn) else ""))
    for i, line in enumerate(headline(result)):
        out.print(line if i == 0 else f"[yellow]{line}[/]", highlight=False)
    for note in result.notes:
        out.print(f"[yellow]note:[/] {note}")
    if result.sites:
        out.print(f"explain a site: graphdiff explain {shlex.quote(result.sites[0].id)} {shlex.quote(str(scan_dir))}")
    out.print(departure_line(result.departure, result.shapes[0].label if result.shapes else ""), highlight=False)
    out.print(f"reproduce: {result.reproduce}")


def departure_line(d, shape: str) -> str:  # noqa: ANN001 - Departure | None
    """Where the trainer's values first differ from the engine's (the next thing to look at once no site is left)."""
    if d is None:
        return f"every matched value is bit-identical to the engine's at {shape}"
    where = f" from row {d.first_row}" if d.first_row is not None else " (in the engine's layout)"
    return (f"first departure from the engine at {shape}: layer {d.layer} {d.node} ({d.op.removeprefix('aten.')}, "
            f"{d.source or d.module}): {d.differing:.3%} of elements differ{where}; engine {d.engine_node} in "
            f"{d.kernel.split(':')[0] or '?'}; the {d.equal_before} matched values before it are bit-identical"
            + (f"; the {len(d.inputs_agree)} compared values it reads agree, so it arises in the ops between "
               f"({d.cause})" if d.inputs_agree and d.cause else "")
            + (f", which the engine computes as ({d.engine_cause})" if d.inputs_agree and d.engine_cause else ""))


def print_summary(cap, show_kernels: bool = True) -> None:  # noqa: ANN001 - Capture
    from graphdiff.ops import ALLOCATIONS, VIEWS

    for g in cap.graphs:
        ops = Counter(n.target for n in g.nodes if n.op == "call_function")
        t = Table(title=f"{cap.side} graph {g.name} ({cap.engine}, {cap.architecture})", show_header=True)
        t.add_column("nodes", justify="right")
        t.add_column("kernels", justify="right")
        t.add_column("top ops")
        gen = sum(k.kind == "generated" for k in g.kernels)
        top = ", ".join(f"{op.removeprefix('aten.')}×{c}" for op, c in ops.most_common(8))
        t.add_row(str(len(g.nodes)), f"{gen} generated + {len(g.kernels) - gen} extern", top)
        out.print(t)
        if show_kernels and g.kernels:
            nodes = g.node_map()
            kt = Table(show_header=True, box=None)
            kt.add_column("kernel call")
            kt.add_column("kind")
            kt.add_column("fused ops (compute only)")
            kt.add_column("stores")
            for k in g.kernels:
                fused = [nodes[n].target.split(".")[1] if "." in nodes[n].target else nodes[n].target
                         for n in k.nodes if n in nodes]
                compute = [f for f in dict.fromkeys(fused) if f not in VIEWS | ALLOCATIONS]
                stores = ", ".join(f"{a.name}:{a.dtype}" for a in k.args if a.role in ("out", "inout") and a.dtype)
                kt.add_row(k.id, k.kind, " ".join(compute), stores)
            out.print(kt)
    for note in cap.notes:
        out.print(f"[yellow]note:[/] {note}")


def print_patch(manifest) -> None:  # noqa: ANN001 - Manifest
    t = Table(title=f"patch for {manifest.model} ({manifest.architecture})")
    for col in ("region", "kind", "splice", "pytorch", "triton", "enabled", "k3 with it (1e-4)", "step +ms"):
        t.add_column(col)
    if manifest.step_tokens:
        t.caption = ("step +ms: what the region's splice adds to a training step (forward + backward, CPU time) of "
                     f"the scanned model ({manifest.step_layers} layers, {manifest.step_tokens} tokens)")
    for r in manifest.regions:
        s = next((s for s in manifest.splices if r.name in s.regions), None)
        triton = "-" if s is None else ("yes" if s.triton_fn else (s.triton_problem or "n/a (hook)"))
        effect = "-" if r.effect is None else f"{r.effect.delta * 1e4:+.2f}" + (
            f" [{r.effect.ci[0] * 1e4:+.2f}, {r.effect.ci[1] * 1e4:+.2f}]" if r.effect.ci else "") + (
            f"; equal to the engine {r.effect.equal_with} (without {r.effect.equal_without})"
            if r.effect.decided_by == "equality" else "")
        t.add_row(r.name, r.kind, "-" if s is None else f"{s.target} {s.key}", "yes" if r.generated else r.reason,
                  triton, "yes" if r.generated and r.enabled else "no", effect,
                  "-" if r.step_ms is None else f"{r.step_ms:+.1f}")
    out.print(t)
    for note in manifest.notes:
        out.print(f"[yellow]note:[/] {note}", highlight=False)


def print_patch_notes(manifest, where: Path) -> None:  # noqa: ANN001 - Manifest
    done = sum(r.generated for r in manifest.regions)
    enabled = sum(r.generated and r.enabled for r in manifest.regions)
    out.print(f"wrote {where / 'manifest.json'} ({done} of {len(manifest.regions)} regions generated, {enabled} "
              "enabled)")


def print_kl(result) -> None:  # noqa: ANN001 - KLResult
    from graphdiff.report.gap import floor_note, regions_label

    t = Table(title=f"log-prob gap, diff = logp_engine - logp_train: {result.model} ({result.architecture}), "
                    f"{result.prompts} prompts x {result.max_tokens} tokens")
    for col in ("engine", "trainer", "patched", "k3 ± se (1e-4)", "rms", "max |diff|", "bit-identical",
                "k1 ± se (1e-4)", "tokens"):
        t.add_column(col, justify="left" if col in ("engine", "trainer", "patched") else "right")

    def pm(value: float, se: float | None) -> str:
        return f"{value * 1e4:.2f}" + ("" if se is None else f" ± {se * 1e4:.2f}")

    rows = [*result.measurements, *([result.floor] if result.floor else [])]
    for m in rows:
        t.add_row(m.engine_mode, "engine prefill (floor)" if m.trainer_mode == "engine-prefill" else m.trainer_mode,
                  regions_label(m), pm(m.k3, m.k3_se), f"{m.rms:.4f}", f"{m.max_abs:.4f}", f"{m.bitexact_fraction:.1%}",
                  pm(m.k1, m.k1_se), str(m.tokens))
    out.print(t)
    positions = position_table(result)
    if positions is not None:
        out.print(positions)
    if (note := floor_note(result)) is not None:
        out.print(f"[yellow]floor:[/] {note}")
    if result.sources_note:
        out.print(f"[yellow]note:[/] {result.sources_note}")
    for region in result.left_out:
        out.print(f"in the patched gap, not patched: {region}")
    if result.departure_note:
        out.print(f"[yellow]unnamed rest:[/] {result.departure_note}")
    if result.routing:
        by: dict[str, list] = {}
        for r in result.routing:
            by.setdefault(r.trainer, []).append(r)
        out.print(f"MoE routing on the samples ({result.routing[0].shape}), tokens whose top-k experts differ from the "
                  "engine's, per layer: " + "; ".join(
                      f"{who} " + ", ".join(f"{r.layer}: {r.differing}/{r.tokens}" for r in rows)
                      for who, rows in by.items()))
    a = result.attribution
    if a is not None:
        s = Table(title=f"Shapley attribution of the {a.metric} reduction ({a.method}; {a.tokens} tokens, "
                        f"{a.sequences} sequences, {a.confidence:.0%} bootstrap CI over sequences)")
        for col in ("region", "value (1e-4)", "share", "CI (1e-4)"):
            s.add_column(col, justify="left" if col == "region" else "right")
        for v in a.values:
            s.add_row(v.region, f"{v.value * 1e4:.2f}", "-" if v.share is None else f"{v.share:.1%}",
                      f"[{v.ci_low * 1e4:.2f}, {v.ci_high * 1e4:.2f}]")
        out.print(s)
        best = ("none (alignment does not reduce the gap)" if a.minimal_set is None else
                f"{'+'.join(a.minimal_set)} (measured {a.minimal_set_reduction * 1e4:.2f}e-4, {a.minimal_set_method})")
        out.print(f"{a.metric} {a.baseline * 1e4:.2f}e-4 unpatched, {a.aligned * 1e4:.2f}e-4 with all regions; "
                  f"minimal set for {a.target:.0%} of the reduction: {best}")
    for note in result.notes:
        out.print(f"[yellow]note:[/] {note}")
    out.print(f"how: {result.method}")
    out.print(f"reproduce: {result.reproduce}")


def position_table(result) -> Table | None:  # noqa: ANN001 - KLResult
    """The gap per position bucket (report.gap.gap_table) as a terminal table."""
    from graphdiff.report.gap import gap_table

    table = gap_table(result)
    if table is None:
        return None
    p = Table(title=f"rms of diff (bit-identical) by continuation position, {result.bucket} at a time "
                    "(0 = the first sampled token)")
    p.add_column("engine / trainer")
    for bucket in table.buckets:
        p.add_column(bucket, justify="right")
    for i, (label, cells) in enumerate(table.rows):
        p.add_row(label, *(f"[red]{c}[/]" if i in table.colored and c == "no" else c for c in cells))
    return p


def print_configs() -> None:
    """The bundled model configs, one row each."""
    import json
    from importlib import resources

    from graphdiff.models.resolve import bundled_ids

    t = Table(title="bundled model configs (seeded random weights; no download)")
    for col in ("model id", "architecture", "layers", "hidden", "heads / kv", "vocab"):
        t.add_column(col)
    for model_id in bundled_ids():
        name = model_id.replace("/", "--") + ".json"
        cfg = json.loads((resources.files("graphdiff.models.configs") / name).read_text())
        t.add_row(model_id, cfg["architectures"][0], str(cfg.get("num_hidden_layers")), str(cfg.get("hidden_size")),
                  f"{cfg.get('num_attention_heads')} / {cfg.get('num_key_value_heads')}", str(cfg.get("vocab_size")))
    out.print(t)


def print_archs(archs: dict[str, str]) -> None:
    """The tiny architectures, each with its transformers config class."""
    t = Table(title="tiny architectures (seeded; `graphdiff make-tiny ARCH --out DIR` or MODEL = tiny:ARCH)")
    t.add_column("arch")
    t.add_column("transformers config")
    for name, cls in archs.items():
        t.add_row(name, cls)
    out.print(t)


def print_replay(kernel: str, one) -> None:  # noqa: ANN001 - report.explain's replay of one kernel
    """One kernel's replay: each store bit for bit under both rounding models, and its row sums' order."""
    r = one.evidence
    t = Table(title=f"{kernel} @ {r.shape}: its fragment re-run on the recorded inputs, compared bit for bit with "
                    "its recorded stores")
    for col in ("store", "node", "dtype", "predicted", "naive"):
        t.add_column(col, justify="right" if col in ("predicted", "naive") else "left")
    for buf, (node, dtype) in one.stores.items():
        pred, naive = r.per_output.get(buf, (float("nan"), float("nan")))
        t.add_row(buf, node, dtype, f"{pred:.2%}", f"{naive:.2%}")
    out.print(t)
    out.print(f"predicted rounding model (FP32 in registers, rounded at stores"
              f"{', and at ' + ', '.join(r.explicit_roundings) if r.explicit_roundings else ''}): "
              f"{r.predicted_bitexact:.2%} of {r.elements} low-precision elements bit-identical; naive "
              f"round-after-every-op: {r.naive_bitexact:.2%}")
    if r.reduction_lanes:
        aten = (f"; in ATen's order {r.aten_order_bitexact:.4%} and {r.aten_order_fp32_error:.2g}"
                if r.aten_order_bitexact is not None and r.aten_order_fp32_error is not None else "")
        out.print(f"row sums in the kernel's order ({r.reduction_lanes} lanes, then a halving tree): FP32 stores "
                  f"within {r.fp32_max_rel_error:.2g} (relative){aten}")


def print_verify(checks: list, device: str, triton: bool) -> None:
    """`patch --verify`'s checks, one row per splice and path."""
    from graphdiff.codegen.verify import GRAD_RTOL

    t = Table(title=f"verify on {device}: forward vs the plan replay (Triton vs PyTorch, on probes with exact row "
                    f"sums), backward vs float64 (limit {GRAD_RTOL:.0e})")
    for col in ("splice", "path", "aligned", "forward", "max ulp", "allowed", "grad rel err", "ok"):
        t.add_column(col, justify="left" if col in ("splice", "path") else "right")
    for c in checks:
        t.add_row(c.splice, c.path, "yes" if c.aligned else "no", "bit-identical" if c.identical else "differs",
                  f"{c.max_ulp:.1f}", str(c.ulp_limit), f"{c.grad_rel_err:.1e}",
                  "[green]ok[/]" if c.ok else "[red]FAIL[/]")
    out.print(t)
    for cause in sorted({c.cause for c in checks if c.cause}):
        out.print(f"allowed ulp: {cause}")
    if not triton:
        out.print("[yellow]note:[/] Triton kernels not run (CPU without TRITON_INTERPRET=1); PyTorch path only")
