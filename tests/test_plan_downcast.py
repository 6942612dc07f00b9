"""analysis.plan on hand-made graphs: where an FP32 trainer value that is also downcast is decided."""

from __future__ import annotations

import torch

from graphdiff.analysis.match import Match
from graphdiff.analysis.plan import decide
from graphdiff.analysis.rounding import EngineRounding
from graphdiff.records import Graph, Node


def _node(name: str, target: str, inputs: list[str], dtype: str) -> Node:
    op = "placeholder" if not target else "call_function"
    return Node(name=name, op=op, target=target or name, inputs=inputs, dtype=dtype, shape=[2, 4],
                module="model.layers.0")


def _sites(more_readers: bool, after_rounding: bool = False) -> list[str]:
    """A patched trainer's residual sum held in FP32 (`add`), downcast for a matmul; with `more_readers` the next
    residual add also reads the FP32 sum, or with `after_rounding` its rounded copy upcast again. The engine stores
    that sum in BF16 (its kernel's output)."""
    nodes = [_node("x", "", [], "bfloat16"), _node("y", "", [], "float32"), _node("w", "", [], "bfloat16"),
             _node("add", "aten.add.Tensor", ["x", "y"], "float32"),
             _node("cast", "aten._to_copy.default", ["add"], "bfloat16"),
             _node("mm", "aten.mm.default", ["cast", "w"], "bfloat16")]
    if more_readers:
        nodes.append(_node("add_1", "aten.add.Tensor", ["add", "y"], "float32"))
    if after_rounding:
        nodes += [_node("up", "aten._to_copy.default", ["cast"], "float32"),
                  _node("add_1", "aten.add.Tensor", ["up", "y"], "float32")]
    train = Graph(name="train", nodes=nodes)
    engine = Graph(name="engine", nodes=[_node("e_x", "", [], "bfloat16"), _node("e_y", "", [], "bfloat16"),
                                         _node("e_add", "aten.add.Tensor", ["e_x", "e_y"], "bfloat16")])
    torch.manual_seed(0)
    x, y = torch.randn(2, 4).bfloat16(), torch.randn(2, 4) / 3
    total = x.float() + y
    values = {"x": x, "y": y, "w": torch.randn(4, 4).bfloat16(), "add": total, "cast": total.bfloat16()}
    values["mm"] = values["cast"] @ values["w"]
    if more_readers or after_rounding:
        values["add_1"] = total + y
    if after_rounding:
        values["up"] = values["cast"].float()
    er = EngineRounding(rounded={"e_add": "stored by k as bfloat16"}, replays=[], values={"e_add": total.bfloat16()})
    matches = [Match("add", "e_add", 0.0, 1.0, ""), Match("cast", "e_add", 0.0, 1.0, "")]
    changed = {"cast": 0.5}
    return [d.node for d in decide(train, values, changed, engine, er, matches, []) if d.site]


def test_a_value_read_only_through_its_downcast_is_compared_there() -> None:
    assert _sites(more_readers=False) == []
    assert _sites(more_readers=False, after_rounding=True) == []  # a reader of the rounded copy, upcast again


def test_a_value_another_op_reads_in_fp32_is_a_site_where_the_engine_rounds_it() -> None:
    """Exaone 4's patched residual sum: the MLP reads its BF16 copy (as the engine does), the next residual add
    the FP32 sum (the engine reads its stored BF16 copy)."""
    assert _sites(more_readers=True) == ["add"]
