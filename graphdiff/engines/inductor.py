"""`torch.compile` (Inductor, default mode) of the trainer's own HF model behind the engine interface, on the CPU
(C++ kernels) or a CUDA GPU (Triton kernels; `--device cuda`, refused in one line where torch sees no GPU).

The engine is the model the trainer loads (`capture.hf.load_hf_model`), compiled with `dynamic=True` (one program
for every token count, as vLLM compiles its model) under graphdiff's Inductor hooks (`capture.inductor_hooks`):
the post-grad graph, the kernel partition and the compiled wrapper, turned into `Graph`s as the vLLM capture does
(`capture.assemble.build_graph`). Every generated kernel is then wrapped by a `BufferRecorder` and each asked prefill
shape runs once, so the scan replays every kernel on real buffers at every shape. A compiled model has no sampler and
no KV cache: decode shapes are refused, and the gap is measured on teacher-forced sequences (`score`: the compiled
model's log-probs of given tokens, one forward per sequence).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphdiff import child
from graphdiff.capture.assemble import build_graph
from graphdiff.capture.engine_model import input_names, is_model_graph, logits_weight, unique_kernel_ids
from graphdiff.capture.inductor_code import parse_kernel_calls, parse_kernel_defs
from graphdiff.capture.inductor_hooks import BufferRecorder, Compiled, inductor_hooks, weight_inputs
from graphdiff.engines.base import EngineOptions
from graphdiff.engines.samples import cached_run, samples_run, store_samples
from graphdiff.engines.store import load_engine_capture, save_engine_capture
from graphdiff.errors import GraphdiffError
from graphdiff.records import (
    Buffers,
    Capture,
    EngineMode,
    EngineSample,
    EngineSamples,
    Graph,
    KernelRecord,
    Progress,
    SampleRequest,
    Shape,
)

NAME = "inductor"
MODES: tuple[EngineMode, ...] = ("compiled",)  # no eager engine: the eager model is the trainer
PREFILL_ONLY = True  # no KV cache to decode with
PROBES_FLOOR = False  # no decode, so no floor (0 by definition)
GAP_METHOD = (  # no sampler: teacher-forced
    "engine: the HF model under torch.compile (Inductor, default mode, dynamic shapes, CPU) scores seeded random "
    "continuations (seed {seed}+i per prompt) teacher-forced, one forward per sequence over prompt+continuation, "
    "log_softmax(BF16 logits, dtype=float32) at each continuation token; trainer: the same model eager, the same "
    "forward; diff = logp_engine - logp_train in float64 of the FP32 values; floor: none (no decode: 0 by definition)"
)


def check_shapes(shapes: Sequence[Shape]) -> None:
    """Refuse, before anything compiles, a shape the compiled model cannot run: it has no KV cache to decode with."""
    decode = [s.label for s in shapes if s.phase != "prefill"]
    if decode:
        raise GraphdiffError(f"--engine inductor records prefills only (a compiled HF model has no KV cache to decode "
                             f"with): leave out {', '.join(decode)} (e.g. --shapes 16,512)")


DEVICES = ("cpu", "cuda")


def check_device(device: str) -> None:
    """Refuse, in one line before anything starts, a device the engine cannot run on here: cpu or cuda (a CUDA GPU
    torch sees)."""
    if device not in DEVICES:
        raise GraphdiffError(f"--device {device}: choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise GraphdiffError("--device cuda: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is "
                             "False); use --device cpu")


def check_options(options: EngineOptions) -> None:
    """Refuse vLLM's options: the compiled model is Inductor's default mode in one process, on cpu or cuda."""
    check_device(options.device)
    if options.compilation_config or options.optimization_level is not None or options.tensor_parallel_size > 1:
        raise GraphdiffError("--engine inductor compiles with Inductor's default mode: --compilation-config, -O and "
                             "--tensor-parallel-size are vLLM's options")
    if options.debug_dir is not None:
        raise GraphdiffError("--keep-dump is not supported with --engine inductor yet")


def check(options: EngineOptions, shapes: Sequence[Shape] | None = None, capture: bool = False) -> None:
    """The options and shapes refused before anything starts (`capture` changes nothing: it compiles either way)."""
    check_options(options)
    check_shapes(shapes or [])


def versions() -> dict[str, str]:
    """The versions that decide what the compiled model computes."""
    import transformers

    import graphdiff

    return {"torch": torch.__version__, "transformers": transformers.__version__, "graphdiff": graphdiff.__version__}


def _logits(compiled: Any, tokens: Sequence[int], device: str = "cpu") -> torch.Tensor:
    """The compiled model's logits of one sequence ([tokens, vocab], as the model returns them), back on the CPU."""
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    with torch.no_grad():
        return compiled(input_ids=ids, use_cache=False).logits[0].cpu()


