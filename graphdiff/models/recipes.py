"""The tiny architectures `graphdiff make-tiny` and `tiny:ARCH` build: one seeded recipe per decoder architecture
that both the installed transformers and vLLM serve (the architecture sweep). Each is (config class, complete
config overrides); `num_hidden_layers` is given by the caller. Shapes are tiny and alike: hidden 256, head_dim 64
(a size every vLLM attention backend takes), 4 query / 2 KV heads where the architecture has GQA, vocab 2048,
4096 positions; MoE recipes 8 experts, top-2, expert width 128.
"""

from __future__ import annotations

# One small shape shared by the Llama-like architectures: head_dim 64 is a size every vLLM attention backend supports;
# 2 KV heads exercise grouped-query attention.
INITIALIZER_RANGE = 0.08  # the std of the tiny models' random weights
TINY_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=2048,
    max_position_embeddings=4096,  # room for the scan's long-prefill shapes (2048 tokens and more)
    rms_norm_eps=1e-6,
    initializer_range=INITIALIZER_RANGE,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
SPECIAL_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Llama-like fields (names as the config classes spell them).
BASE = {k: v for k, v in TINY_SHAPE.items() if k != "rms_norm_eps"} | SPECIAL_TOKENS
RMS = dict(rms_norm_eps=1e-6)
MOE = dict(num_experts_per_tok=2)


def rope(theta: float, **extra) -> dict:
    return dict(rope_parameters=dict(rope_type="default", rope_theta=theta, **extra))


def _b(**kw) -> dict:
    return {**BASE, **kw}


