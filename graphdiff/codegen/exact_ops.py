"""Which engine op an `--exact` splice calls, per engine device (docs/ARCHITECTURE.md, "--exact on a GPU engine").

The CPU rows are the ops the splices emit (`attention_splice.ENGINE_PARTS`, `analysis.moe_engine`). The CUDA rows
name vLLM's GPU ops, read from vLLM's sources, and are not emitted: no GPU engine has been scanned, and a code path
no test can run is not generated. An exact splice on a CUDA engine is refused, naming the op it would call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Target = Literal["attention", "experts", "gemm"]


@dataclass(frozen=True)
class ExactOp:
    op: str  # what the splice calls
    source: str  # where vLLM calls it
    settings: str  # the engine's settings the call must take: without them it sums in another order
    emitted: bool  # whether a generated patch calls it


EXACT_OPS: dict[tuple[str, Target], ExactOp] = {
    ("cpu", "attention"): ExactOp(
        "vllm._custom_ops.cpu_attention_with_kv_cache", "vllm/v1/attention/backends/cpu_attn.py",
        "the ISA and the scheduler metadata of `cpu_attn_get_scheduler_metadata`", True),
    ("cpu", "experts"): ExactOp(
        "torch.ops._C.cpu_fused_moe", "vllm/model_executor/layers/fused_moe/cpu_fused_moe.py",
        "the ISA, the activation, the weights packed by `prepack_moe_weight`", True),
    ("cpu", "gemm"): ExactOp(
        "vllm._custom_ops.onednn_mm", "vllm/model_executor/layers/utils.py",
        "the oneDNN handle `create_onednn_mm` makes from the weight", True),
    ("cuda", "attention"): ExactOp(
        "flash_attn_varlen_func (vLLM's FlashAttention build)", "vllm/v1/attention/backends/flash_attn.py",
        "the engine's num_splits (max_num_splits), FA3's scheduler_metadata, fa_version, block table, window",
        False),
    ("cuda", "experts"): ExactOp(
        "fused_experts (the fused_moe_kernel Triton kernel)", "vllm/model_executor/layers/fused_moe/fused_moe.py",
        "the config try_get_optimal_moe_config picks for the batch's M (BLOCK_SIZE_M/N/K, GROUP_SIZE_M from "
        "configs/E=...,N=...,device_name=....json, else get_default_config)", False),
    ("cuda", "gemm"): ExactOp(
        "F.linear (cuBLAS) on the merged weights (qkv_proj, gate_up_proj)", "vllm/model_executor/layers/linear.py",
        "allow_bf16_reduced_precision_reduction as the capture records it", False),
}


def exact_op(device: str, target: Target) -> ExactOp | None:
    """The op an exact splice of `target` calls on an engine that ran on `device` ("cpu" where none is recorded)."""
    return EXACT_OPS.get((device or "cpu", target))


def not_emitted(device: str, target: Target) -> str | None:
    """Why an exact splice of `target` cannot be generated for an engine on `device`, or None where it can."""
    op = exact_op(device, target)
    if op is None:
        return f"--exact has no engine op for {target} on a {device} engine"
    if op.emitted:
        return None
    return (f"--exact on a {device} engine would call {op.op} ({op.source}) with {op.settings}; not emitted yet "
            f"(no {device} engine has been scanned)")
