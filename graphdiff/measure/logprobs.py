"""Log-probs of sampled sequences on both sides, and their per-token difference (shared by kl, gate and the
engine-attention diagnostic).

The trainer recomputes the engine's tokens: `train_logprobs(model, sequences)`, one teacher-forced HF forward per
sequence over prompt + continuation (batch 1, no padding, no KV cache), `log_softmax(-1, dtype=float32)` of its BF16
logits (the engine sampler's own formula), gathered at the sampled tokens.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from graphdiff import runtime
from graphdiff.records import EngineSample, TrainerMode


class Scored(Protocol):
    prompt: list[int]
    tokens: list[int]


def apply_manifest(model: torch.nn.Module, manifest: Path, regions: Sequence[str] | None = None) -> torch.nn.Module:
    """The model with the manifest's patches (all, or `regions`) applied by the training runtime, in place."""
    return runtime.apply(model, manifest, regions=list(regions) if regions is not None else None)


@contextlib.contextmanager
def trainer(base: torch.nn.Module, mode: TrainerMode = "eager", manifest: Path | None = None,
            regions: Sequence[str] | None = None) -> Iterator[Callable[..., Any]]:
    """The HF model as the trainer runs it: BF16, eager or torch.compile'd, optionally patched.

    Patches go on a copy of `base`, before compile (the compiled graph must contain them, as in training), and
    come off on exit; the runtime dispatches per model, so `base` itself stays unpatched meanwhile.
    """
    model = apply_manifest(copy.deepcopy(base), manifest, regions) if manifest is not None else base
    try:
        yield torch.compile(model, backend="inductor") if mode == "compiled" else model
    finally:
        if manifest is not None:
            runtime.remove(model)


@torch.no_grad()
def train_logprobs(model: Callable[..., Any], sequences: Iterable[Scored]) -> list[torch.Tensor]:
    """FP32 log-probs the trainer assigns to each sequence's continuation tokens (one tensor per sequence)."""
    result = []
    for s in sequences:
        if not s.tokens:
            result.append(torch.zeros(0))
            continue
        ids = torch.tensor([list(s.prompt) + list(s.tokens)])
        logits = model(input_ids=ids, use_cache=False).logits[0]
        # Position j predicts token j+1: the continuation's logits start at the last prompt position.
        lp = logits[len(s.prompt) - 1: -1].log_softmax(-1, dtype=torch.float32)
        result.append(lp.gather(-1, torch.tensor(s.tokens)[:, None])[:, 0])
    return result


def engine_logprobs(samples: Sequence[EngineSample], prefill: bool = False) -> list[torch.Tensor]:
    """The engine's log-probs of its samples: as it decoded them, or (`prefill`) as it scores them in one prefill."""
    return [torch.tensor(s.prefill_logprobs if prefill else s.logprobs, dtype=torch.float32) for s in samples]


def per_token(engine: Sequence[torch.Tensor], train: Sequence[torch.Tensor], metric: str = "k1") -> list[torch.Tensor]:
    """Per-token diff (k1) or exp(r) - 1 - r with r = -diff (k3), float64; expm1 keeps tiny r exact."""
    if len(engine) != len(train):
        raise ValueError(f"{len(engine)} engine sequences vs {len(train)} trainer sequences")
    out = []
    for e, t in zip(engine, train):
        if e.shape != t.shape:
            raise ValueError(f"log-prob lengths differ: engine {tuple(e.shape)} vs trainer {tuple(t.shape)}")
        d = e.double() - t.double()
        out.append(d if metric == "k1" else torch.expm1(-d) + d)
    return out
