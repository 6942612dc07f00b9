"""The trainer's attention as the engine's decode computes it (graphdiff.measure.decode_split): the prompt's rows
are the batch's prefill, every later row a one-query step over the keys before it."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.engine, pytest.mark.kind]  # vLLM CPU's op library (no engine is started)


def _qkv(seq: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    return tuple(torch.randn(1, h, seq, 64, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))


def test_prompt_rows_are_the_prefill_and_later_rows_attend_only_to_earlier_keys():
    pytest.importorskip("vllm")
    from graphdiff.codegen.attention_splice import vllm_cpu_attention
    from graphdiff.measure.decode_split import DecodeBatch, decode_split_attention

    q, k, v = _qkv(300)
    out = decode_split_attention(q, k, v, 0.125, DecodeBatch(prompt_len=40, batch=3, request=1))
    assert out.shape == (1, 300, 4, 64) and out.dtype == torch.bfloat16
    prefill = vllm_cpu_attention(q[:, :, :40], k[:, :, :40], v[:, :, :40], 0.125)
    assert torch.equal(out[:, :40], prefill)  # the prompt: the batch's prefill of it
    # a later key never changes an earlier row: each decode row sees only the keys up to its own
    shorter = decode_split_attention(q[:, :, :200], k[:, :, :200], v[:, :, :200], 0.125,
                                     DecodeBatch(prompt_len=40, batch=3, request=1))
    assert torch.equal(out[:, :200], shorter)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1), is_causal=True, scale=0.125)
    assert torch.allclose(out.float(), ref.transpose(1, 2), atol=2e-2)  # attention, to BF16 precision


def test_the_decode_split_attention_function_refuses_what_decode_never_ran():
    pytest.importorskip("vllm")
    from graphdiff.measure.decode_split import DecodeBatch, decode_split_fn

    q, k, v = _qkv(20)
    fn = decode_split_fn(DecodeBatch(prompt_len=8))

    class Windowed(torch.nn.Module):
        sliding_window = 16
        is_causal = True

    with pytest.raises(ValueError, match="one causal sequence"):
        fn(Windowed(), q, k, v, None, scaling=0.125)
    with pytest.raises(ValueError, match="one causal sequence"):
        fn(torch.nn.Module(), torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]), None, scaling=0.125)
