"""The patch for an `allreduce` region: the trainer's row-parallel nn.Linear computed the way a tensor-parallel
engine computes it.

The engine splits the matmul's K (input) dimension over its ranks: rank r multiplies its K/shards columns of the
input by its shard of the weight, its GEMM accumulates in FP32 and stores the partial product in BF16, and the
all-reduce sums the BF16 partials in FP32 and rounds once more (analysis.tensor_parallel). The generated function
does exactly that with the trainer's own weight:

    y = bf16( sum_r fp32( bf16( x[..., K_r] @ W[:, K_r].T ) ) )      (bias, if any, in rank 0's partial, as vLLM)

The trainer's GEMM computes each partial (torch's own matmul on BF16 inputs: FP32 accumulation, one rounding);
for two ranks the FP32 sum of two partials is exact in any order; for more it is summed in rank order. The splice
is the module's forward (target `linear`); the manifest records the shard count.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from graphdiff.capture.cpu_kind import stores_truncate
from graphdiff.records import ManifestSplice, Node, Region

SPLIT_K_FN = "linear_split_k"
SPLIT_K_SOURCE = f'''
def _split_k_sum(module: torch.nn.Module, x: torch.Tensor, shards: int) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    k = weight.shape[1]
    if k % shards:
        raise ValueError(f"graphdiff: in_features {{k}} is not divisible by {{shards}} tensor-parallel shards")
    step = k // shards
    total = None
    for r in range(shards):
        part = F.linear(x[..., r * step:(r + 1) * step], weight[:, r * step:(r + 1) * step],
                        bias if r == 0 else None).float()
        total = part if total is None else total + part
    return total


def {SPLIT_K_FN}(module: torch.nn.Module, x: torch.Tensor, shards: int) -> torch.Tensor:
    """nn.Linear as a tensor-parallel engine with `shards` ranks computes it: K split into `shards` equal parts,
    each partial product rounded to the output dtype, the partials summed in FP32 (rank order), rounded once."""
    return _split_k_sum(module, x, shards).to(module.weight.dtype)


def {SPLIT_K_FN}_truncated(module: torch.nn.Module, x: torch.Tensor, shards: int) -> torch.Tensor:
    """As {SPLIT_K_FN}, the FP32 sum stored by truncation (round toward zero), as the engine's all-reduce stores it
    on CPUs without AVX-512 BF16; the gradient passes the truncation as it passes a cast."""
    total = _split_k_sum(module, x, shards)
    truncated = (total.detach().view(torch.int32) & -65536).view(torch.float32)  # low 16 bits cleared: exact in BF16
    return (total + (truncated - total.detach())).to(module.weight.dtype)
'''


def shards_of(scan_config: dict) -> int:
    return int(scan_config.get("tensor_parallel_size", 1) or 1)


def allreduce_splice(region: Region, nodes: dict[str, Node], site_node: dict[str, str],
                     shards: int, build: str = "") -> tuple[ManifestSplice, list[str]]:
    """The splice of an allreduce region (its sites are the outputs of one module's matmul in every layer); its sum
    stored as the engine's ops `build` stores (truncated on `_C_AVX512`)."""
    owner = next((nodes[site_node[i]].module_type for i in region.sites if site_node.get(i) in nodes), "") or ""
    splice = ManifestSplice(key=region.module, target="linear", module=region.module, module_class=owner,
                            regions=[region.name], shards=shards,
                            torch_fn=f"{SPLIT_K_FN}_truncated" if stores_truncate(build) else SPLIT_K_FN,
                            triton_problem="torch matmuls on K shards (no elementwise kernel to generate)")
    if owner != "Linear":
        splice.problems.append(f"the region's matmul is computed by {owner or 'an unknown module'}, not nn.Linear")
    if shards < 2:
        splice.problems.append("the scan's engine ran one rank (tensor_parallel_size 1): no partial products")
    lines = ["", "", "# linear splices (allreduce regions): the K dimension split over the engine's ranks",
             *SPLIT_K_SOURCE.strip("\n").splitlines()]
    return splice, lines


def verify_splice(scan_dir: Path, gen: Any, splice: ManifestSplice, device: str = "cpu") -> list:
    """The generated split-K linear against the engine's own all-reduce outputs recorded by the scan (every rank's
    matmul input concatenated along K is the trainer's input; the weight from the checkpoint): bit for bit."""
    from graphdiff.analysis.tensor_parallel import allreduces, rank_of
    from graphdiff.artifacts import ScanDir
    from graphdiff.capture.engine_process import _checkpoint_tensor
    from graphdiff.codegen.verify import Check
    from graphdiff.runtime import _pattern

    d = ScanDir(scan_dir)
    if not d.engine_capture.is_file():
        return []
    # the checkpoint the trainer side read here (an engine capture made elsewhere names that machine's path)
    model = Path(d.load_train().model) if d.train_capture.is_file() else None
    cap, buffers = d.load_engine(model if model is not None and model.is_dir() else None)
    model = model if model is not None and model.is_dir() else Path(cap.model)
    records = buffers.get(cap.shapes[0].label if cap.shapes else next(iter(buffers), ""), {})
    ranks: dict[int, list] = {}
    for g in cap.graphs:
        ranks.setdefault(rank_of(g), []).extend(allreduces(g))
    nodes = {g.name: g.node_map() for g in cap.graphs}
    pattern, fn = _pattern(splice.module), getattr(gen, splice.torch_fn)
    checks = []
    for group in zip(*(ranks[r] for r in sorted(ranks))):
        module = nodes[group[0].graph][group[0].buffer].module or ""
        recs = [(records.get(a.kernel) or {}).get("extern") for a in group]
        if not group[0].matmul or not pattern.match(module) or not all(r and "matmul_input" in r for r in recs):
            continue
        weight = _checkpoint_tensor(model, f"{module}.weight")
        if weight is None or len(recs) != splice.shards:
            continue
        x = torch.cat([r["matmul_input"] for r in recs], dim=-1).to(device)
        ours = fn(SimpleNamespace(weight=weight.to(device), bias=None), x, splice.shards).cpu()
        same = torch.equal(ours, recs[0]["reduced"])
        diff = (ours.float() - recs[0]["reduced"].float()).abs().max()
        checks.append(Check(f"{splice.key} ({module}, recorded all-reduce)", "torch", True, same,
                            float(diff / torch.finfo(torch.bfloat16).eps), 0.0, same))
    return checks
