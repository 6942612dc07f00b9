"""The matcher's layer rule (the false engine-only residual site of a long scan, issue 14)."""

from __future__ import annotations

import torch

from graphdiff.analysis.match import TOLERANCE, match_values, quantile_index
from graphdiff.records import Graph, Node


def _node(name: str, module: str, target: str = "aten.add.Tensor") -> Node:
    return Node(name=name, op="call_function", target=target, module=module, dtype="float32", shape=[64])


def test_a_much_closer_value_in_the_next_layer_beats_a_merely_tolerable_one_in_the_own_layer():
    """The trainer's layer-0 residual sum, recomputed by the engine in layer 1's norm kernel (distance ~1e-4), must
    not be paired with an own-layer value that only happens to lie within the tolerance (the down_proj output that
    dominates a long prompt's residual: ~1.3e-2 at 500 tokens)."""
    gen = torch.Generator().manual_seed(0)
    residual = torch.randn(64, generator=gen)
    train = Graph(name="t", nodes=[_node("add_8", "model.layers.0")])
    engine = Graph(name="e", nodes=[_node("empty_4", "model.layers.0.mlp.down_proj", "aten.empty.memory_format"),
                                    _node("add_352", "model.layers.1.input_layernorm")])
    close = residual * (1 + 1e-4)
    tolerable = residual + 0.8 * TOLERANCE * residual.norm() / 8 * torch.randn(64, generator=gen)
    values = {"empty_4": tolerable, "add_352": close}
    (m,), _ = match_values(train, {"add_8": residual}, engine, values)
    assert m.engine == "add_352"
    # with no better candidate elsewhere the own layer still wins
    (m,), _ = match_values(train, {"add_8": residual}, engine, {"empty_4": tolerable})
    assert m.engine == "empty_4"


def test_a_one_value_made_from_parameters_is_matched_to_the_engine_value_of_the_same_parameters():
    """xIELU's `softplus(alpha_p)` and `softplus(alpha_n)` (one value each, recorded shapes and names of a tiny Apertus
    on vLLM CPU) lie within the tolerance of each other: each is paired with the engine value made from its own
    parameter (the decomposed softplus's `where`); one that reads an activation is not matched by value alone."""
    def node(name: str, target: str, inputs: list[str], op: str = "call_function") -> Node:
        return Node(name=name, op=op, target=target, inputs=inputs, module="model.layers.0.mlp.act_fn",
                    dtype="float32", shape=[1])

    act = "model.layers.0.mlp.act_fn"
    train = Graph(name="t", inputs={"a": f"{act}.alpha_p", "b": f"{act}.alpha_n"},
                  nodes=[node("a", "a", [], "placeholder"), node("b", "b", [], "placeholder"),
                         node("x", "x", [], "placeholder"),
                         node("softplus", "aten.softplus.default", ["a"]),
                         node("softplus_1", "aten.softplus.default", ["b"]),
                         node("scaled", "aten.mul.Tensor", ["softplus", "x"])])
    engine = Graph(name="e", inputs={"p": f"{act}.alpha_p", "n": f"{act}.alpha_n"},
                   nodes=[node("p", "p", [], "placeholder"), node("n", "n", [], "placeholder"),
                          node("where", "aten.where.self", ["p"]), node("cast", "prims.convert_element_type", ["n"]),
                          node("where_1", "aten.where.self", ["cast"])])
    values = {"where": torch.tensor([0.69385]), "cast": torch.tensor([-0.0015]), "where_1": torch.tensor([0.69238])}
    train_values = {"softplus": torch.tensor([0.6938]), "softplus_1": torch.tensor([0.6914]),
                    "scaled": torch.tensor([0.7])}
    matches, _ = match_values(train, train_values, engine, values)
    assert {m.train: m.engine for m in matches} == {"softplus": "where", "softplus_1": "where_1"}


def test_fingerprint_quantiles_stay_inside_values_past_float32s_integers() -> None:
    """A prefill of 2048 tokens at a vocabulary of 32000 has 65536000 logits: float32 rounds the last index,
    65535999, up to 65536000 (past the end). Every index is in range and the last one is the last value."""
    for numel in (2**24 + 4, 2048 * 32000, 4096 * 151936):
        index = quantile_index(numel, 4096)
        assert int(index[0]) == 0 and int(index[-1]) == numel - 1
        assert bool((index[1:] > index[:-1]).all())
