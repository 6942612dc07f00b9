"""The whole scan as one process runs it: resolve the model, run the engine (in a child process) and the
trainer on the same weights and tokens, analyze; and the chain after it (patch, gate, kl, the patched trainer's
departure, report) that the CLI's `scan --patch --kl --report` runs (`run_extras`). The engine is reached by name
through the registry (`graphdiff.engines`), started with the one `EngineOptions` record.

`graphdiff.analysis.scan.analyze` is the part after both sides have run.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from graphdiff import engines
from graphdiff.analysis import tensor_parallel as tp
from graphdiff.analysis.scan import (
    TrainSide,
    analyze,
    config_sha256,
    run_train_side,
)
from graphdiff.artifacts import ScanDir, new_scan_id
from graphdiff.capture.shapes import check_shapes, default_shapes, with_prompts
from graphdiff.engines.base import EngineOptions
from graphdiff.engines.store import save_engine_capture
from graphdiff.errors import GraphdiffError
from graphdiff.models.prepare import prepare_model
from graphdiff.models.resolve import ResolvedModel
from graphdiff.records import (
    AttentionForm,
    Buffers,
    Capture,
    Departure,
    KLResult,
    Manifest,
    Progress,
    SampleAsk,
    SampleRequest,
    ScanResult,
    Shape,
    save_json,
)


def check_same_weights(engine_cap: Capture, buffers: Buffers, train: TrainSide) -> None:
    """Both sides must have run the same weights: compare every weight a kernel recorded."""
    train_inputs = train.capture.graphs[0].inputs
    by_name = {name: train.values.get(node) for node, name in train_inputs.items()}
    for g in engine_cap.graphs:
        for records in buffers.values():
            for rec in (records.get(k.id) for k in g.kernels):
                for buf, t in (rec["in"] if rec is not None else {}).items():
                    name = g.inputs.get(buf, "")
                    ref = by_name.get(name) if "." in name else None  # weights only, not the token ids
                    if isinstance(ref, torch.Tensor) and isinstance(t, torch.Tensor) and not tp.same_weight(ref, t):
                        raise GraphdiffError(f"the engine capture ran other weights than {train.capture.model} "
                                             f"({name} differs); scan the checkpoint the engine ran")


@dataclass
class ScanOutcome:
    """A scan's result with what it ran on: both captures, the engine's buffers, the checkpoint."""

    result: ScanResult
    engine: Capture
    buffers: Buffers
    train: TrainSide
    model_dir: Path
    config: dict  # the checkpoint's config.json
    engine_started: bool
    options: EngineOptions  # as the engine ran (a capture made elsewhere: its recorded compilation config)


def _dump_config(engine_dump: Path, cap: Capture, options: EngineOptions) -> EngineOptions:
    """The options with the compilation config an engine capture was made with (what the patch's measurement and `kl`
    start again); one given on the command line must be the same. A capture older than the record takes the given
    one."""
    asked = options.asked
    if "compilation_config" not in cap.model_fields_set:
        cap.compilation_config = asked  # what the scan directory's copy of the capture records
        return options
    recorded = dict(cap.compilation_config)
    if options.compilation_config is not None or options.optimization_level is not None:
        if asked != recorded:
            raise GraphdiffError(f"{engine_dump} was captured with compilation config {json.dumps(recorded)}, not "
                                 f"{json.dumps(asked)}: leave out --compilation-config/-O, or capture again")
    return options.with_asked(recorded)


def _engine_from_dump(engine_dump: Path, resolved: ResolvedModel, spec: str, options: EngineOptions,
                      notes: list[str]) -> tuple[Capture, Buffers, EngineOptions]:
    """The engine side taken from a capture made elsewhere: it must have run this model config and checkpoint."""
    from graphdiff.engines.store import load_engine_capture
    from graphdiff.models.resolve import model_fingerprint

    cap, buffers = load_engine_capture(engine_dump, resolved.path)
    if cap.config_sha256 and cap.config_sha256 != config_sha256(resolved.config):
        raise GraphdiffError(f"{engine_dump} was captured from another model config than {spec} "
                             f"(layers, sizes or architecture differ)")
    if cap.fingerprint and cap.fingerprint != model_fingerprint(resolved.path):
        raise GraphdiffError(f"{engine_dump} was captured from another checkpoint than {spec} (fingerprint "
                             f"{cap.fingerprint}, this one {model_fingerprint(resolved.path)}): capture this one")
    made_by = cap.versions.get("vllm") or f"{cap.engine}, torch {cap.versions.get('torch', '?')}"
    made_by += f" on {cap.device}" if cap.device else ""
    notes.append(f"engine side from {engine_dump} (captured with {made_by}); the engine was not started")
    return cap, buffers, _dump_config(engine_dump, cap, options)


def _engine_run(resolved: ResolvedModel, shapes: list[Shape] | None, tokens: int, out: ScanDir | None,
                progress: Progress, sample: SampleAsk | None, options: EngineOptions) -> tuple[Capture, Buffers, float]:
    """The engine side run now, in a child process, into `out`'s engine dir (else a temporary one): vLLM, or the
    HF model under torch.compile (prefill shapes only; teacher-forced scores for the gap)."""
    import tempfile

    kind = engines.kind(options.engine)
    config = resolved.config
    if shapes is None:  # an engine without a KV cache (a compiled HF model): its default shapes are the prefills
        shapes = [s for s in default_shapes(tokens, config) if not kind.PREFILL_ONLY or s.phase == "prefill"]
    check_shapes(shapes, config)
    shapes = with_prompts(shapes, config)
    directory = out.engine_dir if out is not None else Path(tempfile.mkdtemp(prefix="graphdiff-engine-"))
    progress("starting the engine in its own process (compile)")
    request = _sample_request(config, sample, out.root if out is not None else directory)
    return kind.capture_isolated(resolved.path, shapes, directory, options, progress=progress,
                                 config_sha256=config_sha256(config), sample=request)


def _sample_request(config: dict, sample: SampleAsk | None, out_dir: Path) -> SampleRequest | None:
    """The seeded prompts the engine's child samples (or scores, teacher-forced) after its capture, into out_dir."""
    if sample is None:
        return None
    from graphdiff.engines.samples import random_prompts
    from graphdiff.measure.kl import check_request

    prompts = random_prompts(config, sample.count, sample.prompt_tokens, sample.seed)
    check_request(config, prompts, sample.max_tokens, "k3", False, None)
    return SampleRequest(prompts=prompts, max_tokens=sample.max_tokens, seed=sample.seed,
                         temperature=sample.temperature, out_dir=str(out_dir))


