"""MoE routing agreement on the gap's samples: the experts the trainer chooses for each token vs the engine's.

The engine's choices are recorded in its process (engines/vllm/capture.py `record_routing`: the top-k indices its router
kernels read while it scores each sample in one prefill). The trainer's are read while it scores the same tokens:
every top-k call is seen (a torch function mode) and attributed to the decoder layer whose forward is running;
per layer, of the top-ks whose k and input rows fit the engine's choices, the first over the widest input (the
experts) is the router's (a group-limited router first takes top-ks within and over groups, one of them the same k
at top-1 with one group kept; the patch's router splice may run the module's own forward once after its own
top-k). A flipped expert choice is a discrete jump in the log-prob, which no rounding alignment elsewhere
removes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode

from graphdiff.records import EngineSample, RoutingAgreement, layer_of


class _TopkRecorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.layer: int | None = None
        # layer -> (input rows, indices, input width) in call order
        self.calls: dict[int, list[tuple[int, torch.Tensor, int]]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in (torch.topk, torch.Tensor.topk) and self.layer is not None:
            x = args[0]
            width = x.shape[-1] if x.dim() else 1
            self.calls.setdefault(self.layer, []).append((x.numel() // max(width, 1), out[1].detach(), width))
        return out


@contextlib.contextmanager
def trainer_topk(model: torch.nn.Module) -> Iterator[_TopkRecorder]:
    """Every top-k call of `model`'s forwards while inside, by decoder layer (reset `calls` between forwards)."""
    rec = _TopkRecorder()
    hooks = []
    for name, module in model.named_modules():
        layer = layer_of(name)
        if layer is not None and name.rsplit(".", 1)[-1].isdigit():  # a decoder layer: `...layers.3`
            hooks.append(module.register_forward_pre_hook(lambda m, a, n=layer: setattr(rec, "layer", n)))
            hooks.append(module.register_forward_hook(lambda m, a, o: setattr(rec, "layer", None)))
    try:
        with rec:
            yield rec
    finally:
        for h in hooks:
            h.remove()


def differing(engine: dict[int, list[list[int]]], calls: dict[int, list[tuple[int, torch.Tensor, int]]]
              ) -> dict[int, tuple[int, int]]:
    """Per layer: (tokens compared, tokens whose set of chosen experts differs)."""
    out = {}
    for layer, chosen in engine.items():
        want = torch.tensor(chosen)
        fits = [(width, ids) for rows, ids, width in calls.get(layer, [])
                if rows == want.shape[0] and ids.shape[-1] == want.shape[-1]]
        if not fits:
            continue
        widest = max(width for width, _ in fits)
        ids = next(ids for width, ids in fits if width == widest)
        got = ids.reshape(-1, ids.shape[-1])
        diff = (got.sort(-1).values != want.to(got.dtype).sort(-1).values).any(-1)
        out[layer] = (int(want.shape[0]), int(diff.sum()))
    return out


def agreement(per_sample: Sequence[dict[int, tuple[int, int]]], label: str, trainer: str
              ) -> list[RoutingAgreement]:
    """Per layer, summed over the samples."""
    total: dict[int, list[int]] = {}
    for found in per_sample:
        for layer, (tokens, diff) in found.items():
            t = total.setdefault(layer, [0, 0])
            t[0] += tokens
            t[1] += diff
    return [RoutingAgreement(layer=layer, shape=label, tokens=t, differing=d, fraction=d / t if t else 0.0,
                             trainer=trainer) for layer, (t, d) in sorted(total.items())]


def has_routing(samples: Sequence[EngineSample]) -> bool:
    return any(s.routing for s in samples)


def label(samples: Sequence[EngineSample]) -> str:
    return f"{len(samples)} samples x {max((len(s.prompt) + len(s.tokens) for s in samples), default=0)} tokens"
