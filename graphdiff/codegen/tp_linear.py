"""The patch for an `allreduce` region: the trainer's row-parallel nn.Linear computed the way a tensor-parallel
engine computes it.

The engine splits the matmul's K (input) dimension over its ranks: rank r multiplies its K/shards columns of the
input by its shard of the weight, its GEMM accumulates in FP32 and stores the partial product in BF16, and the
all-reduce sums the BF16 partials in FP32 and rounds once more (analysis.tensor_parallel). The generated function
does exactly that with the trainer's own weight:

    y = bf16( sum_r fp32( bf16( x[..., K_r] @ W[:, K_r].T ) ) )      (bias, if any, in rank 0's partial, as vLLM)

The trainer's GEMM computes each partial (torch's own matmul on BF16 inputs: FP32 accumulation, one rounding);
for two ranks the FP32 sum of two partials is exact in any order; for more it is summed in rank order. The splice
is the module's forward (target `linear`); the manifest records the shard count. The generated module carries the
source of the functions below (PATCH_PARTS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphdiff.analysis.tensor_parallel import allreduce_truncates
from graphdiff.codegen.prelude import round_toward_zero, source
from graphdiff.records import LinearSplice, Node, Region


def _split_k_sum(module: torch.nn.Linear, x: torch.Tensor, shards: int) -> torch.Tensor:
    """The FP32 sum of the ranks' partial products, each rounded to the weight's dtype by its GEMM, in rank order."""
    weight, bias = module.weight, getattr(module, "bias", None)  # nn.Linear types no `bias`
    k = weight.shape[1]
    if k % shards:
        raise ValueError(f"graphdiff: in_features {k} is not divisible by {shards} tensor-parallel shards")
    step = k // shards
    total = F.linear(x[..., :step], weight[:, :step], bias).float()  # rank 0's partial holds the bias
    for r in range(1, shards):
        total = total + F.linear(x[..., r * step:(r + 1) * step], weight[:, r * step:(r + 1) * step]).float()
    return total


def linear_split_k(module: torch.nn.Linear, x: torch.Tensor, shards: int) -> torch.Tensor:
    """nn.Linear as a tensor-parallel engine with `shards` ranks computes it: K split into `shards` equal parts,
    each partial product rounded to the output dtype, the partials summed in FP32 (rank order), rounded once."""
    return _split_k_sum(module, x, shards).to(module.weight.dtype)


def linear_split_k_truncated(module: torch.nn.Linear, x: torch.Tensor, shards: int) -> torch.Tensor:
    """As linear_split_k, the FP32 sum stored by truncation (round toward zero), as the engine's all-reduce stores it
    on CPUs without AVX-512 BF16; the gradient passes the truncation as it passes a cast."""
    return round_toward_zero(_split_k_sum(module, x, shards)).to(module.weight.dtype)


# what the generated module carries for a linear splice (round_toward_zero is in its prelude)
PATCH_PARTS = (_split_k_sum, linear_split_k, linear_split_k_truncated)
SPLIT_K_FN = linear_split_k.__name__


def shards_of(scan_config: dict) -> int:
    return int(scan_config.get("tensor_parallel_size", 1) or 1)


def allreduce_splice(region: Region, nodes: dict[str, Node], site_node: dict[str, str],
                     shards: int, build: str = "") -> tuple[LinearSplice, list[str]]:
    """The splice of an allreduce region (its sites are the outputs of one module's matmul in every layer); its sum
    stored as the region's all-reduce (`region.kernels`) stores: truncated by vLLM's `_C.shm_allreduce` of a
    truncating ops `build` (`_C_AVX512`), else rounded to nearest even (torch.distributed's: vLLM CPU on `_C_AVX2`)."""
    owner = next((nodes[site_node[i]].module_type for i in region.sites if site_node.get(i) in nodes), "") or ""
    truncates = any(allreduce_truncates(k, build) for k in region.kernels) if region.kernels else \
        allreduce_truncates("shm_allreduce", build)  # a scan from before regions named their kernels
    splice = LinearSplice(key=region.module, module=region.module, module_class=owner, regions=[region.name],
                          shards=shards, torch_fn=(linear_split_k_truncated if truncates else linear_split_k).__name__,
                          triton_problem="torch matmuls on K shards (no elementwise kernel to generate)")
    if shards > 2 and any("_c10d_functional" in k for k in region.kernels):
        splice.problems.append(f"torch.distributed's all-reduce of {shards} ranks rounds each BF16 addition, in its "
                               "ring's order per element: not the FP32 sum rounded once this splice computes")
    if owner != "Linear":
        splice.problems.append(f"the region's matmul is computed by {owner or 'an unknown module'}, not nn.Linear")
    if shards < 2:
        splice.problems.append("the scan's engine ran one rank (tensor_parallel_size 1): no partial products")
    lines = ["", "", "# linear splices (allreduce regions): the K dimension split over the engine's ranks",
             *source(PATCH_PARTS)]
    return splice, lines