def capture_side(engine: str, resolved: ResolvedModel, shapes: list[Shape], out_dir: Path, options: EngineOptions,
                 progress: Progress = lambda m: None) -> Capture:
    """One side's capture of `resolved` at `shapes` written into `out_dir` (capture.json, and the engine's kernel
    buffers), with the model's config hash and fingerprint: "hf" traces the trainer's eager forward (the first shape's
    prompt), any other name starts that engine in this process."""
    from graphdiff.models.resolve import model_fingerprint

    if engine == "hf":
        from graphdiff.capture.hf import capture_hf

        progress("tracing the HF eager forward")
        cap = capture_hf(resolved.path, input_ids=shapes[0].prompts[0])[0]
        cap.fingerprint = model_fingerprint(resolved.path)
        save_json(cap, out_dir / "capture.json")
        return cap
    started = engines.start(engine, resolved.path, shapes, options, progress)
    try:
        cap = started.capture
        cap.config_sha256 = config_sha256(resolved.config)
        cap.fingerprint = model_fingerprint(resolved.path)
        cap.startup_s = round(started.startup_s, 3)
        save_engine_capture(cap, started.buffers, out_dir)
    finally:
        started.stop()
    return cap


def capture_dump(dump_dir: Path, out_dir: Path) -> Capture:
    """A TORCH_COMPILE_DEBUG dump read as the engine side into `out_dir`/capture.json."""
    cap = engines.start(engines.RECORDED[0], dump_dir, []).capture
    save_json(cap, out_dir / "capture.json")
    return cap


