"""Which of the engine's ops make its floor: those whose result for one row changes with the rows computed beside it.

The engine's decode computes each new token as one row of a step of `batch` rows (one per request decoding in
lockstep); its prefill scoring computes the same token as one row of a whole sequence. An op whose kernel (or
summation order) depends on the number of rows gives a row different bits in the two, and no trainer patch can
equal both. This probe runs the engine's own ops, as its process picks them on this CPU, at the model's shapes on
seeded random inputs, and reports per op the share of rows whose bits change:

- every distinct dense linear shape through vLLM CPU's own GEMM dispatch (`dispatch_cpu_unquantized_gemm`: oneDNN's
  `onednn_mm`, or `weight_packed_linear` on AMX for small weights), at M = the whole sequence and at M = `batch`;
- the attention op: the sequence prefilled at once, against each later row as a one-query decode step over the keys
  before it in a step of `batch` equal requests (graphdiff.measure.decode_split).

It names candidates by what they compute, not the tokens they flipped: an op that varies here makes the floor
wherever its differing rows reach a log-prob.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from graphdiff import child
from graphdiff.records import Progress

PROBED_ROWS = 32  # rows probed per op: enough to see a kernel switch, few enough to take seconds


def linear_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """The model's dense linears as (in_features, out_features) by role, fused as vLLM fuses q/k/v and gate/up."""
    hidden = config.hidden_size
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    shapes = {"qkv_proj": (hidden, (heads + 2 * kv_heads) * dim), "o_proj": (heads * dim, hidden),
              "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden), "lm_head": (hidden, config.vocab_size)}
    moe_inter = getattr(config, "moe_intermediate_size", None)
    if moe_inter:  # a shared expert's linears, at the experts' width
        shapes |= {"shared gate_up_proj": (hidden, 2 * moe_inter), "shared down_proj": (moe_inter, hidden)}
    return shapes


def gemm_variance(in_features: int, out_features: int, rows: int, batch: int, seed: int = 0) -> tuple[str, float]:
    """(the engine's GEMM op for this weight, the share of probed rows whose output at M = `batch` differs from the
    same row's at M = `rows`)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    linear: Any = layer.cpu_linear  # the function vLLM's dispatch set on the layer
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    full = linear(x, layer.weight, None)
    probed = torch.linspace(0, rows - 1, min(PROBED_ROWS, rows)).long().unique()
    differ = sum(not torch.equal(linear(x[r].expand(batch, -1).contiguous(), layer.weight, None)[0], full[r])
                 for r in probed.tolist())
    op = _op_name(linear)
    return op, differ / len(probed)


def _op_name(fn: Any) -> str:
    names = fn.__code__.co_names if hasattr(fn, "__code__") else ()
    for op in ("weight_packed_linear_cpu", "onednn_mm", "zentorch_linear_unary"):
        if op in names:
            return op.removesuffix("_cpu")
    return "torch linear"


def attention_variance(config: Any, seq: int, prompt_len: int, batch: int, seed: int = 0) -> float:
    """The share of probed decode rows (after the prompt) whose attention output as a one-query decode step of
    `batch` requests differs from the same row in the whole sequence's prefill."""
    from graphdiff.codegen.attention_splice import vllm_cpu_attention
    from graphdiff.measure.decode_split import DecodeBatch, decode_split_attention

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, seq, dim, generator=gen).to(torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    scale = dim ** -0.5
    prefill = vllm_cpu_attention(q, k, v, scale)[0]
    decode = decode_split_attention(q, k, v, scale, DecodeBatch(prompt_len, batch, 0))[0]
    rows = range(prompt_len, seq)
    return sum(not torch.equal(prefill[r], decode[r]) for r in rows) / max(len(rows), 1)


def probe(config: Any, seq: int, prompt_len: int, batch: int, progress: Progress = lambda m: None) -> list[str]:
    """One line per probed op: what it is, at which shape, and the share of rows whose bits change with the rows
    beside them (varying ops first)."""
    found: list[tuple[float, str]] = []
    seen: dict[tuple[int, int], str] = {}
    for role, (k, n) in linear_shapes(config).items():
        if (k, n) in seen:
            continue
        progress(f"floor probe: {role} GEMM {k} -> {n} at M = {batch} and M = {seq}")
        op, share = gemm_variance(k, n, seq, batch)
        seen[(k, n)] = role
        found.append((share, f"{role} GEMM ({op}, {k} -> {n}): {share:.0%} of rows differ at M = {batch} vs {seq}"))
    progress(f"floor probe: attention, decode steps of {batch} requests vs one prefill of {seq} tokens")
    share = attention_variance(config, seq, prompt_len, batch)
    found.append((share, f"attention (vLLM CPU decode over the KV cache vs prefill): {share:.0%} of decode rows "
                         f"differ at {seq} tokens"))
    return [line for _, line in sorted(found, key=lambda f: -f[0])]


def _child(req: dict, progress: Progress) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(req["model_dir"])
    config = getattr(config, "text_config", None) or config
    lines = probe(config, req["seq"], req["prompt_len"], req["batch"], progress)
    Path(req["result"]).write_text(json.dumps(lines))


def floor_ops(model_dir: Path, seq: int, prompt_len: int, batch: int, progress: Progress = lambda m: None
              ) -> list[str]:
    """`probe` for the checkpoint in `model_dir`, in a child process (the engine's ops load there, as the engine's
    process loads them on this CPU kind)."""
    with tempfile.TemporaryDirectory(prefix="graphdiff-floor-") as tmp:
        result = Path(tmp) / "floor_ops.json"
        child.run("graphdiff.measure.floor_ops", dict(model_dir=str(model_dir), seq=seq, prompt_len=prompt_len,
                                                       batch=batch, result=str(result)), progress)
        return json.loads(result.read_text())


if __name__ == "__main__":
    sys.exit(child.serve(_child))
