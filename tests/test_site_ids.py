"""Site ids come from the model's code (module path, source line, the op's position on it), so they do not move
when the trainer is traced on another number of tokens or when another kind is found in the same module."""

from __future__ import annotations

from graphdiff.analysis.plan import stable_ids
from graphdiff.capture.hf import capture_hf
from graphdiff.records import Graph, Node, Source


def test_ids_of_every_trainer_node_are_the_same_at_16_and_64_tokens(tiny_models):
    ids = {}
    for n in (16, 64):
        cap, _ = capture_hf(tiny_models["qwen3"], num_tokens=n)
        g = cap.graphs[0]
        ids[n] = {i: g.node_map()[name].target for name, i in stable_ids(g).items()}
    # make_fx numbers nodes afresh at each length; the ids, and what each id names, stay
    assert ids[16] == ids[64]
    assert "model.layers.0.mlp.act_fn/activations.py:103/silu.0" in ids[16] or any(
        i.startswith("model.layers.0.mlp.act_fn/") and i.endswith("/silu.0") for i in ids[16])


def test_an_id_counts_only_its_own_op_on_its_own_line():
    def node(name: str, target: str, line: int) -> Node:
        return Node(name=name, op="call_function", target=target, module="m.layers.0.norm",
                    source=Source(file="/x/modeling.py", line=line))

    g = Graph(name="g", nodes=[node("a", "aten.mul.Tensor", 5), node("b", "aten.add.Tensor", 5),
                               node("c", "aten.mul.Tensor", 5), node("d", "aten.mul.Tensor", 6)])
    ids = stable_ids(g)
    assert ids == {"a": "m.layers.0.norm/modeling.py:5/mul.0", "b": "m.layers.0.norm/modeling.py:5/add.0",
                   "c": "m.layers.0.norm/modeling.py:5/mul.1", "d": "m.layers.0.norm/modeling.py:6/mul.0"}
    # another op inserted on the line (another decomposition of an unrelated op) does not rename the muls
    g.nodes.insert(1, node("e", "aten.sub.Tensor", 5))
    assert {k: v for k, v in stable_ids(g).items() if k != "e"} == ids