def scan(spec: str, *, options: EngineOptions | None = None, layers: int | None = None, tokens: int = 16,
         shapes: list[Shape] | None = None, out: ScanDir | None = None, work_dir: Path | None = None,
         progress: Progress = lambda m: None, argv: list[str] | None = None, engine_dump: Path | None = None,
         manifest: Path | None = None, allow_version_mismatch: bool = False, sample: SampleAsk | None = None,
         random_weights: bool = False) -> ScanOutcome:
    """Resolve `spec`, run the real engine `options.engine` (in a child process; or take its capture from
    `engine_dump`) and the HF trainer on the same weights and tokens, analyze. The engine capture is written to
    `out`'s engine dir. `sample`: the same engine then samples those seeded prompts into `out`/engine_samples.json
    (the patch's measurement and `kl` read them: one engine start). Every capture and the result record the scan id
    and the model fingerprint."""
    from graphdiff.models.resolve import model_fingerprint

    options = options or EngineOptions()
    t_start = time.perf_counter()
    resolved, notes = prepare_model(spec, layers, work_dir, progress, random_weights)
    identity = dict(scan_id=new_scan_id(), fingerprint=model_fingerprint(resolved.path))
    if engine_dump is not None:
        cap, buffers, options = _engine_from_dump(engine_dump, resolved, spec, options, notes)
        startup = 0.0
    else:
        engines.kind(options.engine).check(options, shapes, capture=True)
        cap, buffers, startup = _engine_run(resolved, shapes, tokens, out, progress, sample, options)
    t_engine = time.perf_counter()
    progress("tracing the trainer's eager forward")
    train = run_train_side(resolved.path, cap.prompt_tokens, manifest, allow_version_mismatch)
    if manifest is not None:
        notes.append(f"trainer side patched with {manifest}: the sites are what the patch leaves")
    if engine_dump is not None:
        check_same_weights(cap, buffers, train)
    t_train = time.perf_counter()
    progress(f"replaying kernels at {len(cap.shapes) or 1} shape(s), matching values, deciding the plan")
    reproduce = ("graphdiff " + shlex.join(argv) if argv
                 else f"graphdiff scan {shlex.quote(spec)} --engine {options.engine}")
    result = analyze(cap, buffers, train, model=spec, layers_total=_published_layers(spec, total_layers(resolved)),
                     config=resolved.config, reproduce=reproduce, notes=notes)
    _finish(result, manifest, options)
    result.timings.update(engine_startup_s=round(startup, 3), wall_s=round(time.perf_counter() - t_start, 3),
                          engine_total_s=round(t_engine - t_start, 3), train_s=round(t_train - t_engine, 3))
    for record in (result, cap, train.capture):
        record.scan_id, record.fingerprint = identity["scan_id"], identity["fingerprint"]
    if engine_dump is None and out is not None:  # the child wrote it before the scan had an id
        save_json(cap, out.engine_capture)
    return ScanOutcome(result, cap, buffers, train, resolved.path, resolved.config, engine_dump is None, options)


def total_layers(resolved: ResolvedModel) -> int:
    return int(resolved.config.get("num_hidden_layers", 0))


def _finish(result: ScanResult, manifest: Path | None, options: EngineOptions) -> None:
    """What the analysis leaves to the scan: who the trainer was, the config as asked; no kernels: refused."""
    for a in result.routing if manifest is not None else []:
        a.trainer = "patched"
    result.compilation_config = options.asked
    if not result.sites and not result.replay:
        raise GraphdiffError("the engine graph had no generated kernels to compare (is compile disabled?)")


def _published_layers(spec: str, scanned: int) -> int:
    from graphdiff.models.resolve import bundled_config

    cfg = bundled_config(spec) if "/" in spec else None
    return int(cfg.get("num_hidden_layers", scanned)) if cfg else scanned


def sample_ask(patch: bool, kl: bool, engine_dump: Path | None) -> tuple[int, SampleAsk | None]:
    """The tokens the patch's gate and the gap sample per prompt (the gap's length with --kl, else the gate's), and
    what the capture's engine samples so that one engine run serves both (None: nothing to sample, or no engine)."""
    from graphdiff.measure.gate import GATE_PROMPTS, GATE_TOKENS
    from graphdiff.measure.kl import DEFAULT_MAX_TOKENS

    tokens = DEFAULT_MAX_TOKENS if kl else GATE_TOKENS
    wanted = (patch or kl) and engine_dump is None
    return tokens, SampleAsk(count=GATE_PROMPTS, prompt_tokens=16, max_tokens=tokens) if wanted else None


# --- after the scan: patch, gate, gap, the patched trainer's departure, report -----------------------------

@dataclass
class Extras:
    """What `scan --patch/--kl/--report` asks for besides scan.json."""

    patch: bool = False
    kl: bool = False
    report: bool = False
    attention: AttentionForm = "fp32"
    exact: bool = False  # the engine's own ops where no rounding plan makes the forward equal (make_patch)
    gap_tokens: int = 256  # continuation tokens the gate and the gap sample (one engine run serves both)
    reproduce: str = ""


def run_extras(d: ScanDir, outcome: ScanOutcome, extras: Extras,
               progress: Progress = lambda m: None) -> tuple[Manifest | None, KLResult | None]:
    """The chain after the scan, into the (staging) scan directory `d`, one step each: scan.json and both captures,
    the patch measured region by region (gate), the log-prob gap (kl), where an unnamed rest is left in the patched
    gap the patched trainer's first departure from the engine, and the report."""
    save_scan(d, outcome)
    made = gated_patch(d, outcome, extras, progress) if extras.patch else None
    kl_result = None
    if extras.kl:
        kl_result = measure_gap(d, outcome, extras, progress)
        if extras.patch:
            manifest = d.patch_dir / "manifest.json"
            kl_result.departure, kl_result.departure_note = patched_departure(outcome, manifest, kl_result, progress)
        save_json(kl_result, d.kl_json)
        outcome.result.kl = kl_result
        d.save_scan(outcome.result)
    if extras.report:
        from graphdiff.report.html import write_html

        write_html(outcome.result, outcome.train.capture, outcome.engine, d.root / "report.html")
    return made, kl_result


