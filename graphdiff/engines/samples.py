"""The prompts an engine samples or scores and the cache of its samples, whichever engine: seeded random prompts,
prompts read from a file, and OUT/engine_samples.json keyed by everything that decides the samples (the trainer side
re-runs without the engine)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from graphdiff.errors import GraphdiffError
from graphdiff.records import EngineMode, EngineSample, EngineSamples, EngineSamplesFile, save_json

SAMPLES_FILE = "engine_samples.json"


def random_prompts(config: dict, n: int, length: int = 16, seed: int = 0) -> list[list[int]]:
    """n seeded random prompts of `length` token ids within the vocabulary (0 avoided: often padding)."""
    if n < 1 or length < 1:
        raise GraphdiffError("--random and --prompt-tokens must be at least 1")
    vocab = int(config.get("vocab_size", 1000))
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=gen).tolist()


def read_prompts(path: Path, model_dir: Path, vocab: int) -> list[list[int]]:
    """One prompt per non-empty line: a JSON list of token ids, or text (a JSON string or a plain line),
    which is tokenized with the checkpoint's own tokenizer."""
    if not path.is_file():
        raise GraphdiffError(f"no prompts file at {path}")
    prompts, tokenizer = [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            item = line
        if isinstance(item, list) and all(isinstance(t, int) for t in item):
            ids = item
        elif isinstance(item, str):
            tokenizer = tokenizer or _tokenizer(model_dir)
            ids = tokenizer(item)["input_ids"]
            if not ids:  # transformers builds an empty tokenizer for a checkpoint without tokenizer files
                raise GraphdiffError(f"{path}:{n}: the tokenizer of {model_dir} gives no tokens for this text "
                                     "(no tokenizer files?); give token ids (a JSON list per line) instead")
        else:
            raise GraphdiffError(f"{path}:{n}: expected a JSON list of token ids or text")
        if not ids or not all(0 <= t < vocab for t in ids):
            raise GraphdiffError(f"{path}:{n}: token ids must be a non-empty list in [0, {vocab})")
        prompts.append(list(ids))
    if not prompts:
        raise GraphdiffError(f"{path} holds no prompts")
    return prompts


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise GraphdiffError(f"text prompts need a tokenizer in {model_dir} ({type(e).__name__}); "
                             "give token ids (one JSON list per line) instead") from None


def weights_fingerprint(model_dir: Path) -> str:
    """Names, sizes and mtimes of the checkpoint files: a cache of samples must not outlive new weights."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def samples_run(model_dir: Path, mode: EngineMode, prompts: Sequence[list[int]], *, max_tokens: int, seed: int,
                temperature: float, compilation_config: dict | None, versions: dict[str, str],
                samples: Sequence[EngineSample] | None = None, tensor_parallel_size: int = 1,
                engine: str = "vllm") -> EngineSamples:
    """One engine configuration's samples, keyed by everything that decides them (empty samples: what to look up)."""
    return EngineSamples(engine=engine, mode=mode, model=str(model_dir.resolve()),
                         weights=weights_fingerprint(model_dir), seed=seed,
                         temperature=temperature, max_tokens=max_tokens, versions=versions,
                         compilation_config=compilation_config or {} if mode == "compiled" else {},
                         tensor_parallel_size=tensor_parallel_size,
                         samples=list(samples) if samples is not None else
                         [EngineSample(prompt=list(p), tokens=[], logprobs=[]) for p in prompts])


def cached_run(out_dir: Path | None, want: EngineSamples) -> EngineSamples | None:
    """The run in OUT/engine_samples.json with `want`'s key, if one is there."""
    return next((r for r in read_cache(out_dir).runs if r.key() == want.key()), None)


def store_samples(out_dir: Path, run: EngineSamples) -> Path:
    """Add (or replace) one run in OUT/engine_samples.json, the cache every engine's `gap_samples` reads."""
    cache = read_cache(out_dir)
    cache.runs = [r for r in cache.runs if r.key() != run.key()] + [run]
    return save_json(cache, out_dir / SAMPLES_FILE)


def read_cache(out_dir: Path | None) -> EngineSamplesFile:
    """OUT/engine_samples.json, or an empty cache."""
    path = out_dir / SAMPLES_FILE if out_dir is not None else None
    if path is None or not path.exists():
        return EngineSamplesFile()
    try:
        return EngineSamplesFile.model_validate_json(path.read_text())
    except ValueError:
        return EngineSamplesFile()  # an unreadable cache is re-sampled, then overwritten
