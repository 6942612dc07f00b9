"""How much of the patched gap is attention's accumulation order: the patched trainer with the engine's own
attention op in place of its sdpa.

The patch makes the trainer's attention round where the engine's does (FP32 inside, the output rounded once),
but the two kernels still sum in different orders, and that difference grows with the number of keys. Running
the patched trainer once more with vLLM's CPU attention kernel (`cpu_attention_with_kv_cache` on the BF16 q/k/v,
every query of the sequence at once, as the engine's prefill) measures that part instead of guessing it: the
gap that goes away is the attention order's (`kl.json` `sources`).

vLLM is imported only in a child process (graphdiff.child): the trainer's process never loads it. Needs vLLM's
CPU build (its `cpu_attention_with_kv_cache` op); elsewhere the diagnostic is reported as unavailable.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from graphdiff import child
from graphdiff.errors import GraphdiffError
from graphdiff.records import EngineSample, Progress

NAME = "graphdiff_engine_attention"


def unsupported(module: torch.nn.Module) -> str:
    """Why this attention layer cannot run on the engine's op here ("" if it can)."""
    if not getattr(module, "is_causal", True):
        return "non-causal attention"
    return ""


def engine_attention_fn() -> Callable[..., tuple[torch.Tensor, None]]:
    """A transformers attention function computing as vLLM's CPU attention op does (batch 1, causal)."""
    from graphdiff.codegen.attention_splice import layer_window, vllm_cpu_attention

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, softcap: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        why = unsupported(module) or ("batched input" if query.shape[0] != 1 else "")
        if why:
            raise GraphdiffError(f"the engine's attention op cannot stand in here: {why}")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        window = layer_window(module, kwargs)  # a sliding layer's window, as the engine's op takes it
        return vllm_cpu_attention(query, key, value, scale, float(softcap or 0.0),
                                  sliding_window=window).to(query.dtype), None

    return attention


def _use_engine_attention(model: torch.nn.Module, manifest: Path) -> Callable[[], None]:
    """The model's attention layers on the engine's op; returns the undo (transformers' registry and the model's
    attention implementation back). Attention modules whose own code calls torch's sdpa (the manifest's attention
    splice says so: FalconAttention, which takes its eager path for any other implementation) get that call swapped."""
    import functools

    from graphdiff import runtime
    from graphdiff.codegen.attention_splice import sdpa_call
    from graphdiff.runtime.attention import use_attention

    own = [s for s in runtime.load_manifest(manifest).splices if s.target == "attention"
           and s.function == runtime.TORCH_SDPA]
    if not own:
        return use_attention(model, NAME, engine_attention_fn())
    patterns = [(runtime.module_regex(s.module), s.module_class) for s in own]
    modules = [m for n, m in model.named_modules() if any(rx.match(n) and type(m).__name__ == c for rx, c in patterns)]
    return runtime.sdpa_calls(modules, lambda mod: functools.partial(sdpa_call, engine_attention_fn(), mod))


def _child(req: dict, progress: Progress) -> None:
    from graphdiff import runtime
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.measure.logprobs import train_logprobs

    model = runtime.apply(load_hf_model(Path(req["model_dir"])), Path(req["manifest"]), regions=req["regions"])
    layers = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "scaling")]
    why = next((w for m in layers if (w := unsupported(m))), "")
    if why:
        raise GraphdiffError(f"the engine's attention op cannot stand in for this model's: {why}")
    restore = _use_engine_attention(model, Path(req["manifest"]))
    samples = [EngineSample.model_validate(s) for s in json.loads(Path(req["samples"]).read_text())]
    progress(f"patched trainer with the engine's attention op: {len(samples)} sequences")
    try:
        lps = train_logprobs(model, samples)
    finally:
        restore()
    Path(req["result"]).write_text(json.dumps([lp.tolist() for lp in lps]))


def patched_logprobs(model_dir: Path, manifest: Path, regions: Sequence[str], samples: Sequence[EngineSample],
                     progress: Progress = lambda m: None) -> list[torch.Tensor]:
    """The patched trainer's log-probs of `samples` with the engine's attention op, in a child process.
    Raises GraphdiffError (one line) where the op is unavailable or cannot stand in."""
    with tempfile.TemporaryDirectory(prefix="graphdiff-attn-") as tmp:
        path, result = Path(tmp) / "samples.json", Path(tmp) / "logprobs.json"
        path.write_text(json.dumps([s.model_dump() for s in samples]))
        child.run("graphdiff.measure.engine_attention",
                  dict(model_dir=str(model_dir), manifest=str(manifest), regions=list(regions), samples=str(path),
                       result=str(result)), progress)
        return [torch.tensor(x, dtype=torch.float32) for x in json.loads(result.read_text())]


if __name__ == "__main__":
    sys.exit(child.serve(_child))
