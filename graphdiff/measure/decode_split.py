"""The trainer's attention computed as the engine's decode computes it, query row by query row.

The engine samples in decode: its first step prefills every prompt of the batch at once (one request per prompt),
then each step feeds one token per request and attends it over that request's KV cache, a one-query step with the
decode batch's scheduler metadata (`cpu_attn_get_scheduler_metadata` over all requests of the step: its work items,
KV split and thread count are decided for the whole batch). A teacher-forced trainer sees a whole sequence at once;
`decode_split_attention` runs vLLM CPU's op on it as those steps did: the prompt's rows as the batch's prefill, every
later row as a one-query decode step over the keys before it, in a batch of `batch` equal-length requests (the
samples of one `generate` decode in lockstep: same prompt length, no EOS), taking request `request`'s output.

Only the attention op is the decode's here; the rest of the trainer (its GEMMs at M = sequence length, not the
decode batch's M) stays as it is, so the engine's decode-vs-prefill floor splits into attention's part and the rest.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from graphdiff.codegen.attention_splice import attention_isa, kv_cache


@dataclasses.dataclass
class DecodeBatch:
    """The engine's batch the current sequence decoded in: its prompt length, the number of requests, its index."""
    prompt_len: int = 0
    batch: int = 1
    request: int = 0


def _metadata(ops: Any, q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, dim: int,
              isa: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query_start_loc, seq_lens and scheduler metadata of one engine step, as its attention backend builds them."""
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lengths = torch.tensor(seq_lens, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(q_lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lengths,
        dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=_split_kv())
    return starts, lengths, meta


def _split_kv() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_CPU_ATTN_SPLIT_KV)


def decode_split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                           step: DecodeBatch, softcap: float = 0.0) -> torch.Tensor:
    """vLLM CPU's attention for one sequence as the engine's decode computed it: query [1, heads, seq, dim],
    key/value [1, kv_heads, seq, dim] -> [1, seq, heads, dim] BF16. Rows before `step.prompt_len` come from the
    batch's prefill of the prompts, each later row from its own one-query decode step over the keys before it."""
    import vllm._custom_ops as ops

    _, heads, seq, dim = query.shape
    kv_heads, n, r = key.shape[1], step.batch, step.request
    isa = attention_isa(dim)
    q, k, v = (t[0].transpose(0, 1).to(torch.bfloat16).contiguous() for t in (query, key, value))  # [seq, h, d]
    key_cache, value_cache, blocks = kv_cache(k, v, isa)
    table = torch.arange(blocks, dtype=torch.int32)[None].expand(n, -1).contiguous()  # every request reads it

    def run(rows: torch.Tensor, q_len: int, seq_len: int) -> torch.Tensor:
        # n equal requests: the metadata is the whole step's; request r's rows are this sequence's
        starts, lengths, meta = _metadata(ops, [q_len] * n, [seq_len] * n, heads, kv_heads, dim, isa)
        out = torch.zeros(n * q_len, heads, dim, dtype=torch.bfloat16)
        ops.cpu_attention_with_kv_cache(
            query=rows.repeat(n, 1, 1), key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=starts, seq_lens=lengths, scale=scaling, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=table, softcap=float(softcap or 0.0), scheduler_metadata=meta, s_aux=None)
        return out[r * q_len: (r + 1) * q_len]

    prompt = min(max(step.prompt_len, 1), seq)
    outs = [run(q[:prompt], prompt, prompt)]
    outs += [run(q[p: p + 1], 1, p + 1) for p in range(prompt, seq)]
    return torch.cat(outs)[None]


def decode_split_fn(step: DecodeBatch) -> Callable[..., tuple[torch.Tensor, None]]:
    """A transformers attention function computing as the engine's decode did (batch 1, causal, no padding); set
    `step` before each sequence's forward."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, softcap: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        if query.shape[0] != 1 or getattr(module, "sliding_window", None) or not getattr(module, "is_causal", True):
            raise ValueError("decode-split attention takes one causal sequence without a window")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return decode_split_attention(query, key, value, scale, step, float(softcap or 0.0)).to(query.dtype), None

    return attention


class _DecodeGemm:
    """The linears that read one input (q/k/v, gate/up) as the engine computes them: one fused weight through
    vLLM CPU's oneDNN GEMM (`onednn_mm`, the engine's own), the whole sequence at once, then every decode row again
    at the decode step's M (`step.batch` copies of the row): oneDNN picks its kernel by M, and by N."""

    def __init__(self, linears: list[torch.nn.Linear], step: DecodeBatch, first: int) -> None:
        import vllm._custom_ops as ops

        weight = torch.cat([m.weight.detach() for m in linears])
        bias = [m.bias for m in linears]
        self.ops, self.step, self.first = ops, step, first  # first: the first decode row, from prompt_len
        self.handler = ops.create_onednn_mm(weight.t(), 32)
        self.bias = None if bias[0] is None else torch.cat([b.detach() for b in bias])
        self.sizes = [m.out_features for m in linears]
        self.key: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()

    def __call__(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self.key is not x:  # the group's first member computes for all of them
            self.key, self.parts = x, self._compute(x).split(self.sizes, -1)
        return self.parts[index]

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = self.ops.onednn_mm(self.handler, rows, self.bias)
        for r in range(max(self.step.prompt_len + self.first, 0), rows.shape[0]):
            out[r] = self.ops.onednn_mm(self.handler, rows[r].expand(self.step.batch, -1).contiguous(), self.bias)[0]
        return out.reshape(*x.shape[:-1], -1)


def decode_gemms(model: torch.nn.Module, step: DecodeBatch,
                 groups: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                                                        ("o_proj",), ("down_proj",))) -> Callable[[], None]:
    """The model's decoder linears (fused as vLLM fuses them) and its LM head computed as the engine's decode
    computes them (`_DecodeGemm`); returns the undo. The LM head's decode rows start one earlier: the first
    sampled token's logits come from the prompt's last row, at the decode batch's M too (one row per request)."""
    patched: list[torch.nn.Module] = []

    def wrap(linears: list[torch.nn.Linear], first: int) -> None:
        gemm = _DecodeGemm(linears, step, first)
        for i, m in enumerate(linears):
            m.forward = functools.partial(gemm, i)  # type: ignore[method-assign]  # undone below
            patched.append(m)

    for module in model.modules():
        for names in groups:
            found = [m for n in names if isinstance(m := getattr(module, n, None), torch.nn.Linear)]
            if len(found) == len(names):
                wrap(found, 0)
    head = model.get_output_embeddings()  # type: ignore[operator]  # a transformers model's method
    if isinstance(head, torch.nn.Linear):
        wrap([head], -1)

    def undo() -> None:
        for m in patched:
            del m.forward

    return undo
