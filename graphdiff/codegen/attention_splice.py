"""What an attention splice runs in the trainer: attention as the registry says the engine computes it, or the
engine's own attention op. Their source is copied into the generated module (the runtime imports nothing of the
scanner; round_toward_zero is in its prelude), so these are the functions the patch runs.

- `attention_fp32_inputs`: HF's sdpa on FP32-upcast q/k/v, the output rounded once (an engine that keeps the softmax
  probabilities FP32 into P@V: vLLM CPU's `vec` kernel); `attention_fp32_inputs_truncated` stores the output by
  truncation, as that kernel does in vLLM's `_C_AVX512` build.
- `attention_engine_op` (`graphdiff patch --attention engine`): forward, vLLM CPU's prefill attention kernel
  (`cpu_attention_with_kv_cache` on the BF16 q/k/v, every query of a sequence at once, as the engine's prefill runs
  it): its key blocking, running max and stores are the engine's own, so no emulation can drift from it. Backward:
  the engine has none; the gradient is FP32 attention's, recomputed from the saved BF16 inputs, the gradient the FP32
  splice takes. It imports vLLM's op library (`vllm._custom_ops`, not an engine) when it first runs: a trainer that
  runs vLLM beside it (colocated RL trainers) has it; elsewhere `runtime.apply` refuses the splice.

A logit softcap is computed as the engine's op computes it (`softcap_like_engine`): scores times 1/softcap, a tanh
built from the op's own exp (`exp_like_engine`, vLLM CPU's AVX-512 polynomial, on its `_C` and `_C_AVX512` builds:
`ENGINE_EXP`, which a patch sets from its scan), times softcap. HF's `tanh(s / softcap) * softcap` parts from it by
several ulp of a score where the form's e - 1/e cancels (scores small against the cap), and that moves 0.2% of
Gemma 2's attention outputs by a BF16 ulp (0.02% with the engine's form).

A layer's sliding window and logit softcap come from the kwargs transformers' attention layers pass
(`sliding_window`, `softcap`; Gemma 2/3, Exaone 4 give `sliding_window=None` on their full layers): the engine
passes the same config values to its op (vLLM's `per_layer_sliding_window`, `logits_soft_cap`), and a window W
lets each query see itself and the W - 1 keys before it on both sides (HF's `kv > q - W`, vLLM CPU's kernel).
"""

from __future__ import annotations

import warnings

import torch

from graphdiff.codegen.prelude import round_toward_zero

KV_BLOCK = 128  # the KV-cache block size of vLLM's CPU attention backend
ENGINE_EXP = True  # the engine's attention op computes exp by vLLM CPU's AVX-512 polynomial (a patch sets it per build)
# the attention gradients `runtime.apply(attention_gradient=...)` may ask of this code (where torch's CPU flash
# kernel runs the attention; elsewhere FP32 attention's)
ATTENTION_GRADIENTS = ("fp32", "bf16")


