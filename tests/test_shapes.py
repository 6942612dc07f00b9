"""`--shapes`: parsing, the default set, and refusals before any engine starts."""

from __future__ import annotations

import pytest

from graphdiff.capture.shapes import check_shapes, default_shapes, engine_limits, parse_shapes, with_prompts
from graphdiff.errors import GraphdiffError
from tests.test_cli_errors import one_error_line, run_cli


def test_shapes_parse_prefills_and_decode_steps():
    shapes = parse_shapes("16, 2048,decode:8x64,prefill:512,16", tokens=16)
    assert [s.label for s in shapes] == ["prefill-16", "prefill-2048", "decode-8x64", "prefill-512"]
    d = shapes[2]
    assert (d.phase, d.tokens, d.sequences, d.context) == ("decode", 8, 8, 64)
    assert [s.label for s in parse_shapes("decode:2x10", tokens=32)] == ["prefill-32", "decode-2x10"]
    with pytest.raises(GraphdiffError, match="cannot read 'decode:8'"):
        parse_shapes("decode:8", 16)


def test_the_default_shapes_cover_long_prefills_and_a_batched_decode_within_the_model():
    assert [s.label for s in default_shapes(16, {"max_position_embeddings": 4096})] == [
        "prefill-16", "prefill-512", "prefill-2048", "decode-8x64"]
    assert [s.label for s in default_shapes(16, {"max_position_embeddings": 1024})] == [
        "prefill-16", "prefill-512", "decode-8x64"]


def test_a_shape_beyond_the_models_positions_is_refused():
    with pytest.raises(GraphdiffError, match="needs 4098 positions"):
        check_shapes(parse_shapes("4097", 16), {"max_position_embeddings": 4096})
    check_shapes(parse_shapes("4094,decode:4x4000", 16), {"max_position_embeddings": 4096})


def test_prompts_are_seeded_and_the_engine_is_sized_for_every_shape():
    shapes = with_prompts(parse_shapes("16,300,decode:4x50", 16), {"vocab_size": 2048})
    again = with_prompts(parse_shapes("16,300,decode:4x50", 16), {"vocab_size": 2048})
    assert [s.prompts for s in shapes] == [s.prompts for s in again]
    assert [len(p) for p in shapes[2].prompts] == [50] * 4
    limits = engine_limits(shapes)
    assert limits["max_model_len"] >= 302 and limits["max_num_batched_tokens"] >= 300 and limits["max_num_seqs"] >= 4


def test_scan_refuses_bad_lengths_and_outputs_in_one_line_before_the_engine(tmp_path):
    msg = one_error_line(run_cli("scan", "tiny:qwen3", "--tokens", "5000", "--out", str(tmp_path / "o")))
    assert "needs 5001 positions" in msg and "4096" in msg
    assert "cannot read" in one_error_line(run_cli("scan", "tiny:qwen3", "--shapes", "16,x", "--out",
                                                   str(tmp_path / "o")))
    blocker = tmp_path / "file"
    blocker.write_text("keep me")
    assert "is a file" in one_error_line(run_cli("scan", "tiny:qwen3", "--out", str(blocker / "sub")))
    assert blocker.read_text() == "keep me"
    assert "not writable" in one_error_line(run_cli("scan", "tiny:qwen3", "--out", "/proc/graphdiff-scan"))
