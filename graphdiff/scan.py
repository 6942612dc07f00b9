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
from graphdiff.opaque import attention_sites
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
    fp32: dict[str, Any] | None = None  # each rounding node's FP32 result before it was rounded


def run_train_side(model_dir: Path, prompt: list[int], manifest: Path | None = None) -> TrainSide:
    from graphdiff.capture.hf import capture_hf

    cap, live = capture_hf(model_dir, input_ids=prompt, manifest=manifest)
    values = eager_values(live["graph_module"], live["inputs"])
    fp32: dict[str, Any] = {}
    rounded = train_rounding(live["graph_module"], values, fp32)
    return TrainSide(cap, values, rounded, live["graph_module"], fp32)


def _scanned_config(config: dict) -> dict:
    """What the patch's runtime compares a trainer's config with (transformers-normalized, run settings out)."""
    from transformers import AutoConfig

    from graphdiff.runtime import scanned_config

    rest = dict(config)
    return scanned_config(AutoConfig.for_model(rest.pop("model_type"), **rest))


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
    t = time.perf_counter()
    attn_sites, attn_notes = attention_sites(engine_cap.attention, tgraph, train.gm, train.values,
                                             engine_cap.graphs)
    sites += attn_sites
    notes = [*(notes or []), *attn_notes]
    lap("attention_s", t)
    regions = group_regions(sites)
    t = time.perf_counter()
    uniformity = (site_nonuniformity(tgraph, train.gm, train.values, sites, engine_values, train.fp32)
                  if train.gm else {})
    lap("nonuniformity_s", t)
    layers_scanned = len({s.layer for s in sites if s.layer is not None}) or layers_total
    return ScanResult(
        model=model, architecture=engine_cap.architecture, config_sha256=config_sha256(config),
        config=_scanned_config(config),
        versions={**train.capture.versions, **engine_cap.versions},
        layers_scanned=int(config.get("num_hidden_layers", layers_scanned)), layers_total=layers_total,
        prompt_tokens=engine_cap.prompt_tokens, sites=sites, regions=regions, replay=replay, matched=matched,
        unmatched_train=[n for n in (x.name for x in tgraph.nodes) if n in unmatched_all
                         and tgraph.node_map()[n].op == "call_function"][:500],
        unmatched_engine_kernels=unmatched_k, timings={"analysis_s": round(time.perf_counter() - t0, 3), **timings},
        reproduce=reproduce, notes=notes or [], nonuniformity=uniformity,
    )


def prepare_model(spec: str, layers: int | None, work_dir: Path | None, progress: Progress) -> tuple[Any, list[str]]:
    """Resolve a model spec to a checkpoint dir both sides can load (seeded weights if it has none)."""
    from graphdiff.resolve import resolve_model
    from graphdiff.tiny import write_random_weights

    resolved = resolve_model(spec, work_dir=work_dir, layers=layers if layers is not None else DEFAULT_LAYERS)
    total = int(resolved.config.get("num_hidden_layers", 0))
    notes = []
    if resolved.origin == "bundled" or resolved.origin == "hf-cache":
        notes.append(f"config from {resolved.origin}; decoder layers are identical, so {total} layer(s) are "
                     "scanned and regions are collapsed across them")
    if not resolved.has_weights:
        progress("writing seeded random weights (same on both sides; no download)")
        write_random_weights(resolved.path)
        notes.append("weights: seeded random (graphdiff.tiny.write_random_weights), identical on both sides")
    return resolved, notes


def load_engine_capture(directory: Path) -> tuple[Capture, dict[str, Any]]:
    """An engine capture with real kernel buffers, made elsewhere by `graphdiff capture --engine vllm`."""
    from graphdiff.model import load_capture

    if not (directory / "capture.json").exists():
        if directory.exists() and any(directory.rglob("output_code.py")):
            raise GraphdiffError(
                f"{directory} is a TORCH_COMPILE_DEBUG dump without recorded kernel buffers, which the scan "
                "replays; on the engine machine run `graphdiff capture MODEL --engine vllm --out DIR` and pass DIR")
        raise GraphdiffError(f"{directory} holds no engine capture (capture.json from `graphdiff capture`)")
    cap = load_capture(directory / "capture.json")
    if cap.side != "engine" or not cap.buffers_file or not (directory / cap.buffers_file).exists():
        raise GraphdiffError(f"{directory / 'capture.json'} is not an engine capture with recorded buffers")
    try:
        buffers = torch.load(directory / cap.buffers_file, weights_only=False)
    except Exception as e:
        raise GraphdiffError(f"cannot read {directory / cap.buffers_file}: {type(e).__name__}") from None
    return cap, buffers