@dataclass
class Compilation:
    """The model compiled under the hooks: its graphs, a recorder on each, which compilations were taken in."""

    model: torch.nn.Module
    compiled: Any
    hooks: Any
    graphs: list[Graph] = field(default_factory=list)
    recorders: list[BufferRecorder] = field(default_factory=list)
    seen: int = 0  # compilations taken into `graphs` (a recompile at a later shape adds graphs)
    device: str = "cpu"

    def take_new(self) -> int:
        """Graphs and recorders for the compilations made since the last call; returns how many graphs it added."""
        added = 0
        fresh: list[Compiled] = self.hooks.compiled[self.seen:]
        self.seen = len(self.hooks.compiled)
        for comp in fresh:
            if comp.module is None:
                continue
            names, root = input_names(comp.placeholders, self.model)
            if not is_model_graph(names):
                continue
            graph = build_graph(comp, names, root, len(self.graphs))
            ids = unique_kernel_ids(graph, len(self.graphs))
            src = Path(comp.module.__file__ or "").read_text()
            defs = parse_kernel_defs(src)
            self.recorders.append(BufferRecorder(comp.module, parse_kernel_calls(src, defs), defs,
                                                 weight_inputs(graph), ids))
            self.graphs.append(graph)
            added += 1
        return added


def _record_shape(comp: Compilation, shape: Shape, progress: Progress) -> tuple[dict[str, KernelRecord], list[str]]:
    """One armed forward of the shape's prompt; a forward that compiled anew (Dynamo specialised a size) runs again
    with the new graphs' recorders armed too."""
    records: dict[str, KernelRecord] = {}
    notes: list[str] = []
    for _ in range(2):
        for r in comp.recorders:
            r.reset()
            r.armed = True
        _logits(comp.compiled, shape.prompts[0], comp.device)
        for r in comp.recorders:
            r.armed = False
        if comp.take_new() == 0:
            break
        progress(f"the compiled model recompiled at {shape.label}: recording it again")
    for graph, r in zip(comp.graphs, comp.recorders):
        if r.forwards:
            records.update(r.forwards[0])
            graph.shapes.append(shape.label)
        else:
            notes.append(f"{graph.name} did not run at {shape.label}: its kernels are not replayed there")
        r.reset()
    return records, notes


def teacher_forced(config: dict, prompts: Sequence[list[int]], max_tokens: int, seed: int = 0) -> list[EngineSample]:
    """The sequences the gap is measured on without a sampler: each prompt continued by `max_tokens` seeded random
    token ids within the vocabulary (sequence i seeded with seed + i), their log-probs still to score."""
    vocab = int(config.get("vocab_size", 1000))
    out = []
    for i, p in enumerate(prompts):
        gen = torch.Generator().manual_seed(seed + i)
        out.append(EngineSample(prompt=list(p), tokens=torch.randint(1, vocab, (max_tokens,), generator=gen).tolist(),
                                logprobs=[]))
    return out


def score_compiled(compiled: Any, samples: Sequence[EngineSample], device: str = "cpu") -> None:
    """The compiled model's FP32 log-softmax of its BF16 logits (as vLLM's raw log-probs) at each continuation token,
    all in one forward of prompt + continuation, into `prefill_logprobs` and `logprobs`."""
    with fresh_state():
        for s in samples:
            seq = list(s.prompt) + list(s.tokens)
            logp = torch.log_softmax(_logits(compiled, seq, device).float(), dim=-1)
            at = torch.arange(len(s.prompt) - 1, len(seq) - 1)
            got = logp[at, torch.tensor(s.tokens, dtype=torch.long)].tolist()
            s.prefill_logprobs = list(got)
            s.logprobs = list(got)


@dataclass
class InductorEngine:
    """The compiled HF model with its capture (the `Engine` interface)."""

    capture: Capture
    buffers: Buffers
    startup_s: float
    compiled: Any
    recorders: list[BufferRecorder]
    name: str = NAME
    device: str = "cpu"

    def sample(self, prompts: Sequence[list[int]], *, max_tokens: int, seed: int = 0,
               temperature: float = 1.0) -> list[EngineSample]:
        raise GraphdiffError("--engine inductor does not sample (a compiled HF model has no sampler): its gap is "
                             "measured on teacher-forced sequences (score)")

    def score(self, samples: Sequence[EngineSample]) -> None:
        """Each sample's continuation tokens scored by the compiled model in one forward of prompt + tokens, into
        `prefill_logprobs` (and `logprobs`, which teacher forcing makes the same)."""
        score_compiled(self.compiled, samples, self.device)

    def record_routing(self, samples: Sequence[EngineSample], progress: Progress = lambda m: None) -> None:
        return None  # MoE routing is read from a vLLM engine's router kernels; not recorded here yet

    def stop(self) -> None:
        for r in self.recorders:
            r.remove()
        self.recorders = []
        torch._dynamo.reset()


