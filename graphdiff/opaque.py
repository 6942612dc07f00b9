"""Opaque engine kernels: what the engine's attention rounds inside, and whether the trainer's differs.

The scan sees inside generated kernels (replay); an extern attention kernel is opaque. What it keeps in
FP32 inside comes from this registry, keyed by the backend the engine reports (`Capture.attention`).
The trainer side is decided numerically, as for every other site: its attention node is re-run on
FP32-upcast inputs and the result rounded once; where that differs from the trainer's stored output,
the trainer rounds inside its attention (softmax probabilities stored as BF16 before P@V) and the
engine, per the registry, does not. One site per layer, region kind `attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphdiff.model import Graph, SideRef, Site, layer_of

ATTENTION_OPS = ("scaled_dot_product",)  # aten._scaled_dot_product_{flash_attention_for_cpu,flash,...}


@dataclass(frozen=True)
class AttentionRule:
    backend: str  # the engine's attention backend name (vLLM: AttentionBackend.get_name())
    isa: str | None  # the backend's kernel variant where it matters (vLLM CPU: vec, vec16, amx), None: any
    probabilities_fp32: bool  # P stays FP32 into P@V (scores, softmax and accumulation FP32 too)
    source: str  # where this is known from


RULES = (
    AttentionRule("CPU_ATTN", "vec", True,
                  "vLLM csrc/cpu/cpu_attn_vec.hpp: q scaled in FP32, scores, softmax, P and P@V in FP32, output "
                  "rounded once; the op equals torch sdpa on FP32-upcast q/k/v rounded once "
                  "(tests/test_opaque_engine.py)"),
    AttentionRule("FLASH_ATTN", None, False, "FlashAttention casts P to BF16 for P@V, as torch's CUDA sdpa does"),
    AttentionRule("FLASHINFER", None, False, "FlashInfer casts P to BF16 for P@V, as torch's CUDA sdpa does"),
    AttentionRule("TRITON_ATTN", None, False, "vLLM's Triton attention casts P to the value dtype for P@V"),
)


def attention_rule(info: dict[str, str]) -> AttentionRule | None:
    for rule in RULES:
        if rule.backend == info.get("backend") and rule.isa in (None, info.get("isa")):
            return rule
    return None


def _changed_fraction(n: torch.fx.Node, values: dict[str, Any]) -> tuple[float, str] | None:
    """Fraction of the attention output that differs from the same op on FP32 inputs rounded once, and the
    output's dtype."""
    from graphdiff.rounding import rerun_fp32

    out = values.get(n.name)
    out = out[0] if isinstance(out, tuple | list) else out
    if not isinstance(out, torch.Tensor) or out.dtype == torch.float32:
        return None
    try:
        exact = rerun_fp32(n, values)
    except Exception:  # an op that refuses FP32 inputs: no evidence either way
        return None
    exact = exact[0] if isinstance(exact, tuple | list) else exact
    return float((exact.to(out.dtype) != out).float().mean()), str(out.dtype).removeprefix("torch.")


def attention_sites(info: dict[str, str], graph: Graph, gm: torch.fx.GraphModule | None,
                    values: dict[str, Any], engine_graphs: list[Graph]) -> tuple[list[Site], list[str]]:
    """Sites where the trainer's attention rounds inside and the engine's (per the registry) does not."""
    if not info:
        return [], ["the engine capture does not say which attention kernel ran: attention internals not compared"]
    rule = attention_rule(info)
    label = f"{info.get('backend')}" + (f" ({info['isa']})" if info.get("isa") else "")
    if rule is None:
        return [], [f"engine attention {label}: not in graphdiff's registry of opaque kernels, its internal "
                    "rounding is not compared"]
    if not rule.probabilities_fp32 or gm is None:
        return [], []
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    # the engine's attention calls, in layer order (one per layer, like the trainer's)
    calls = [k.id for g in engine_graphs for k in g.kernels if k.kind == "extern" and "attention" in k.name]
    attention = [n for n in graph.nodes
                 if n.op == "call_function" and any(op in n.target for op in ATTENTION_OPS) and n.name in fx_nodes]
    sites = []
    for i, n in enumerate(attention):
        found = _changed_fraction(fx_nodes[n.name], values)
        if found is None or not found[0]:
            continue
        changed, dtype = found
        sites.append(Site(
            id="", region="", kind="attention", layer=layer_of(n.module), rounded_on="train",
            train=SideRef(node=n.name, op=n.target, dtype=dtype, module=n.module, source=n.source,
                          how=f"rounds P to BF16 inside (changes {changed:.0%} of its output vs FP32 inputs)"),
            engine=SideRef(node="", op=label, how=f"P kept FP32 inside {label} (registry)",
                           kernel=calls[i] if len(calls) == len(attention) else None),
            matched=False, confidence=1.0, changed_fraction=changed,
            evidence=f"trainer: its attention on FP32-upcast inputs, rounded once, differs on {changed:.0%} of the "
                     f"output; engine {label}: {rule.source}"))
    return sites, []


# What `graphdiff patch` writes for an `attention` region (its subgraph is one opaque op: the generated code
# calls the trainer's own attention op the way the registry says the engine computes it).
ATTENTION_FN = "attention_fp32_inputs"
ATTENTION_SOURCE = f'''
def {ATTENTION_FN}(module, query, key, value, attention_mask, **kwargs):
    """Attention as the engine computes it (softmax probabilities kept FP32 into P@V): HF's sdpa on FP32-upcast
    q/k/v, the output rounded once to the value dtype. Registered as a transformers attention function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(value.dtype), weights
'''
