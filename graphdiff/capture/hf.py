"""Capture the trainer side: the ATen graph Hugging Face transformers runs eagerly.

The eager forward is traced with make_fx on real tensors and without a decomposition
table, so every node is an ATen op that eager itself dispatches (CompositeImplicit ops
such as linear or scaled_dot_product_attention decompose exactly as they do in eager),
and executing the graph reproduces the eager logits bit for bit. Parameters and buffers
are graph inputs (via functional_call), so each weight placeholder has its HF name.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast
from unittest import mock

import torch
import torch.fx
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx

import graphdiff
from graphdiff.capture.fx import graph_from_fx
from graphdiff.errors import GraphdiffError, first_line
from graphdiff.records import Capture

if TYPE_CHECKING:
    from transformers import PreTrainedModel

def load_hf_model(
    path: Path, dtype: torch.dtype = torch.bfloat16, attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """Load a local HF causal LM checkpoint in eval mode on CPU; never touches the hub."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = Path(path)
    if not path.is_dir():
        raise GraphdiffError(f"no model directory at {path}")
    if not (path / "config.json").is_file():
        raise GraphdiffError(f"{path} has no config.json; is it a Hugging Face checkpoint?")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise GraphdiffError(f"transformers cannot read {path / 'config.json'}: {first_line(e)}") from None
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # our own progress lines say what happens; the caller's setting back after
    try:
        # output_loading_info: a (model, loading info) pair, which transformers' annotations do not say
        model, info = cast(tuple["PreTrainedModel", dict[str, list[str]]], AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            output_loading_info=True,
        ))
    except Exception as e:
        raise GraphdiffError(f"transformers cannot load the model at {path}: {first_line(e)}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    # A checkpoint with missing tensors loads with random weights; a capture of that would be meaningless.
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        more = " ..." if len(missing) > 3 else ""
        raise GraphdiffError(f"{path} lacks weights for {', '.join(missing[:3])}{more}")
    return model.to("cpu").eval()  # type: ignore[arg-type]  # transformers' wrapper of `to` drops `self`


def _batch(input_ids: torch.Tensor | list[int]) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    return ids.unsqueeze(0) if ids.dim() == 1 else ids


def _graph_inputs(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
    """Names and tensors of the graph inputs, in placeholder order: parameters, buffers, input ids."""
    # remove_duplicate=True: a tied weight becomes one placeholder; functional_call re-ties it.
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return [*state, "input_ids"], [*state.values(), input_ids]


def trace_hf(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.fx.GraphModule, list[str]]:
    """Trace the eager BF16 forward to an ATen graph; returns it and the HF name of each placeholder."""
    input_ids = _batch(input_ids)
    names, tensors = _graph_inputs(model, input_ids)
    weight_names = names[:-1]

    def forward(*flat: torch.Tensor) -> torch.Tensor:
        state = dict(zip(weight_names, flat[:-1], strict=True))
        return torch.func.functional_call(model, state, (flat[-1],), {"use_cache": False}).logits

    # make_fx records nn_module_stack only relative to f._orig_mod (an attribute set on the function)
    forward._orig_mod = model  # type: ignore[attr-defined]
    tracer = make_fx(
        forward,
        tracing_mode="real",
        record_module_stack=True,
        record_stack_traces=True,
        # HF's mask code branches on tensor values (packed-sequence and all-ones checks); in real mode
        # the branch eager takes for this input is taken and its value burned in, as eager would.
        _error_on_data_dependent_ops=False,
    )
    # make_fx keeps only frames of functions named `forward`, which would attribute rotary, masking and
    # attention-interface ops to their callers; keep the whole stack and pick the frame ourselves.
    keep_all = mock.patch.object(proxy_tensor._ModuleStackTracer, "_filter_traceback_frames", lambda _, frames: frames)
    with torch.no_grad(), keep_all:
        gm = tracer(*tensors)
    # Drop what does not feed the logits (those value checks), so the graph is the logits' dataflow.
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, names


def run_graph(gm: torch.fx.GraphModule, model: torch.nn.Module, input_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """Execute a graph from trace_hf with the model's real parameters; returns the logits."""
    _, tensors = _graph_inputs(model, _batch(input_ids))
    with torch.no_grad():
        return gm(*tensors)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class Traced:
    """The trainer's eager forward as make_fx traced it: `graph_module(*inputs)` recomputes the logits."""

    graph_module: torch.fx.GraphModule
    model: torch.nn.Module
    inputs: list[torch.Tensor]  # the real tensors, in placeholder order
    input_names: dict[str, str]  # placeholder -> parameter name or input name


def capture_hf(
    model_path: Path, input_ids: list[int] | None = None, num_tokens: int = 16, seed: int = 0,
    manifest: Path | None = None, allow_version_mismatch: bool = False,
) -> tuple[Capture, Traced]:
    """Capture the HF eager graph of `model_path` on one prompt (patched first by `manifest`, if given:
    a scan of the patched trainer shows which one-sided roundings the patch leaves).

    Returns the Capture and the traced forward it was read from.
    """
    import transformers

    model = load_hf_model(Path(model_path))
    if manifest is not None:
        from graphdiff import runtime

        runtime.apply(model, manifest, allow_version_mismatch=allow_version_mismatch)
    # nn.Module's __getattr__ types every attribute as Tensor | Module
    vocab: int = model.get_input_embeddings().num_embeddings  # type: ignore[assignment]
    if input_ids is None:
        if num_tokens < 1:
            raise GraphdiffError(f"num_tokens must be at least 1, got {num_tokens}")
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab, (num_tokens,), generator=gen).tolist()
    if not input_ids or not all(0 <= t < vocab for t in input_ids):
        raise GraphdiffError(f"input ids must be a non-empty list of token ids in [0, {vocab})")
    ids = _batch(input_ids)
    gm, names = trace_hf(model, ids)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    input_names = dict(zip(placeholders, names, strict=True))
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    capture = Capture(
        side="train",
        engine="hf",
        model=str(model_path),
        architecture=architectures[0],
        dtype=str(model.dtype).removeprefix("torch."),
        versions={
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "graphdiff": graphdiff.__version__,
        },
        graphs=[graph_from_fx(gm, input_names, "forward")],
        prompt_tokens=list(input_ids),
    )
    _, tensors = _graph_inputs(model, ids)
    return capture, Traced(gm, model, list(tensors), input_names)
