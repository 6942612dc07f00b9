"""Mixture-of-experts as vLLM CPU computes it: what a router or experts splice runs in the trainer.

The generated patch carries the source of these two functions (the runtime imports nothing of the scanner); the
scan runs them for its numeric check of the trainer's experts (analysis.moe), and the registry entry
`_C.cpu_fused_moe` (opaque.EXTERNS) is tested against the real op with them. `module` is the trainer's own router
or experts module, whose forward they replace.
"""

from __future__ import annotations

import torch


def moe_router_like_engine(module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """vLLM CPU's routing: top-k of the BF16 router logits (the GEMM reads BF16 inputs), softmax over those k in FP32
    (renormalized; else their share of all), weights kept FP32. Returned in the order the module's own forward
    returns them (Qwen: logits, weights, indices; Granite: indices, weights, logits), told apart by dtype and width on
    the module's first call."""
    hidden_states = hidden_states.reshape(-1, module.weight.shape[1]).to(module.weight.dtype)
    logits = torch.nn.functional.linear(hidden_states, module.weight)
    values, indices = torch.topk(logits, module.top_k, dim=-1)
    if getattr(module, "norm_topk_prob", True):
        weights = torch.softmax(values.float(), dim=-1)
    else:
        weights = (values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).exp()
    order = module.__dict__.get("_graphdiff_router_order")
    if order is None:  # the module's own forward, once per module: which output is which, and its dtype
        with torch.no_grad():
            own = type(module).forward(module, hidden_states)
        order = [("indices" if not o.is_floating_point() else "logits"
                  if o.shape[-1] == logits.shape[-1] != weights.shape[-1] else "weights", o.dtype) for o in own]
        module.__dict__["_graphdiff_router_order"] = order
    got = dict(indices=indices, logits=logits, weights=weights)
    return tuple(got[kind] if kind == "weights" else got[kind].to(dtype) for kind, dtype in order)


def moe_experts_like_engine(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """vLLM CPU's fused MoE: gate/up GEMM and the activation in FP32, silu(gate) * up rounded once, the down GEMM
    and the weighted sum over the chosen experts in FP32, the output rounded once."""
    x = hidden_states.float()
    out = torch.zeros(x.shape[0], module.down_proj.shape[1], dtype=torch.float32, device=x.device)
    inter = module.gate_up_proj.shape[1] // 2
    for e in top_k_index.unique().tolist():
        tokens, slot = torch.where(top_k_index == e)
        gate_up = x[tokens] @ module.gate_up_proj[e].float().t()
        act = (module.act_fn(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden_states.dtype)
        down = act.float() @ module.down_proj[e].float().t()
        out.index_add_(0, tokens, down * top_k_weights[tokens, slot, None].float())
    return out.to(hidden_states.dtype)


PATCH_PARTS = (moe_router_like_engine, moe_experts_like_engine)
ROUTER_FN, EXPERTS_FN = moe_router_like_engine.__name__, moe_experts_like_engine.__name__
