"""The portable attention splice's FP32 attention by torch's CPU flash kernel (`_FlashFP32`): HF's sdpa on the
FP32-upcast inputs bit for bit, forward and gradient, keeping the caller's BF16 q/k/v instead of FP32 copies."""

from __future__ import annotations

import pytest
import torch

from graphdiff.codegen import attention_splice


class _Layer(torch.nn.Module):
    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _inputs(heads: int, kv_heads: int, seq: int, dim: int) -> tuple[torch.Tensor, ...]:
    """BF16 q/k/v as HF's attention layers hand them on ([batch, heads, seq, dim] views of [batch, seq, heads, dim])
    and an output gradient."""
    gen = torch.Generator().manual_seed(seq + dim)
    q, k, v = (torch.randn(2, seq, h, dim, generator=gen).to(torch.bfloat16).transpose(1, 2)
               for h in (heads, kv_heads, kv_heads))
    return q, k, v, torch.randn(2, seq, heads, dim, generator=gen).to(torch.bfloat16)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, flash: bool,
               monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], int]:
    """Output and q/k/v gradients of the portable splice, with `_FlashFP32` or HF's sdpa (autograd), and the bytes
    the forward saves for the backward beyond the q/k/v it is given."""
    with monkeypatch.context() as m:
        if not flash:
            m.setattr(attention_splice, "_flash_fp32_takes", lambda *args: False)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        layer = _Layer(q.shape[1] // k.shape[1])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = attention_splice.attention_fp32_inputs(layer, *leaves, None, scaling=q.shape[-1] ** -0.5)
        out.backward(grad)
    given = {t.untyped_storage().data_ptr() for t in leaves}
    return [out.detach(), *(t.grad for t in leaves)], sum(b for p, b in saved.items() if p not in given)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (4, 4, 128), (6, 2, 256)])
def test_the_flash_path_is_sdpas_attention_bit_for_bit_and_keeps_less(heads: int, kv_heads: int, dim: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, grad = _inputs(heads, kv_heads, 77, dim)
    layer = _Layer(heads // kv_heads)
    assert attention_splice._flash_fp32_takes(layer, q, k, v, None, {"scaling": dim ** -0.5})
    flash, flash_saved = _attention(q, k, v, grad, True, monkeypatch)
    sdpa, sdpa_saved = _attention(q, k, v, grad, False, monkeypatch)
    for got, want in zip(flash, sdpa):
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    # sdpa's autograd keeps FP32 q/k/v and output; the flash path keeps the FP32 output and log-sum-exp only
    out_bytes, lse_bytes = q.numel() * 4, q[..., 0].numel() * 4
    assert flash_saved == out_bytes + lse_bytes < sdpa_saved


def test_attention_the_flash_kernel_would_not_run_keeps_hfs_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masks, single-token queries, KV caches, non-causal layers, dropout, a softcap, a position bias, grouped heads
    over 256 (which HF repeats instead of sdpa's own grouping: another gradient sum) and a forward without gradients
    run HF's sdpa as before."""
    q, k, v, _ = _inputs(4, 2, 20, 64)
    layer, kwargs = _Layer(2), {"scaling": 0.125}
    takes = attention_splice._flash_fp32_takes
    assert takes(layer, q, k, v, None, kwargs)
    assert not takes(layer, q, k, v, torch.ones(20, 20, dtype=torch.bool).tril(), kwargs)
    assert not takes(layer, q[:, :, -1:], k, v, None, kwargs)
    assert not takes(layer, q[:, :, -5:], k, v, None, kwargs)
    assert not takes(layer, q, k, v, None, {**kwargs, "is_causal": False})
    assert not takes(layer, q, k, v, None, {**kwargs, "dropout": 0.1})
    assert not takes(layer, q, k, v, None, {**kwargs, "softcap": 50.0})
    assert not takes(layer, q, k, v, None, {**kwargs, "position_bias": torch.zeros(4, 20, 20)})
    wide = _inputs(4, 2, 20, 320)
    assert not takes(layer, *wide[:3], None, kwargs)
    assert takes(_Layer(1), *_inputs(4, 4, 20, 320)[:3], None, kwargs)
    monkeypatch.setattr(attention_splice._FlashFP32, "apply", None)  # not called where no gradient is taken
    with torch.no_grad():
        out, _ = attention_splice.attention_fp32_inputs(layer, q, k, v, None, **kwargs)
    assert out.dtype == torch.bfloat16


def test_a_torch_without_sdpas_choice_keeps_hfs_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated patch runs in the trainer's torch: where `torch._fused_sdp_choice` is missing or takes other
    arguments, the splice runs HF's sdpa as before instead of failing."""
    q, k, v, _ = _inputs(4, 2, 20, 64)
    monkeypatch.delattr(torch, "_fused_sdp_choice")
    assert not attention_splice._flash_fp32_takes(_Layer(2), q, k, v, None, {"scaling": 0.125})


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (4, 4, 128)])
def test_the_bf16_gradient_is_hfs_kernel_at_the_fp32_forwards_statistics(heads: int, kv_heads: int, dim: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`runtime.apply(attention_gradient="bf16")`: the forward unchanged bit for bit; the gradient is the BF16 flash
    backward HF's unpatched trainer runs, given the FP32 forward's output and log-sum-exp, bit for bit; it is not
    the FP32 gradient, and it is as close to it as HF's own BF16 attention's gradient is."""
    q, k, v, grad = _inputs(heads, kv_heads, 77, dim)
    fp32, _ = _attention(q, k, v, grad, True, monkeypatch)
    monkeypatch.setattr(_Layer, "_graphdiff_attention_gradient", "bf16", raising=False)
    bf16, _ = _attention(q, k, v, grad, True, monkeypatch)
    assert torch.equal(bf16[0], fp32[0])
    scale = dim ** -0.5
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q.float(), k.float(), v.float(), 0.0, True, scale=scale)
    want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.transpose(1, 2), q, k, v, out.to(torch.bfloat16), lse, 0.0, True, scale=scale)
    hf_out, hf_lse = flash(q, k, v, 0.0, True, scale=scale)
    hf = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.transpose(1, 2), q, k, v, hf_out, hf_lse, 0.0, True, scale=scale)
    for got, exact, w, h in zip(bf16[1:], fp32[1:], want, hf):
        assert got.dtype == torch.bfloat16 and torch.equal(got, w)
        assert not torch.equal(got, exact)

        def err(g: torch.Tensor, e: torch.Tensor = exact) -> float:
            return float((g.float() - e.float()).norm() / e.float().norm())

        assert err(got) <= 1.5 * err(h)


def test_the_runtime_offers_the_gradients_the_generated_code_computes() -> None:
    """The runtime (which imports no codegen) validates `attention_gradient` against its own list: the same list."""
    from graphdiff.runtime.state import ATTENTION_GRADIENTS

    assert ATTENTION_GRADIENTS == attention_splice.ATTENTION_GRADIENTS