def attention_isa(dim: int) -> str:
    """The ISA vLLM CPU's attention backend picks for BF16 heads of `dim` (`amx` after asking for AMX tiles, as
    vLLM's worker does: a process that has not dies of SIGILL in the kernel)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.bfloat16, KV_BLOCK, dim, "auto")
    if isa == "amx":
        torch.cpu._init_amx()
    return isa


def kv_cache(key: torch.Tensor, value: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One sequence's BF16 key/value [seq, kv_heads, dim] written into a fresh KV cache of vLLM CPU's layout, in
    positions 0..seq-1: (key_cache, value_cache, blocks)."""
    import vllm._custom_ops as ops

    seq, kv_heads, dim = key.shape
    blocks = -(-seq // KV_BLOCK)
    cache = torch.zeros(blocks, kv_heads, 2 * KV_BLOCK, dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(seq), isa)
    return key_cache, value_cache, blocks


def vllm_cpu_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                       softcap: float = 0.0, sliding_window: int | None = None) -> torch.Tensor:
    """vLLM CPU's attention on causal sequences: query [batch, heads, seq, dim], key/value [batch, kv_heads, seq,
    dim] -> [batch, seq, heads, dim] in BF16, each batch row one sequence of its own. `sliding_window` W: each
    query sees itself and the W - 1 keys before it (the engine passes the config's value as it is)."""
    import vllm._custom_ops as ops

    batch, heads, seq, dim = query.shape
    kv_heads = key.shape[1]
    window = int(sliding_window) if sliding_window else -1  # the engine's "no window"
    isa = attention_isa(dim)
    starts = torch.tensor([0, seq], dtype=torch.int32)
    lengths = torch.tensor([seq], dtype=torch.int32)
    # The engine's scheduler takes the window its KV-cache group's layers share (-1 where they differ): it only
    # skips key blocks no query sees, the same output either way.
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lengths, dtype=torch.bfloat16,
        query_start_loc=starts, causal=True, sliding_window_size=window, isa=isa, enable_kv_split=True)
    rows = []
    for b in range(batch):
        q, k, v = (t[b].transpose(0, 1).to(torch.bfloat16).contiguous() for t in (query, key, value))  # [seq, h, d]
        key_cache, value_cache, blocks = kv_cache(k, v, isa)
        out = torch.zeros(seq, heads, dim, dtype=torch.bfloat16)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=lengths, scale=scaling, causal=True, alibi_slopes=None, sliding_window=window,
            block_table=torch.arange(blocks, dtype=torch.int32)[None], softcap=float(softcap or 0.0),
            scheduler_metadata=meta, s_aux=None)
        rows.append(out)
    return torch.stack(rows)


def engine_attention_op():  # noqa: ANN201 - a torch op
    """`vllm_cpu_attention` as one torch op, `graphdiff::vllm_cpu_attention` (registered on first use): a traced
    trainer (make_fx, the scan's capture) records it as one node and runs it again, where it would not see vLLM's
    own op calls and would keep the zeros their output started as."""
    try:
        return torch.ops.graphdiff.vllm_cpu_attention.default
    except (AttributeError, RuntimeError):
        pass

    def impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, softcap: float,
             sliding_window: int) -> torch.Tensor:
        return vllm_cpu_attention(query, key, value, scaling, softcap, sliding_window)

    op = torch.library.custom_op("graphdiff::vllm_cpu_attention", impl, mutates_args=())

    @op.register_fake
    def _(query, key, value, scaling, softcap, sliding_window):  # noqa: ANN001, ANN202
        batch, heads, seq, dim = query.shape
        return query.new_empty(batch, seq, heads, dim, dtype=torch.bfloat16)

    return torch.ops.graphdiff.vllm_cpu_attention.default


def _causal_window_mask(q_len: int, kv_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] True where a query attends: causal (queries the last q_len positions), within the window."""
    query = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    key = torch.arange(kv_len, device=device)[None]
    allowed = key <= query
    return allowed & (key > query - window) if window else allowed


def _fma32(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor | float) -> torch.Tensor:
    """a * b + c rounded once to FP32, as an FMA instruction does (the FP32 product is exact in FP64; the FP64 sum
    rounds first only where it needs more than 53 bits)."""
    b, c = (torch.as_tensor(t, dtype=torch.float64) for t in (b, c))
    return (a.double() * b + c).float()


def exp_like_engine(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in FP32 as vLLM CPU's attention op computes it on its AVX-512 builds (`fast_exp`, csrc/cpu/
    cpu_attn_macros.h): n = floor(x log2(e) + 1/2), a degree-5 polynomial in r = x - n ln2 (FMAs), times 2^(n-1)
    made from exponent bits, times 2; 0 where x < ln(FLT_MIN)."""
    log2e, ln2 = float.fromhex("0x1.715476p+0"), float.fromhex("0x1.62e430p-1")
    low, high = float.fromhex("-0x1.5d58a0p+6"), float.fromhex("0x1.62e430p+6")
    x = x.float()
    clamped = x.clamp(low, high)
    n = torch.floor(_fma32(clamped, log2e, 0.5))
    r = _fma32(-n, ln2, clamped)
    poly = torch.full_like(r, float.fromhex("0x1.0f9f9cp-7"))
    for c in ("0x1.573a1ap-5", "0x1.555a80p-3", "0x1.fffdc6p-2", "0x1.fffff6p-1", "0x1p+0"):
        poly = _fma32(r, poly, float.fromhex(c))
    half_power = ((n.int() - 1 + 127) << 23).view(torch.float32).masked_fill(x < low, 0.0)
    return poly * half_power * 2