ARCHS: dict[str, tuple[str, dict]] = {
    # --- dense, Llama family ------------------------------------------------------------------
    "llama": ("LlamaConfig", dict(TINY_SHAPE, rope_theta=500_000.0, attention_bias=False, mlp_bias=False)),
    "mistral": ("MistralConfig", _b(**RMS, **rope(10_000.0), sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(TINY_SHAPE, rope_theta=1_000_000.0)),
    "qwen3": ("Qwen3Config", dict(TINY_SHAPE, rope_theta=1_000_000.0, attention_bias=False)),
    "phi3": ("Phi3Config", _b(**RMS, **rope(10_000.0), original_max_position_embeddings=4096,
                               sliding_window=None)),
    "granite": ("GraniteConfig", _b(**RMS, **rope(10_000.0), embedding_multiplier=12.0, residual_multiplier=0.22,
                                     attention_multiplier=0.015625, logits_scaling=8.0)),
    "glm4": ("Glm4Config", _b(**RMS, **rope(10_000.0, partial_rotary_factor=0.5), attention_bias=True)),
    "exaone4": ("Exaone4Config", _b(**RMS, **rope(1_000_000.0), sliding_window=512, sliding_window_pattern=4,
                                     layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "ernie4_5": ("Ernie4_5Config", _b(**RMS, **rope(500_000.0), use_bias=False)),
    "apertus": ("ApertusConfig", _b(**RMS, **rope(12_000_000.0))),  # xIELU activation
    "nemotron": ("NemotronConfig", _b(norm_eps=1e-5, **rope(10_000.0, partial_rotary_factor=0.5))),  # relu2, LN1p
    "stablelm": ("StableLmConfig", _b(layer_norm_eps=1e-5, **rope(10_000.0, partial_rotary_factor=0.25),
                                       partial_rotary_factor=0.25, use_qkv_bias=True, qk_layernorm=False)),
    # tied: vLLM's Cohere computes logits with the input embedding and skips lm_head.weight
    "cohere": ("CohereConfig", _b(layer_norm_eps=1e-5, **rope(10_000.0), logit_scale=0.0625, use_qk_norm=False,
                                  tie_word_embeddings=True)),
    # --- dense, Gemma family (norm weight w is applied as 1 + w; GELU-tanh; scaled embedding) ------------
    "gemma": ("GemmaConfig", _b(**RMS, **rope(10_000.0), hidden_act="gelu_pytorch_tanh",
                                hidden_activation="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", _b(**RMS, **rope(10_000.0), hidden_activation="gelu_pytorch_tanh",
                                  query_pre_attn_scalar=64, sliding_window=512, attn_logit_softcapping=50.0,
                                  # tied: vLLM's Gemma2 has no lm_head
                                  final_logit_softcapping=30.0, tie_word_embeddings=True,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3": ("Gemma3TextConfig", dict(
        _b(**RMS, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=64, sliding_window=512),
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    # --- dense, GPT-style (LayerNorm, learned or rotary positions, GELU) --------------------------------
    "gpt2": ("GPT2Config", dict(n_embd=256, n_inner=512, n_head=4, vocab_size=2048, n_positions=4096,
                                activation_function="gelu_new", initializer_range=0.08, tie_word_embeddings=True,
                                torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gptj": ("GPTJConfig", dict(n_embd=256, n_inner=512, n_head=4, rotary_dim=32, vocab_size=2048,
                                n_positions=4096, activation_function="gelu_new", initializer_range=0.08,
                                tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    # ffn 4 x hidden: vLLM's Falcon hard-codes it
    "falcon": ("FalconConfig", dict(hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
                                    num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True, bias=False,
                                    alibi=False, vocab_size=2048, max_position_embeddings=4096,
                                    initializer_range=0.08, tie_word_embeddings=False, torch_dtype="bfloat16",
                                    **rope(10_000.0), **SPECIAL_TOKENS)),
    "bloom": ("BloomConfig", dict(hidden_size=256, n_head=4, vocab_size=2048, initializer_range=0.08,
                                  tie_word_embeddings=True, torch_dtype="bfloat16", **SPECIAL_TOKENS)),
    "opt": ("OPTConfig", dict(hidden_size=256, ffn_dim=512, num_attention_heads=4,
                              vocab_size=2048, max_position_embeddings=4096, word_embed_proj_dim=256,
                              init_std=0.08, tie_word_embeddings=True, torch_dtype="bfloat16", dropout=0.0,
                              **SPECIAL_TOKENS)),
    # --- MoE --------------------------------------------------------------------------------------------
    "qwen2_moe": ("Qwen2MoeConfig", _b(**RMS, **rope(1_000_000.0), **MOE, num_experts=8, moe_intermediate_size=128,
                                       shared_expert_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[],
                                       norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", _b(**RMS, **rope(1_000_000.0), **MOE, num_experts=8, moe_intermediate_size=128,
                                       decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", _b(**RMS, **rope(1_000_000.0), **MOE, num_local_experts=8, intermediate_size=128)),
    "granitemoe": ("GraniteMoeConfig", _b(**RMS, **rope(10_000.0), **MOE, num_local_experts=8, intermediate_size=128,
                                          embedding_multiplier=12.0, residual_multiplier=0.22,
                                          attention_multiplier=0.015625, logits_scaling=8.0)),
    "olmoe": ("OlmoeConfig", _b(rms_norm_eps=1e-5, **rope(10_000.0), **MOE, num_experts=8, intermediate_size=128,
                                norm_topk_prob=False)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", _b(**RMS, **rope(500_000.0), moe_k=2, moe_num_experts=8,
                                              moe_intermediate_size=128, moe_num_shared_experts=0,
                                              moe_layer_start_index=0, moe_layer_interval=1, use_bias=False)),
    "glm4_moe": ("Glm4MoeConfig", _b(**RMS, **rope(10_000.0, partial_rotary_factor=0.5), **MOE, n_routed_experts=8,
                                     moe_intermediate_size=128, n_shared_experts=1, first_k_dense_replace=1,
                                     n_group=1, topk_group=1, norm_topk_prob=True, use_qk_norm=False,
                                     num_nextn_predict_layers=0)),
}

# Served by vLLM 0.32 through its Transformers modeling backend (registry._TRANSFORMERS_SUPPORTED_MODELS), not a
# native class: the engine compiles HF's own modeling code (and patches the HF class).
ARCHS.update({
    "olmo2": ("Olmo2Config", _b(rms_norm_eps=1e-6, **rope(500_000.0), attention_bias=False)),
    "starcoder2": ("Starcoder2Config", _b(norm_epsilon=1e-5, **rope(100_000.0), hidden_act="gelu_pytorch_tanh",
                                          use_bias=True, sliding_window=None, residual_dropout=0.0,
                                          embedding_dropout=0.0)),
    # no GQA: HF's GPT-NeoX attention has as many key/value heads as query heads whatever num_key_value_heads says,
    # while vLLM's Transformers backend sizes its KV cache by num_key_value_heads (2 of 4: a 2048-token prefill
    # wrote past the cache and segfaulted)
    "gpt_neox": ("GPTNeoXConfig", {k: v for k, v in _b(
        layer_norm_eps=1e-5, hidden_act="gelu", use_parallel_residual=True,
        **rope(10_000.0, partial_rotary_factor=0.25), attention_bias=True).items() if k != "num_key_value_heads"}),
    "phi": ("PhiConfig", _b(layer_norm_eps=1e-5, hidden_act="gelu_new", **rope(10_000.0, partial_rotary_factor=0.5),
                            qk_layernorm=False, resid_pdrop=0.0, embd_pdrop=0.0)),
    "smollm3": ("SmolLM3Config", _b(**RMS, **rope(2_000_000.0), no_rope_layers=[1, 1, 0], tie_word_embeddings=True)),
})



# Norm weights w that multiply as (1 + w): drawn around 0, so the scale is about 1 +- 0.5 like the others'.
ONE_PLUS_NORM = frozenset({"gemma", "gemma2", "gemma3", "nemotron"})
