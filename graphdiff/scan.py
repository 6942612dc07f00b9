"""The scan pipeline: resolve -> capture both sides -> rounding (replay-verified) -> match -> sites.

Plain functions over the data model. `analyze` is the part after the engine has run (what
the analysis-time benchmark measures); `scan` adds resolving the model and running both sides.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphdiff.errors import GraphdiffError
from graphdiff.match import match_values
from graphdiff.measure.site_uniformity import site_nonuniformity
from graphdiff.model import Capture, KernelEvidence, ScanResult
from graphdiff.rounding import eager_values, engine_rounding, train_rounding
from graphdiff.sites import find_sites, group_regions

Progress = Callable[[str], None]
DEFAULT_LAYERS = 2  # decoder layers are identical: two show everything, including layer-to-layer flow


def prompt_tokens(config: dict, n: int, seed: int = 0) -> list[int]:
    """A seeded test prompt within the model's vocabulary."""
    vocab = int(config.get("vocab_size", 1000))
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, min(vocab, 32000), (n,), generator=gen).tolist()


def config_sha256(config: dict) -> str:
    keep = {k: v for k, v in config.items() if k not in ("transformers_version", "_name_or_path")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


@dataclass
class TrainSide:
    capture: Capture
    values: dict[str, Any]
    rounded: dict[str, float]
    gm: Any = None  # the executable eager graph (re-runs ops in FP32 for the statistics)


def run_train_side(model_dir: Path, prompt: list[int]) -> TrainSide:
    from graphdiff.capture.hf import capture_hf

    cap, live = capture_hf(model_dir, input_ids=prompt)
    values = eager_values(live["graph_module"], live["inputs"])
    return TrainSide(cap, values, train_rounding(live["graph_module"], values), live["graph_module"])


def analyze(engine_cap: Capture, buffers: dict[str, Any], train: TrainSide, *, model: str, layers_total: int,
            config: dict, reproduce: str = "", notes: list[str] | None = None) -> ScanResult:
    """Everything after both sides have run: rounding, replay evidence, matching, sites, regions."""
    t0 = time.perf_counter()
    if len(engine_cap.graphs) != 1:
        notes = [*(notes or []), f"engine compiled {len(engine_cap.graphs)} graphs; sites are searched in each"]
    tgraph = train.capture.graphs[0]
    sites, replay, unmatched_k = [], [], []
    matched, unmatched_all = 0, set(n.name for n in tgraph.nodes)
    timings: dict[str, float] = {}
    engine_values: dict[str, Any] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(timings.get(name, 0.0) + now - since, 3)
        return now

    for egraph in engine_cap.graphs:
        t = time.perf_counter()
        er = engine_rounding(egraph, buffers)
        t = lap("replay_s", t)
        replay += [KernelEvidence(kernel=r.kernel, predicted_bitexact=round(r.predicted_bitexact, 6),
                                  naive_bitexact=round(r.naive_bitexact, 6), elements=r.elements,
                                  fp32_max_rel_error=r.fp32_max_rel_error, explicit_roundings=r.explicit,
                                  error=r.error) for r in er.replays]
        matches, unmatched = match_values(tgraph, train.values, egraph, er.values)
        t = lap("match_s", t)
        matched += len(matches)
        unmatched_all &= set(unmatched)
        sites += find_sites(tgraph, train.values, train.rounded, egraph, er, matches, unmatched)
        engine_values.update(er.values)
        lap("sites_s", t)
        used = {m.engine for m in matches}
        unmatched_k += [k.id for k in egraph.kernels if k.kind == "generated" and not (set(k.nodes) & used)]
    regions = group_regions(sites)
    t = time.perf_counter()
    uniformity = site_nonuniformity(tgraph, train.gm, train.values, sites, engine_values) if train.gm else {}
    lap("nonuniformity_s", t)
    layers_scanned = len({s.layer for s in sites if s.layer is not None}) or layers_total
    return ScanResult(
        model=model, architecture=engine_cap.architecture, config_sha256=config_sha256(config),
        versions={**train.capture.versions, **engine_cap.versions},
        layers_scanned=int(config.get("num_hidden_layers", layers_scanned)), layers_total=layers_total,
        prompt_tokens=engine_cap.prompt_tokens, sites=sites, regions=regions, replay=replay, matched=matched,
        unmatched_train=[n for n in (x.name for x in tgraph.nodes) if n in unmatched_all
                         and tgraph.node_map()[n].op == "call_function"][:500],
        unmatched_engine_kernels=unmatched_k, timings={"analysis_s": round(time.perf_counter() - t0, 3), **timings},
        reproduce=reproduce, notes=notes or [], nonuniformity=uniformity,
    )


def scan(spec: str, *, layers: int | None = None, tokens: int = 16, work_dir: Path | None = None,
         progress: Progress = lambda m: None, argv: list[str] | None = None) -> tuple[ScanResult, Any]:
    """Resolve `spec`, run the real engine and the HF trainer on the same weights and tokens, analyze."""
    from graphdiff.capture.vllm import capture_vllm
    from graphdiff.resolve import resolve_model
    from graphdiff.tiny import write_random_weights

    t_start = time.perf_counter()
    resolved = resolve_model(spec, work_dir=work_dir, layers=layers if layers is not None else DEFAULT_LAYERS)
    config = resolved.config
    total = int(config.get("num_hidden_layers", 0))
    notes = []
    if resolved.origin == "bundled" or resolved.origin == "hf-cache":
        notes.append(f"config from {resolved.origin}; decoder layers are identical, so {total} layer(s) are "
                     "scanned and regions are collapsed across them")
    if not resolved.has_weights:
        progress("writing seeded random weights (same on both sides; no download)")
        write_random_weights(resolved.path)
        notes.append("weights: seeded random (graphdiff.tiny.write_random_weights), identical on both sides")
    prompt = prompt_tokens(config, tokens)
    progress("starting the engine (compile)")
    run = capture_vllm(resolved.path, prompt, progress=progress)
    t_engine = time.perf_counter()
    progress("tracing the trainer's eager forward")
    train = run_train_side(resolved.path, prompt)
    t_train = time.perf_counter()
    progress("replaying kernels, matching values, finding sites")
    reproduce = "graphdiff " + shlex.join(argv) if argv else f"graphdiff scan {shlex.quote(spec)} --engine vllm"
    result = analyze(run.capture, run.buffers, train, model=spec, layers_total=_published_layers(spec, total),
                     config=config, reproduce=reproduce, notes=notes)
    result.timings.update(engine_startup_s=round(run.startup_s, 3), wall_s=round(time.perf_counter() - t_start, 3),
                          engine_total_s=round(t_engine - t_start, 3), train_s=round(t_train - t_engine, 3))
    run.train = train  # the caller may persist both captures beside the result
    if not result.sites and not result.replay:
        raise GraphdiffError("the engine graph had no generated kernels to compare (is compile disabled?)")
    return result, run


def _published_layers(spec: str, scanned: int) -> int:
    from graphdiff.resolve import _bundled_config

    cfg = _bundled_config(spec) if "/" in spec else None
    return int(cfg.get("num_hidden_layers", scanned)) if cfg else scanned
