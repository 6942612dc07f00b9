"""The floor probe runs the engine's own GEMM dispatch and attention op (engine-marked: vLLM's ops, no engine
process) and reports per op the share of rows whose bits change with the rows beside them."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.engine

CONFIG = SimpleNamespace(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         intermediate_size=128, vocab_size=512)


def test_a_row_at_the_same_m_is_the_same_whatever_rows_are_beside_it():
    """Same M, other rows' contents: a GEMM's row does not move (what differs in the probe is M alone)."""
    from graphdiff.measure.floor_ops import gemm_variance

    op, share = gemm_variance(64, 128, rows=48, batch=48)
    assert share == 0.0 and op in ("onednn_mm", "weight_packed_linear", "torch linear")


def test_the_probe_reports_every_linear_shape_and_attention():
    from graphdiff.measure.floor_ops import linear_shapes, probe

    lines = probe(CONFIG, seq=80, prompt_len=16, batch=4)
    shapes = set(linear_shapes(CONFIG).values())
    assert len(lines) == len(shapes) + 1
    assert sum(line.startswith("attention (vLLM CPU decode") for line in lines) == 1
    shares = [int(m.group(1)) for line in lines if (m := re.search(r": (\d+)% of", line))]
    assert len(shares) == len(lines) and shares == sorted(shares, reverse=True)
    assert {"qkv_proj GEMM", "lm_head GEMM"} <= {line.split(" (")[0] for line in lines}