def softcap_like_engine(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap * tanh(scores / softcap) in FP32 as vLLM CPU's attention op computes it (`apply_softcap`, csrc/cpu/
    cpu_attn_impl.hpp): x = scores * (1 / softcap); on its AVX-512 builds (ENGINE_EXP) tanh(x) = (e - 1/e) / (e + 1/e)
    with e its exp (`exp_like_engine`), else the C library's tanh; times softcap."""
    x = scores.float() * torch.tensor(1.0 / softcap, dtype=torch.float32)
    if not ENGINE_EXP:
        return torch.tanh(x) * softcap
    e = exp_like_engine(x)
    inverse = 1.0 / e
    return (e - inverse) / (e + inverse) * softcap


def attention_like_engine(scores: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """P@V from FP32 scores (masked ones -inf) as the engine's op computes it: exp(scores - row max) by its exp
    (`exp_like_engine` on AVX-512 builds), P@V on these unnormalized probabilities, divided by their row sum after
    it, where the engine divides."""
    shifted = scores - scores.amax(-1, keepdim=True)
    probabilities = exp_like_engine(shifted) if ENGINE_EXP else shifted.exp()
    return torch.matmul(probabilities, value) / probabilities.sum(-1, keepdim=True)


def _masked(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Scores under a bool (True: attend) or additive attention mask, as HF's eager attention applies either."""
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        return scores.masked_fill(~attention_mask, float("-inf"))
    return scores if attention_mask is None else scores + attention_mask[..., :scores.shape[-1]]


def _softcapped_fp32(module, query, key, value, attention_mask, scaling=None, softcap=None, dropout=0.0,
                     **kwargs):
    """Attention with a logit softcap on FP32 inputs (sdpa has none): forward as the engine's op computes it (its
    softcap and exp, `softcap_like_engine`, `attention_like_engine`), gradient HF's eager attention's (Gemma 2's
    `eager_attention_forward`, op for op; its forward too under dropout, which the engine has not). No mask means
    causal attention, as sdpa takes it."""
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = (t[:, :, None].expand(t.shape[0], t.shape[1], groups, *t.shape[2:]).flatten(1, 2)
                  for t in (key, value))  # HF's repeat_kv: its backward sums the group as HF's eager does
    scores = torch.matmul(query, key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is None and getattr(module, "is_causal", True):
        attention_mask = _causal_window_mask(query.shape[2], key.shape[2], None, query.device)
    dropped = bool(dropout) and module.training
    if not dropped:
        with torch.no_grad():
            engine = attention_like_engine(_masked(softcap_like_engine(scores, softcap), attention_mask), value)
        if not torch.is_grad_enabled():
            return engine.transpose(1, 2).contiguous(), None
    weights = torch.nn.functional.softmax(_masked(torch.tanh(scores / softcap) * softcap, attention_mask), dim=-1,
                                          dtype=torch.float32)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value)
    out = out if dropped else engine + (out - out.detach())  # the engine's values, HF's gradient
    return out.transpose(1, 2).contiguous(), weights


class _FlashFP32(torch.autograd.Function):
    """FP32 causal attention by torch's CPU flash kernel, the kernel HF's sdpa runs on these inputs: the same output
    and gradient bit for bit, but it keeps the BF16 q/k/v the caller holds (upcast again in the backward) with the
    FP32 output and log-sum-exp, where autograd through sdpa would keep FP32 copies of q/k/v as well. `gradient`
    "bf16" (BF16 q/k/v): the backward is the BF16 flash kernel HF's unpatched trainer runs, given this forward's
    output (rounded) and log-sum-exp: HF's gradient precision at the patched forward's values, for the FP32
    backward's extra cost (GEMMs at FP32 rate)."""

    @staticmethod
    def forward(ctx, query, key, value, scale, gradient="fp32"):  # noqa: ANN001, ANN205 - autograd.Function signature
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query.float(), key.float(), value.float(), 0.0, True, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale = scale
        ctx.bf16 = gradient == "bf16" and query.dtype == key.dtype == value.dtype == torch.bfloat16
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        query, key, value, out, lse = ctx.saved_tensors
        # "bf16": the BF16 kernel HF's own trainer runs, at this forward's output and log-sum-exp
        dtype = torch.bfloat16 if ctx.bf16 else torch.float32
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_output.to(dtype).transpose(1, 2), query.to(dtype), key.to(dtype), value.to(dtype), out.to(dtype), lse,
            0.0, True, scale=ctx.scale)
        return (*(g.to(t.dtype) for g, t in zip(grads, (query, key, value))), None, None)


def _flash_fp32_takes(module, query, key, value, attention_mask, kwargs) -> bool:  # noqa: ANN001
    """Would HF's sdpa on these FP32-upcast inputs run torch's CPU flash kernel causally, with no mask, dropout,
    softcap, position bias or paged cache (what `_FlashFP32` computes)? Only where it does is `_FlashFP32` the same
    attention."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    extra = any(kwargs.get(k) for k in ("softcap", "dropout")) or any(
        kwargs.get(k) is not None for k in ("position_bias", "cache"))
    if (query.device.type != "cpu" or attention_mask is not None or extra or not causal or query.shape[2] < 2
            or query.shape[2] != key.shape[2]):
        return False
    grouped = key.shape[1] != query.shape[1]
    if grouped and not key.shape[-1] == value.shape[-1] <= 256:  # HF repeats k/v there: another gradient sum
        return False
    scale = kwargs.get("scaling")
    q, k, v = (t[..., :1, :].float() for t in (query, key, value))  # the choice reads dtypes, shapes and strides
    try:  # torch's own (private) choice; a torch without it keeps HF's sdpa
        choice = torch._fused_sdp_choice(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=scale,
                                         enable_gqa=grouped)
        return choice == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value
    except (AttributeError, RuntimeError, TypeError):
        return False


def _attention_in_fp32(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    if torch.is_grad_enabled() and _flash_fp32_takes(module, query, key, value, attention_mask, kwargs):
        scale = kwargs.get("scaling")
        return _FlashFP32.apply(query, key, value, query.shape[-1] ** -0.5 if scale is None else scale,
                                getattr(module, "_graphdiff_attention_gradient", "fp32")), None
    query, key, value = query.float(), key.float(), value.float()
    if kwargs.get("softcap"):
        return _softcapped_fp32(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def stored_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Attention inputs as the engine stores them: an FP32 one (a patch's FP32 handoff) rounded to BF16."""
    return tuple(t.to(torch.bfloat16) if t.dtype == torch.float32 else t for t in tensors)


def attention_fp32_inputs(module, query, key, value, attention_mask, **kwargs):
    """Attention as the engine computes it (softmax probabilities kept FP32 into P@V): HF's sdpa on FP32-upcast
    q/k/v, the output rounded once to the value dtype. The engine reads q, k and v as it stores them, in BF16: one the
    trainer hands on in FP32 (OLMo 2's RoPE of an FP32 norm output) is rounded first. Registered as a transformers
    attention function."""
    query, key, value = stored_inputs(query, key, value)
    out, weights = _attention_in_fp32(module, query, key, value, attention_mask, **kwargs)
    return out.to(value.dtype), weights


def attention_fp32_inputs_truncated(module, query, key, value, attention_mask, **kwargs):
    """As attention_fp32_inputs, the output stored by truncation (round toward zero), as the engine's attention op
    stores it on CPUs without AVX-512 BF16; the gradient passes the truncation as it passes a cast."""
    query, key, value = stored_inputs(query, key, value)
    out, weights = _attention_in_fp32(module, query, key, value, attention_mask, **kwargs)
    return round_toward_zero(out).to(value.dtype), weights


class _EngineAttention(torch.autograd.Function):
    """Forward: the engine's op. Backward: FP32 attention's exact gradient, recomputed from the saved inputs with
    the same scale, window and softcap (or its "bf16" gradient, `_FlashFP32`, where the module asks for it)."""

    @staticmethod
    def forward(ctx, query, key, value, module, kwargs):  # noqa: ANN001, ANN205 - autograd.Function signature
        ctx.save_for_backward(query, key, value)
        ctx.module, ctx.kwargs = module, kwargs
        dim = query.shape[-1]
        scaling = kwargs.get("scaling")
        return engine_attention_op()(query, key, value, dim ** -0.5 if scaling is None else float(scaling),
                                     float(kwargs.get("softcap") or 0.0),
                                     int(kwargs.get("sliding_window") or -1)).to(value.dtype)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        saved = ctx.saved_tensors
        with torch.enable_grad():  # FP32 attention upcasts the inputs itself (its "bf16" gradient reads them as BF16)
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved]
            query, key, value = inputs
            seq, window = query.shape[2], ctx.kwargs.get("sliding_window")
            # No mask where the window leaves every key in sight: sdpa's causal kernel, as the forward's trainer runs
            mask = _causal_window_mask(seq, seq, window, query.device) if window and window < seq else None
            out = _attention_in_fp32(ctx.module, query, key, value, mask, **ctx.kwargs)[0]
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_output.float()) if wanted else [])
        return (*[next(grads).to(t.dtype) if t.requires_grad else None for t in saved], None, None)


