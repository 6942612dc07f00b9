"""The trainer's FP32 re-run of a matmul with a large operand, upcast a block at a time."""

from __future__ import annotations

import torch

from graphdiff.analysis import rounding


def test_a_large_matmul_is_rerun_in_fp32_blockwise_with_the_same_result(monkeypatch) -> None:
    torch.manual_seed(0)
    a, b = torch.randn(5, 64).bfloat16(), torch.randn(64, 1000).bfloat16()
    whole = a.float() @ b.float()
    monkeypatch.setattr(rounding, "FP32_CHUNK", 64 * 96)  # 96 columns at a time: 11 blocks, the last one short
    got = rounding.mm_fp32_chunked(a, b)
    assert got.dtype == torch.float32 and got.shape == whole.shape
    assert torch.allclose(got, whole, rtol=1e-6, atol=1e-6)


def test_an_uninitialized_allocation_and_its_views_get_no_glue_value() -> None:
    """The attention output buffer (`empty`, written by the attention extern) with no recorded load: evaluating it
    gave `torch.empty`'s memory to it and its views, and the matcher then matched Qwen2-MoE's last residual sum to
    that garbage in some runs (not in others)."""
    from graphdiff.analysis.rounding import _evaluate_glue
    from graphdiff.records import Graph, Node

    nodes = [Node(name="n", op="placeholder", target="n", sym="s0"),
             Node(name="empty", op="call_function", target="aten.empty.memory_format", inputs=["n"],
                  call=[[[{"node": "n"}, 8]], {"dtype": {"dtype": "bfloat16"}}], dtype="bfloat16", shape=["s0", 8]),
             Node(name="view", op="call_function", target="aten.reshape.default", inputs=["empty"],
                  call=[[{"node": "empty"}, [-1]], {}], dtype="bfloat16", shape=[64]),
             Node(name="cast", op="call_function", target="prims.convert_element_type.default", inputs=["x"],
                  call=[[{"node": "x"}, {"dtype": "float32"}], {}], dtype="float32", shape=[4]),
             Node(name="x", op="placeholder", target="x", dtype="bfloat16", shape=[4])]
    graph = Graph(name="g", nodes=nodes)
    values: dict = {}
    seen = {"x": torch.ones(4)}
    _evaluate_glue(graph, set(), values, seen, {"k": {"in": {}, "out": {}, "scalars": {"s0": 8}}})
    assert "empty" not in values and "view" not in values
    assert torch.equal(values["cast"], torch.ones(4))  # other glue still evaluated


def test_a_split_outside_every_kernel_gives_its_pieces_values() -> None:
    """A fused QKV GEMM's output split in glue, the V piece read only by the attention op: the piece is what the
    trainer's v_proj output matches. Without a value for it, the matcher paired v_proj with a same-sized slice of Q
    whose sorted values happened to lie within the tolerance, and the departure search named a false departure."""
    from graphdiff.analysis.rounding import _evaluate_glue
    from graphdiff.records import Graph, Node

    nodes = [Node(name="qkv", op="placeholder", target="qkv", dtype="bfloat16", shape=[4, 12]),
             Node(name="split", op="call_function", target="aten.split_with_sizes.default", inputs=["qkv"],
                  call=[[{"node": "qkv"}, [6, 3, 3], -1], {}]),
             Node(name="v", op="call_function", target="getitem", inputs=["split"],
                  call=[[{"node": "split"}, 2], {}], dtype="bfloat16", shape=[4, 3])]
    qkv = torch.arange(48, dtype=torch.bfloat16).reshape(4, 12)
    values: dict = {}
    _evaluate_glue(Graph(name="g", nodes=nodes), set(), values, {"qkv": qkv}, {})
    assert "split" not in values  # a tuple of views is no value the matcher compares
    assert torch.equal(values["v"], qkv[:, 9:])
