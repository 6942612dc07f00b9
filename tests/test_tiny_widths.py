"""Tiny checkpoints at another width (`make-tiny --hidden`): the shapes the engine builds for them."""

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