def _causal_only(mask: torch.Tensor | None, seq: int, window: int | None = None) -> bool:
    """Is the attention mask plain causal attention over the whole row within `window` (no padding)?"""
    if mask is None:
        return True
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return bool((allowed[..., -seq:, -seq:] == _causal_window_mask(seq, seq, window, mask.device)).all())


def layer_window(module, kwargs) -> int | None:
    """The layer's sliding window: what its attention call passes (Exaone 4 keeps the config's window on every
    layer and passes None on its full ones), else the module's own attribute."""
    return kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)


def attention_engine_op(module, query, key, value, attention_mask, **kwargs):
    """Attention as the engine computes it, by the engine's own op (vLLM CPU's prefill kernel): the forward is the
    engine's bit for bit on causal rows without padding (sliding window and logit softcap as the layer passes
    them); the backward FP32 attention's exact gradient. Rows the op cannot take (padding, a KV cache, non-causal
    attention, dropout) run the FP32 attention instead, with a warning."""
    seq, window = query.shape[2], layer_window(module, kwargs) or None
    why = ("non-causal attention" if not getattr(module, "is_causal", True) else
           "keys other than the queries' own (a KV cache)" if key.shape[2] != seq else
           "a padding mask" if not _causal_only(attention_mask, seq, window) else
           "dropout" if kwargs.get("dropout") else "")
    if why:
        warnings.warn(f"graphdiff: the engine's attention op cannot take {why}: FP32 attention runs instead",
                      stacklevel=2)
        return attention_fp32_inputs(module, query, key, value, attention_mask, **kwargs)
    kept = {k: kwargs[k] for k in ("scaling", "softcap") if kwargs.get(k) is not None}
    out = _EngineAttention.apply(query, key, value, module, {**kept, "sliding_window": window})
    return out, None


def sdpa_call(attention, module, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """torch's sdpa as a module's own code calls it (FalconAttention), computed by `attention` (a transformers
    attention function of this module): the output [batch, heads, seq, dim], as sdpa returns it. Non-causal rows with
    no mask go to `attention` as an all-true mask, so that it takes them as such."""
    if attn_mask is None and not is_causal and query.shape[-2] > 1:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device)
    out, _ = attention(module, query, key, value, attn_mask, scaling=scale, dropout=dropout_p)
    return out.transpose(1, 2)


FP32_PARTS = (_causal_window_mask, _fma32, exp_like_engine, softcap_like_engine, attention_like_engine, _masked,
              _softcapped_fp32, _FlashFP32, _flash_fp32_takes, _attention_in_fp32, stored_inputs, attention_fp32_inputs,
              attention_fp32_inputs_truncated)
ENGINE_PARTS = (attention_isa, kv_cache, vllm_cpu_attention, engine_attention_op, _EngineAttention, _causal_only,
                layer_window, attention_engine_op)
