"""The whole scan as one process runs it: resolve the model, run the engine (in a child process) and the
trainer on the same weights and tokens, analyze; and the chain after it (patch, gate, kl, report) that the
CLI's `scan` runs.

`graphdiff.analysis.scan.analyze` is the part after both sides have run.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphdiff.analysis import tensor_parallel as tp
from graphdiff.analysis.scan import (
    DEFAULT_LAYERS,
    Buffers,
    Progress,
    TrainSide,
    analyze,
    config_sha256,
    run_train_side,
)
from graphdiff.artifacts import ScanDir
from graphdiff.capture.shapes import check_shapes, default_shapes, with_prompts
from graphdiff.capture.vllm_cpu import asked_config, check_options, split_level
from graphdiff.errors import GraphdiffError
from graphdiff.records import Capture, ScanResult, Shape


def prepare_model(spec: str, layers: int | None, work_dir: Path | None, progress: Progress) -> tuple[Any, list[str]]:
    """Resolve a model spec to a checkpoint dir both sides can load (seeded weights if it has none)."""
    from graphdiff.models.resolve import resolve_model
    from graphdiff.models.tiny import write_random_weights

    resolved = resolve_model(spec, work_dir=work_dir, layers=layers if layers is not None else DEFAULT_LAYERS)
    total = int(resolved.config.get("num_hidden_layers", 0))
    notes = []
    if resolved.origin == "bundled" or resolved.origin == "hf-cache":
        notes.append(f"config from {resolved.origin}; decoder layers are identical, so {total} layer(s) are "
                     "scanned and regions are collapsed across them")
    if not resolved.has_weights:
        progress("writing seeded random weights (same on both sides; no download)")
        write_random_weights(resolved.path)
        notes.append("weights: seeded random (graphdiff.models.tiny.write_random_weights), identical on both sides")
    return resolved, notes


def check_same_weights(engine_cap: Capture, buffers: Buffers, train: TrainSide) -> None:
    """Both sides must have run the same weights: compare every weight a kernel recorded."""
    train_inputs = train.capture.graphs[0].inputs
    by_name = {name: train.values.get(node) for node, name in train_inputs.items()}
    for g in engine_cap.graphs:
        for records in buffers.values():
            for rec in (records.get(k.id) for k in g.kernels):
                for buf, t in (rec or {}).get("in", {}).items():
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


def _dump_config(engine_dump: Path, cap: Capture, given: dict | None,
                 level: int | None) -> tuple[dict | None, int | None]:
    """The compilation config an engine capture was made with (what the patch's measurement and `kl` start again);
    one given on the command line must be the same. A capture older than the record takes the given one."""
    asked = asked_config(given or {}, level)
    if "compilation_config" not in cap.model_fields_set:
        cap.compilation_config = asked  # what the scan directory's copy of the capture records
        return given, level
    recorded = dict(cap.compilation_config)
    if given is not None or level is not None:
        if asked != recorded:
            raise GraphdiffError(f"{engine_dump} was captured with compilation config {json.dumps(recorded)}, not "
                                 f"{json.dumps(asked)}: leave out --compilation-config/-O, or capture again")
    return split_level(recorded)


def scan(spec: str, *, layers: int | None = None, tokens: int = 16, shapes: list[Shape] | None = None,
         out: ScanDir | None = None, work_dir: Path | None = None, progress: Progress = lambda m: None,
         argv: list[str] | None = None, engine_dump: Path | None = None, manifest: Path | None = None,
         compilation_config: dict | None = None, optimization_level: int | None = None,
         allow_version_mismatch: bool = False, sample: dict | None = None,
         tensor_parallel_size: int = 1) -> ScanOutcome:
    """Resolve `spec`, run the real engine (in a child process; or take its capture from `engine_dump`) and the
    HF trainer on the same weights and tokens, analyze. The engine capture is written to `out`'s engine dir.
    `sample` ({"count", "prompt_tokens", "max_tokens", "seed", "temperature"}): the same engine then samples that
    many seeded prompts, into `out`/engine_samples.json (the patch's measurement and `kl` read them: one engine
    start)."""
    import tempfile

    from graphdiff.capture.engine_process import capture_isolated, load_engine_capture

    t_start = time.perf_counter()
    resolved, notes = prepare_model(spec, layers, work_dir, progress)
    config = resolved.config
    total = int(config.get("num_hidden_layers", 0))
    if engine_dump is None:
        check_options(compilation_config or {}, optimization_level)
    if engine_dump is not None:
        cap, buffers = load_engine_capture(engine_dump, resolved.path)
        if cap.config_sha256 and cap.config_sha256 != config_sha256(config):
            raise GraphdiffError(f"{engine_dump} was captured from another model config than {spec} "
                                 f"(layers, sizes or architecture differ)")
        startup = 0.0
        notes.append(f"engine side from {engine_dump} (captured with {cap.versions.get('vllm', '?')}); "
                     "the engine was not started")
        compilation_config, optimization_level = _dump_config(engine_dump, cap, compilation_config,
                                                              optimization_level)
    else:
        shapes = shapes or default_shapes(tokens, config)
        check_shapes(shapes, config)
        shapes = with_prompts(shapes, config)
        directory = out.engine_dir if out is not None else Path(tempfile.mkdtemp(prefix="graphdiff-engine-"))
        progress("starting the engine in its own process (compile)")
        if sample is not None:
            from graphdiff.measure.engine import random_prompts
            from graphdiff.measure.kl import check_request

            prompts = random_prompts(config, sample["count"], sample["prompt_tokens"], sample["seed"])
            check_request(config, prompts, sample["max_tokens"], "k3", False, None)
            sample = dict(prompts=prompts, max_tokens=sample["max_tokens"], seed=sample["seed"],
                          temperature=sample["temperature"], out_dir=str(out.root if out is not None else directory))
        cap, buffers, startup = capture_isolated(resolved.path, shapes, directory, progress=progress,
                                                 compilation_config=compilation_config,
                                                 optimization_level=optimization_level,
                                                 config_sha256=config_sha256(config), sample=sample,
                                                 tensor_parallel_size=tensor_parallel_size)
    t_engine = time.perf_counter()
    progress("tracing the trainer's eager forward")
    train = run_train_side(resolved.path, cap.prompt_tokens, manifest, allow_version_mismatch)
    if manifest is not None:
        notes.append(f"trainer side patched with {manifest}: the sites are what the patch leaves")
    if engine_dump is not None:
        check_same_weights(cap, buffers, train)
    t_train = time.perf_counter()
    progress(f"replaying kernels at {len(cap.shapes) or 1} shape(s), matching values, deciding the plan")
    reproduce = "graphdiff " + shlex.join(argv) if argv else f"graphdiff scan {shlex.quote(spec)} --engine vllm"
    result = analyze(cap, buffers, train, model=spec, layers_total=_published_layers(spec, total),
                     config=config, reproduce=reproduce, notes=notes)
    for a in result.routing if manifest is not None else []:
        a.trainer = "patched"
    result.compilation_config = {**(compilation_config or {}), **(
        {"optimization_level": optimization_level} if optimization_level is not None else {})}
    result.timings.update(engine_startup_s=round(startup, 3), wall_s=round(time.perf_counter() - t_start, 3),
                          engine_total_s=round(t_engine - t_start, 3), train_s=round(t_train - t_engine, 3))
    if not result.sites and not result.replay:
        raise GraphdiffError("the engine graph had no generated kernels to compare (is compile disabled?)")
    return ScanOutcome(result, cap, buffers, train, resolved.path, config, engine_dump is None)


def _published_layers(spec: str, scanned: int) -> int:
    from graphdiff.models.resolve import bundled_config

    cfg = bundled_config(spec) if "/" in spec else None
    return int(cfg.get("num_hidden_layers", scanned)) if cfg else scanned