@contextlib.contextmanager
def fresh_state() -> Iterator[None]:
    """Inductor's caches off while the compiled model runs again (a recompile must not be served from disk)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(force_disable_caches=True):
        yield


def start(model_dir: Path, shapes: list[Shape], options: EngineOptions, progress: Progress) -> InductorEngine:
    """The HF model at `model_dir` compiled by Inductor on `options.device`, its kernels recorded at every (prefill)
    shape."""
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.models.resolve import architecture, read_config

    check_shapes(shapes)
    check_options(options)
    config = read_config(model_dir)
    progress(f"loading {model_dir.name} and compiling it with Inductor (torch.compile, dynamic shapes)")
    t0 = time.perf_counter()
    model = load_hf_model(model_dir).to(options.device)  # type: ignore[arg-type]  # transformers wraps `to`
    buffers: Buffers = {}
    notes: list[str] = []
    with fresh_state(), inductor_hooks() as hooks:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="inductor", dynamic=True)
        comp = Compilation(model, compiled, hooks, device=options.device)
        _logits(compiled, shapes[0].prompts[0], options.device)  # compiles
        startup = time.perf_counter() - t0
        progress(f"compiled in {startup:.1f}s")
        if comp.take_new() == 0:
            raise GraphdiffError("torch.compile compiled no model graph (was it a cache hit?)")
        for shape in shapes:
            progress(f"recording the compiled model's kernel buffers at {shape.label}")
            buffers[shape.label], more = _record_shape(comp, shape, progress)
            notes += more
    cap = Capture(side="engine", engine=NAME, model=str(model_dir), architecture=architecture(config),
                  versions=versions(), graphs=comp.graphs, prompt_tokens=list(shapes[0].prompts[0]), shapes=shapes,
                  engine_config={"engine": NAME, "backend": "inductor", "mode": "default", "dynamic": True,
                                 "device": options.device},
                  notes=notes, logits_weight=logits_weight(model))
    return InductorEngine(cap, buffers, startup, compiled, comp.recorders, device=options.device)


def capture_isolated(model_dir: Path, shapes: list[Shape], directory: Path, options: EngineOptions, *,
                     progress: Progress = lambda m: None, config_sha256: str = "",
                     sample: SampleRequest | None = None) -> tuple[Capture, Buffers, float]:
    """The compiled model's capture made in a child process (`python -m graphdiff.engines.inductor`), written into
    `directory` as `graphdiff capture --engine inductor` writes it, and read back: Dynamo's and Inductor's state
    stays in the child, and the trainer runs in a process no compile touched. `sample`: the same compiled model then
    scores teacher-forced sequences of those prompts into out_dir/engine_samples.json (what the gate and the gap read).
    Returns the capture, its buffers and the compile time."""
    check_shapes(shapes)
    child.run("graphdiff.engines.inductor", dict(model_dir=str(model_dir), shapes=[s.model_dump() for s in shapes],
                                                 out=str(directory), config_sha256=config_sha256,
                                                 device=options.device,
                                                 sample=sample.model_dump() if sample is not None else None), progress)
    cap, buffers = load_engine_capture(directory, model_dir)
    return cap, buffers, cap.startup_s or 0.0


def scored_isolated(model_dir: Path, prompts: Sequence[list[int]], max_tokens: int, seed: int,
                    progress: Progress = lambda m: None, device: str = "cpu") -> list[EngineSample]:
    """Teacher-forced sequences of `prompts` scored by the compiled model in a child process (no capture)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="graphdiff-inductor-") as tmp:
        result = Path(tmp) / "samples.json"
        child.run("graphdiff.engines.inductor", dict(model_dir=str(model_dir), prompts=[list(p) for p in prompts],
                                                     max_tokens=max_tokens, seed=seed, result=str(result),
                                                     device=device), progress)
        return [EngineSample.model_validate(s) for s in json.loads(result.read_text())]


