"""Tiny checkpoints at another shape (`make-tiny --hidden --head-dim --vocab`): the shapes the engine builds."""

from __future__ import annotations

import json

from graphdiff.models.tiny import make_tiny


def test_falcon_widened_keeps_the_mlp_width_vllm_builds(tmp_path) -> None:
    """vLLM's Falcon MLP is 4 x hidden whatever `ffn_hidden_size` says (the recipe's 1024 is that at hidden 256):
    at hidden 384 the checkpoint's MLP must be 1536 wide, or vLLM refuses to load it."""
    out = make_tiny("falcon", tmp_path / "falcon", layers=1, hidden=384)
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 384 and config["ffn_hidden_size"] == 4 * 384
    assert config["num_attention_heads"] == 6 and config["num_kv_heads"] == 2
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert shapes["transformer.h.0.mlp.dense_h_to_4h.weight"] == [1536, 384]


def test_head_size_and_vocab_reach_every_field_the_recipe_sets(tmp_path) -> None:
    """Real checkpoints have heads of 128 and vocabularies of tens of thousands: the widened recipe sets the head
    size, the head counts that follow from it and the vocabulary, in the field names each config class spells."""
    for arch, heads_key in (("qwen3", "num_attention_heads"), ("gpt2", "n_head")):
        out = make_tiny(arch, tmp_path / arch, layers=1, hidden=512, head_dim=128, vocab=4000)
        config = json.loads((out / "config.json").read_text())
        assert config[heads_key] == 4 and config["vocab_size"] == 4000
        assert config.get("head_dim", 128) == 128
    qwen3 = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    assert qwen3["num_key_value_heads"] == 1 and qwen3["intermediate_size"] == 1408


def test_vocab_alone_keeps_the_recipe_heads(tmp_path) -> None:
    """`make-tiny ARCH --vocab V` changes the vocabulary only: the recipe's head layout (qwen3's K/V heads) stays."""
    plain = json.loads((make_tiny("qwen3", tmp_path / "plain", layers=1) / "config.json").read_text())
    wide = json.loads((make_tiny("qwen3", tmp_path / "wide", layers=1, vocab=4000) / "config.json").read_text())
    assert wide["vocab_size"] == 4000 and plain["vocab_size"] != 4000
    assert {k: v for k, v in wide.items() if k != "vocab_size"} == {k: v for k, v in plain.items() if k != "vocab_size"}