def save_scan(d: ScanDir, outcome: ScanOutcome) -> None:
    """scan.json and the trainer's capture; an engine capture made elsewhere too (the report draws its graph)."""
    if not outcome.engine_started:
        save_engine_capture(outcome.engine, outcome.buffers, d.engine_dir)
    d.save_train(outcome.train.capture)
    d.save_scan(outcome.result)


def gated_patch(d: ScanDir, outcome: ScanOutcome, extras: Extras, progress: Progress) -> Manifest:
    """The patch into d/patch, then measured region by region on the engine's samples (gate)."""
    from graphdiff.codegen.generate import make_patch, write_patch
    from graphdiff.measure.gate import gate

    write_patch(make_patch(outcome.result, outcome.train.capture, None, extras.attention, extras.exact), d.patch_dir)
    progress("measuring the patch region by region")
    return gate(outcome.result, d.patch_dir, d.root, max_tokens=extras.gap_tokens, model_dir=outcome.model_dir,
                progress=progress)


def measure_gap(d: ScanDir, outcome: ScanOutcome, extras: Extras, progress: Progress) -> KLResult:
    """The log-prob gap on the engine's samples (the scan's engine, as it ran), patched too where --patch made one."""
    from graphdiff.measure.gate import GATE_PROMPTS
    from graphdiff.measure.kl import measure, random_prompts

    progress("measuring the log-prob gap")
    manifest = d.patch_dir / "manifest.json" if extras.patch else None
    options = EngineOptions(engine=outcome.engine.engine, device=str(outcome.engine.engine_config.get("device", "cpu")),
                            tensor_parallel_size=outcome.options.tensor_parallel_size
                            ).with_asked(outcome.result.compilation_config)
    result = measure(outcome.model_dir, random_prompts(outcome.config, GATE_PROMPTS, 16, 0), options=options,
                     max_tokens=extras.gap_tokens, manifest=manifest, out_dir=d.root, progress=progress,
                     reproduce=extras.reproduce)
    result.scan_id, result.fingerprint = outcome.result.scan_id, outcome.result.fingerprint
    if manifest is not None:
        # relative to the scan directory: `d` is the staging directory, renamed when the scan succeeds
        result.manifest = str(manifest.relative_to(d.root))
    return result


def patched_departure(outcome: ScanOutcome, manifest: Path, gap: KLResult,
                      progress: Progress) -> tuple[Departure | None, str]:
    """Where more than REST_LIMIT of the patched gap is unnamed in some bucket: the patched trainer analyzed against
    the scan's own engine capture and buffers, already in memory (no engine start, nothing read again), and the
    first value where it departs from the engine."""
    from graphdiff.measure.kl import REST_LIMIT, rest_buckets

    over = rest_buckets(gap.sources)
    if not over:
        return None, ""
    where = ", ".join(f"{i * gap.bucket}-{(i + 1) * gap.bucket - 1}" for i in over)
    if outcome.engine.graphs and len({tp.rank_of(g) for g in outcome.engine.graphs}) > 1:
        return None, f"the rest is over {REST_LIMIT:.0%} of the patched gap at positions {where}; a tensor-parallel " \
                     "capture's departure is not searched"
    progress("tracing the patched trainer against the scan's engine capture: where the rest departs")
    train = run_train_side(outcome.model_dir, outcome.engine.prompt_tokens, manifest)
    departure = analyze(outcome.engine, outcome.buffers, train, model=outcome.result.model,
                        layers_total=outcome.result.layers_total, config=outcome.config).departure
    if departure is None:
        return None, (f"the rest is over {REST_LIMIT:.0%} of the patched gap at positions {where}, but the patched "
                      "trainer equals the engine on every matched value of the scan's tokens: it departs at longer "
                      "positions or in what the engine computes outside its compiled graphs (sampling, logits)")
    return departure, (f"the rest is over {REST_LIMIT:.0%} of the patched gap at positions {where}; the patched "
                       f"trainer first departs from the engine at layer {departure.layer} {departure.op} "
                       f"({departure.module or departure.node}; {departure.source or 'no source line'}): "
                       f"{departure.differing:.1%} of its elements differ"
                       + (f"; the compared values it reads agree, so the difference arises in the ops between "
                          f"({departure.cause})" if departure.inputs_agree and departure.cause else "")
                       + (f", which the engine computes as ({departure.engine_cause})"
                          if departure.inputs_agree and departure.engine_cause else ""))