def _serve(req: dict, progress: Progress) -> None:
    """The child's side of `capture_isolated` (a capture, then maybe teacher-forced scores) and `scored_isolated`."""
    import json

    model_dir = Path(req["model_dir"])
    device = req.get("device", "cpu")
    if "result" in req:  # scores only
        samples = _score_fresh(model_dir, req["prompts"], req["max_tokens"], req["seed"], progress, device)
        Path(req["result"]).write_text(json.dumps([s.model_dump() for s in samples]))
        return
    engine = start(model_dir, [Shape.model_validate(s) for s in req["shapes"]], EngineOptions(device=device), progress)
    try:
        engine.capture.config_sha256 = req["config_sha256"]
        engine.capture.startup_s = round(engine.startup_s, 3)
        save_engine_capture(engine.capture, engine.buffers, Path(req["out"]))
        if req.get("sample"):
            s = SampleRequest.model_validate(req["sample"])
            _store(model_dir, s, _scored(engine.compiled, model_dir, s.prompts, s.max_tokens, s.seed, progress,
                                         device), device)
    finally:
        engine.stop()


def _scored(compiled: Any, model_dir: Path, prompts: Sequence[list[int]], max_tokens: int, seed: int,
            progress: Progress, device: str = "cpu") -> list[EngineSample]:
    from graphdiff.models.resolve import read_config

    progress(f"scoring {len(prompts)} teacher-forced sequences of {max_tokens} tokens on the compiled model (the gap)")
    samples = teacher_forced(read_config(model_dir), prompts, max_tokens, seed)
    score_compiled(compiled, samples, device)
    return samples


def _score_fresh(model_dir: Path, prompts: Sequence[list[int]], max_tokens: int, seed: int,
                 progress: Progress, device: str = "cpu") -> list[EngineSample]:
    """The model compiled afresh (no hooks) and its teacher-forced scores."""
    from graphdiff.capture.hf import load_hf_model

    progress(f"loading {model_dir.name} and compiling it with Inductor (torch.compile, dynamic shapes)")
    torch._dynamo.reset()
    with fresh_state():
        model = load_hf_model(model_dir).to(device)  # type: ignore[arg-type]  # transformers wraps `to`
        compiled = torch.compile(model, backend="inductor", dynamic=True)
        samples = _scored(compiled, model_dir, prompts, max_tokens, seed, progress, device)
    torch._dynamo.reset()
    return samples


def engine_samples(model_dir: Path, prompts: Sequence[list[int]], *, max_tokens: int, seed: int = 0,
                   temperature: float = 1.0, out_dir: Path | None = None,
                   progress: Progress = lambda m: None, device: str = "cpu") -> EngineSamples:
    """The compiled model's teacher-forced scores of `prompts` continued by `max_tokens` seeded tokens, as the gate
    and the gap read them: from OUT/engine_samples.json when there (the scan's capture scored them), else scored in a
    child process and stored there."""
    want = samples_run(model_dir, "compiled", prompts, max_tokens=max_tokens, seed=seed, temperature=temperature,
                       compilation_config=_device_key(device), versions=versions(), engine=NAME)
    hit = cached_run(out_dir, want)
    if hit is not None:
        progress(f"engine inductor: {len(hit.samples)} cached teacher-forced sequences from {out_dir}")
        return hit
    want.samples = scored_isolated(model_dir, prompts, max_tokens, seed, progress, device)
    if out_dir is not None:
        store_samples(out_dir, want)
    return want


def gap_samples(model_dir: Path, prompts: Sequence[list[int]], modes: Sequence[EngineMode], options: EngineOptions,
                *, max_tokens: int, seed: int = 0, temperature: float = 1.0, out_dir: Path | None = None,
                isolate: bool = True, progress: Progress = lambda m: None) -> dict[EngineMode, EngineSamples]:
    """The compiled model's teacher-forced scores as its one mode's samples (always in a child process)."""
    if list(modes) != ["compiled"]:
        raise GraphdiffError("--engine inductor has one mode, compiled: --modes is vLLM's")
    return {"compiled": engine_samples(model_dir, prompts, max_tokens=max_tokens, seed=seed, temperature=temperature,
                                       out_dir=out_dir, progress=progress, device=options.device)}


def _device_key(device: str) -> dict:
    """The cached scores' key part for the device: none on the CPU (the key scores made before `--device` had)."""
    return {} if device == "cpu" else {"device": device}


def _store(model_dir: Path, s: SampleRequest, samples: list[EngineSample], device: str = "cpu") -> None:
    """The scores into out_dir/engine_samples.json, keyed as `engine_samples` looks them up."""
    store_samples(Path(s.out_dir), samples_run(model_dir, "compiled", s.prompts, max_tokens=s.max_tokens, seed=s.seed,
                                               temperature=s.temperature, compilation_config=_device_key(device),
                                               versions=versions(),
                                               samples=samples, engine=NAME))


if __name__ == "__main__":
    sys.exit(child.serve(_serve))