def check_same_weights(engine_cap: Capture, buffers: dict[str, Any], train: TrainSide) -> None:
    """Both sides must have run the same weights: compare every weight a kernel recorded."""
    train_inputs = train.capture.graphs[0].inputs
    by_name = {name: train.values.get(node) for node, name in train_inputs.items()}
    for g in engine_cap.graphs:
        for rec in (buffers.get(k.id) for k in g.kernels):
            for buf, t in (rec or {}).get("in", {}).items():
                name = g.inputs.get(buf, "")
                ref = by_name.get(name) if "." in name else None  # weights only, not the token ids
                if isinstance(ref, torch.Tensor) and isinstance(t, torch.Tensor) and not torch.equal(ref, t):
                    raise GraphdiffError(f"the engine capture ran other weights than {train.capture.model} "
                                         f"({name} differs); scan the checkpoint the engine ran")


def scan(spec: str, *, layers: int | None = None, tokens: int = 16, work_dir: Path | None = None,
         progress: Progress = lambda m: None, argv: list[str] | None = None,
         engine_dump: Path | None = None, manifest: Path | None = None) -> tuple[ScanResult, Any]:
    """Resolve `spec`, run the real engine (or take its capture from `engine_dump`) and the HF trainer
    on the same weights and tokens, analyze."""
    from graphdiff.capture.vllm import EngineRun, capture_vllm

    t_start = time.perf_counter()
    resolved, notes = prepare_model(spec, layers, work_dir, progress)
    config = resolved.config
    total = int(config.get("num_hidden_layers", 0))
    if engine_dump is not None:
        cap, buffers = load_engine_capture(engine_dump)
        if cap.config_sha256 and cap.config_sha256 != config_sha256(config):
            raise GraphdiffError(f"{engine_dump} was captured from another model config than {spec} "
                                 f"(layers, sizes or architecture differ)")
        run = EngineRun(llm=None, capture=cap, buffers=buffers, startup_s=0.0)
        prompt = cap.prompt_tokens
        notes.append(f"engine side from {engine_dump} (captured with {cap.versions.get('vllm', '?')}); "
                     "the engine was not started")
    else:
        prompt = prompt_tokens(config, tokens)
        progress("starting the engine (compile)")
        run = capture_vllm(resolved.path, prompt, progress=progress)
        run.capture.config_sha256 = config_sha256(config)
    t_engine = time.perf_counter()
    progress("tracing the trainer's eager forward")
    train = run_train_side(resolved.path, prompt, manifest)
    if manifest is not None:
        notes.append(f"trainer side patched with {manifest}: the sites are what the patch leaves")
    if engine_dump is not None:
        check_same_weights(run.capture, run.buffers, train)
    t_train = time.perf_counter()
    progress("replaying kernels, matching values, finding sites")
    reproduce = "graphdiff " + shlex.join(argv) if argv else f"graphdiff scan {shlex.quote(spec)} --engine vllm"
    result = analyze(run.capture, run.buffers, train, model=spec, layers_total=_published_layers(spec, total),
                     config=config, reproduce=reproduce, notes=notes)
    result.timings.update(engine_startup_s=round(run.startup_s, 3), wall_s=round(time.perf_counter() - t_start, 3),
                          engine_total_s=round(t_engine - t_start, 3), train_s=round(t_train - t_engine, 3))
    run.train = train  # the caller may persist both captures beside the result
    run.model_dir = resolved.path
    if not result.sites and not result.replay:
        raise GraphdiffError("the engine graph had no generated kernels to compare (is compile disabled?)")
    return result, run


def _published_layers(spec: str, scanned: int) -> int:
    from graphdiff.resolve import bundled_config

    cfg = bundled_config(spec) if "/" in spec else None
    return int(cfg.get("num_hidden_layers", scanned)) if cfg else scanned
