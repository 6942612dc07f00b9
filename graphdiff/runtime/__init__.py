"""Apply a graphdiff patch (manifest.json + generated module) to a Hugging Face model, in place.

    from graphdiff import runtime
    runtime.apply(model, "patches/manifest.json")             # before FSDP/DDP wrapping
    runtime.apply(model, "patches/manifest.json", regions=["model.layers.*.self_attn"])  # ablation
    runtime.remove(model)

This module is the face; the runtime reads one part at a time:
- `apply`: apply / remove / active_regions (how each kind of splice is spliced in, the memory rule, torch.compile);
- `manifest`: the manifest and generated module read and checked against the model and versions;
- `targets`: the patcher of each splice target, and the rounding of every nn.Linear / nn.LayerNorm input;
- `carry`: the carry splice's hooks (the residual stream in FP32);
- `dispatch`: how a generated function is called (Triton or PyTorch, a module's forward, a function's dispatcher);
- `memory`: FP32 outputs saved as recipes and recomputed in the backward;
- `layers`: which modules (and layers of a layer group) a splice patches;
- `state`: what a patch keeps on the model; `attention`: a transformers attention function while a model uses it.

Imports neither vLLM nor the scanner: only torch, pydantic (the manifest model) and the generated module.
"""

from __future__ import annotations

from graphdiff.runtime.apply import active_regions, apply, remove
from graphdiff.runtime.dispatch import TORCH_SDPA as TORCH_SDPA
from graphdiff.runtime.dispatch import eager as eager
from graphdiff.runtime.dispatch import sdpa_calls as sdpa_calls
from graphdiff.runtime.layers import module_regex as module_regex
from graphdiff.runtime.layers import scanned_layer as scanned_layer
from graphdiff.runtime.manifest import PatchError, load_generated, load_manifest, scanned_config

__all__ = ["PatchError", "apply", "remove", "active_regions", "load_manifest", "load_generated", "scanned_config"]
