"""The real engine's unread parameters (capture.engine_model.unread_params): vLLM CPU routes ERNIE-4.5-MoE with a plain
softmax top-k that never reads the checkpoint's `e_score_correction_bias`, which transformers adds before its top-k.
One engine capture in its own process, one 16-token prefill (about a minute)."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphdiff.models.tiny import make_tiny

pytestmark = pytest.mark.engine


def test_the_engine_never_reads_ernie_moe_correction_bias(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from graphdiff.capture.shapes import prefill, with_prompts
    from graphdiff.engines.vllm.process import capture_isolated
    from graphdiff.models.resolve import read_config

    model = make_tiny("ernie4_5_moe", tmp_path / "model", layers=2)
    cap, _, _ = capture_isolated(model, with_prompts([prefill(16)], read_config(model)), tmp_path / "engine")
    moe_layers = sorted({int(name.split(".")[2]) for g in cap.graphs for name in g.inputs.values()
                         if ".mlp.experts." in name})
    assert moe_layers, "no MoE layer in the tiny ERNIE-4.5-MoE"
    assert cap.unread_params == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in moe_layers]
