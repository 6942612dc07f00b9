"""analysis.departure on hand-made graphs: the first matched low-precision value that differs, per engine graph."""

from __future__ import annotations

import torch

from graphdiff.analysis.departure import differing, first_departure
from graphdiff.analysis.match import Match
from graphdiff.records import Graph, Node


def _n(name: str, module: str, inputs: tuple[str, ...] = ("x", "w")) -> Node:
    return Node(name=name, op="call_function", target="aten.mm.default", dtype="bfloat16", shape=[2, 4], module=module,
                inputs=list(inputs))


X = Node(name="x", op="placeholder", target="x", dtype="bfloat16")  # the forward's input
W = Node(name="w", op="placeholder", target="w", dtype="bfloat16", param="model.layers.0.mlp.weight")


def _graphs() -> tuple[Graph, list[Graph]]:
    train = Graph(name="train", nodes=[X, W, _n("mm", "model.layers.0.mlp"), _n("mm_1", "model.layers.1.mlp")])
    # a piecewise engine: both pieces have a node called arg4_1 (buffer names are per graph)
    pieces = [Graph(name=f"piece{i}", nodes=[Node(name="arg4_1", op="placeholder", target="", dtype="bfloat16")])
              for i in range(2)]
    return train, pieces


def test_values_are_compared_with_the_graph_they_were_matched_in() -> None:
    train, pieces = _graphs()
    a, b = torch.randn(2, 4).bfloat16(), torch.randn(2, 4).bfloat16()
    matched = {"piece0": ([Match("mm", "arg4_1", 0.0, 1.0, "")], []),
               "piece1": ([Match("mm_1", "arg4_1", 0.0, 1.0, "")], [])}
    values = {"piece0": {"arg4_1": a}, "piece1": {"arg4_1": b}}
    assert first_departure(train, {"mm": a, "mm_1": b}, matched, pieces, values) is None
    c = b.clone()
    c[1, 2] += 1
    left = first_departure(train, {"mm": a, "mm_1": c}, matched, pieces, values)
    assert left is not None and left.node == "mm_1" and left.engine_graph == "piece1" and left.first_row == 1
    assert left.equal_before == 1 and left.differing == 1 / 8



def test_a_value_of_the_weights_alone_is_no_departure() -> None:
    """A splice's own transform of a weight (padded and packed expert weights) is not a value of the forward."""
    _, pieces = _graphs()
    train = Graph(name="train", nodes=[X, W, _n("packed", "model.layers.0.mlp", ("w",)),
                                       _n("mm", "model.layers.0.mlp")])
    a, other = torch.randn(2, 4).bfloat16(), torch.randn(2, 4).bfloat16()
    matched = {"piece0": ([Match("packed", "arg4_1", 0.0, 1.0, ""), Match("mm", "arg4_1", 0.0, 1.0, "")], [])}
    values = {"piece0": {"arg4_1": a}}
    assert first_departure(train, {"packed": other, "mm": a}, matched, pieces, values) is None
    left = first_departure(train, {"packed": a, "mm": other}, matched, pieces, values)
    assert left is not None and left.node == "mm"


def test_a_gemm_output_is_named_by_the_extern_that_writes_its_allocation() -> None:
    """vLLM CPU's `_C.onednn_mm(out, x, weight, bias)` writes into an `aten.empty`: a departure there names that
    extern's call, not "?" nor the generated kernel Inductor lists the allocation under (a neighbour's)."""
    train, _ = _graphs()
    out = Node(name="empty_2", op="call_function", target="aten.empty.memory_format", dtype="bfloat16", shape=[2, 4],
               inputs=[], kernel="cpp_fused_add_native_layer_norm_onednn_mm_1:6")
    gemm = Node(name="onednn_mm_default", op="call_function", target="_C.onednn_mm.default", inputs=["empty_2", "x"],
                kernel="torch.ops._C.onednn_mm.default:5")
    engine = Graph(name="g", nodes=[X, out, gemm])
    a = torch.randn(2, 4).bfloat16()
    left = first_departure(train, {"mm": a}, {"g": ([Match("mm", "empty_2", 0.0, 1.0, "")], [])}, [engine],
                           {"g": {"empty_2": a + 1}})
    assert left is not None and left.kernel == "torch.ops._C.onednn_mm.default:5"


def test_the_departure_names_the_ops_between_the_values_that_agree_and_the_first_that_differs() -> None:
    """An op whose value is not compared (attention) parts first and a GEMM downstream is the first compared value
    that differs: the departure says its compared input agrees and names the ops between, attention included."""
    _, pieces = _graphs()
    attn = Node(name="attn", op="call_function", target="aten._scaled_dot_product_flash_attention_for_cpu.default",
                dtype="bfloat16", shape=[2, 4], module="model.layers.0.self_attn", inputs=["q", "q", "q"])
    view = Node(name="view", op="call_function", target="aten.view.default", dtype="bfloat16", shape=[2, 4],
                module="model.layers.0.self_attn", inputs=["attn"])
    train = Graph(name="train", nodes=[X, W, _n("q", "model.layers.0.self_attn.q_proj"), attn, view,
                                       _n("o", "model.layers.0.self_attn.o_proj", ("view", "w"))])
    a, b = torch.randn(2, 4).bfloat16(), torch.randn(2, 4).bfloat16()
    matched = {"piece0": ([Match("q", "arg4_1", 0.0, 1.0, "")], []),
               "piece1": ([Match("o", "arg4_1", 0.0, 1.0, "")], [])}
    values = {"piece0": {"arg4_1": a}, "piece1": {"arg4_1": b}}
    left = first_departure(train, {"q": a, "o": b + 1}, matched, pieces, values)
    assert left is not None and left.node == "o" and left.inputs_agree == ["q"]
    assert left.cause_ops == ["attn", "view", "o"]
    assert left.cause == "self_attn: _scaled_dot_product_flash_attention_for_cpu; o_proj: mm", left.cause


def test_a_value_only_moved_from_agreeing_values_is_no_departure() -> None:
    """Falcon's fused qkv GEMM agrees; its value heads (`qkv[:, :, :, [-1]]`, an index) were matched to the engine's
    key heads, another slice of the same GEMM. Data movement of agreeing values cannot differ: that pairing is
    another quantity, not the departure, and the departure is the residual add the engine folds into one addmm,
    whose walk goes through the value heads to the GEMM."""
    qkv = _n("qkv", "model.layers.0.self_attention.query_key_value")
    key = Node(name="key", op="call_function", target="aten.index.Tensor", dtype="bfloat16", shape=[2, 2],
               module="model.layers.0.self_attention", inputs=["qkv"])
    value = key.model_copy(update={"name": "value"})
    out = Node(name="add_", op="call_function", target="aten.add_.Tensor", dtype="bfloat16", shape=[2, 2],
               module="model.layers.0", inputs=["key", "value"])
    train = Graph(name="train", nodes=[X, W, qkv, key, value, out])
    q = torch.randn(2, 4).bfloat16()
    k, v = q[:, :2].contiguous(), q[:, 2:].contiguous()
    total = k + v
    matched = {"piece0": ([Match("qkv", "qkv", 0.0, 1.0, ""), Match("key", "k", 0.0, 1.0, ""),
                           Match("value", "k", 0.01, 1.0, ""), Match("add_", "addmm", 0.0, 1.0, "")], [])}
    values = {"piece0": {"qkv": q, "k": k, "addmm": total + 1}}
    engine = Graph(name="piece0", nodes=[Node(name=n, op="placeholder", target="", dtype="bfloat16")
                                         for n in ("qkv", "k", "addmm")])
    left = first_departure(train, {"qkv": q, "key": k, "value": v, "add_": total}, matched, [engine], values)
    assert left is not None and left.node == "add_", left
    assert left.inputs_agree == ["qkv", "key"] and left.cause_ops == ["value", "add_"] and left.cause == "0: add_"


def test_values_in_one_layout_are_compared_element_by_element_with_their_row() -> None:
    """More than half the elements differing is no evidence of another layout: the share is that of the trainer's
    element order, with its first row, where no other order of its dims does better (GPT-2's c_proj, unpatched:
    77% in one layout, where sorted values said 60% and "layouts differ")."""
    t = torch.arange(1, 65, dtype=torch.float32).reshape(8, 8).bfloat16()
    e = t.clone()
    e[1:] += 1  # 56 of 64 elements differ, from row 1
    assert differing(t, e) == (56 / 64, 1)


def test_values_in_another_layout_are_compared_in_the_engines_order() -> None:
    """A trainer value [1, heads, tokens, dim] against the engine's [tokens, heads, dim]: the trainer's dims are
    permuted into the engine's order and the share counted there, not over sorted values."""
    t = torch.randn(1, 4, 16, 8).bfloat16()
    e = t[0].transpose(0, 1).contiguous()
    assert differing(t, e) == (0.0, None)
    e[0, 0, 0] += 10  # one element, which shifts many positions of the sorted values
    assert differing(t, e) == (1 / t.numel(), None)


def test_a_moved_value_is_a_departure_where_its_engine_value_is_no_other_trainer_value() -> None:
    """OLMo 2's rotate_half (`cat(-x2, x1)` of the agreeing q norm output) differs from the engine's in one element:
    the engine's cat reads its own stored copy of the halves. No other trainer value holds that engine value, so
    the pairing stands and the cat is the departure."""
    q = _n("q", "model.layers.0.self_attn.q_norm")
    neg = Node(name="neg", op="call_function", target="aten.neg.default", dtype="bfloat16", shape=[2, 4],
               module="model.layers.0.self_attn", inputs=["q"])
    cat = Node(name="cat", op="call_function", target="aten.cat.default", dtype="bfloat16", shape=[2, 8],
               module="model.layers.0.self_attn", inputs=["neg", "q"])
    train = Graph(name="train", nodes=[X, W, q, neg, cat])
    a = torch.randn(2, 4).bfloat16()
    rotated = torch.cat([-a, a], -1)
    theirs = rotated.clone()
    theirs[1, 5] += 1
    engine = Graph(name="g", nodes=[Node(name=n, op="placeholder", target="", dtype="bfloat16") for n in ("q", "c")])
    matched = {"g": ([Match("q", "q", 0.0, 1.0, ""), Match("cat", "c", 0.0, 1.0, "")], [])}
    left = first_departure(train, {"q": a, "neg": -a, "cat": rotated}, matched, [engine],
                           {"g": {"q": a, "c": theirs}})
    assert left is not None and left.node == "cat" and left.first_row == 1 and left.inputs_agree == ["q"]
    assert left.cause == "self_attn: neg, cat", left.cause


def test_the_departure_also_names_what_the_engine_computes_between_the_same_values() -> None:
    """Nemotron at hidden 320 on vLLM CPU's `_C_AVX2` build (recorded op names): the trainer's o_proj GEMM and the
    residual add part from the engine, which folds both into one addmm tagged with the norm after them; the
    departure names the engine's ops between the agreeing values too, so a user sees the addmm."""
    def node(name: str, target: str, module: str, inputs: list[str]) -> Node:
        return Node(name=name, op="call_function", target=target, dtype="bfloat16", shape=[2, 4], module=module,
                    inputs=inputs)

    res = "model.layers.0"
    train = Graph(name="train", nodes=[X, W, node("attn", "aten.mm.default", f"{res}.self_attn.v_proj", ["x", "w"]),
                                       node("o", "aten.mm.default", f"{res}.self_attn.o_proj", ["attn", "w"]),
                                       node("add", "aten.add.Tensor", res, ["x", "o"]),
                                       node("norm", "aten.mul.Tensor", f"{res}.post_attention_layernorm", ["add"])])
    engine = Graph(name="g", nodes=[X, W, node("v", "aten.mm.default", f"{res}.self_attn.qkv_proj", ["x", "w"]),
                                    node("out", "aten.empty.memory_format", f"{res}.self_attn.attn", []),
                                    node("addmm", "aten.addmm.default", f"{res}.post_attention_layernorm",
                                         ["x", "out", "w"]),
                                    node("normed", "aten.mul.Tensor", f"{res}.post_attention_layernorm", ["addmm"])])
    a, b = torch.randn(2, 4).bfloat16(), torch.randn(2, 4).bfloat16()
    matched = {"g": ([Match("attn", "v", 0.0, 1.0, ""), Match("norm", "normed", 0.0, 1.0, "")], [])}
    left = first_departure(train, {"attn": a, "norm": b + 1}, matched, [engine], {"g": {"v": a, "normed": b}})
    assert left is not None and left.node == "norm" and left.inputs_agree == ["attn"]
    assert left.cause == "o_proj: mm; 0: add; post_attention_layernorm: mul", left.cause
    assert left.engine_cause == "post_attention_layernorm: addmm, mul", left.engine_cause


def test_a_gemm_paired_with_another_gemms_engine_value_is_no_departure() -> None:
    """One K/V head of 128: the matcher paired the value projection's GEMM with the engine's key, whose sorted values
    it does not tell from the value's. The key projection's GEMM is bit-identical to that engine value, so the
    value's pairing is with another quantity and no departure; a GEMM downstream that differs still is one."""
    _, pieces = _graphs()
    train = Graph(name="train", nodes=[X, W, _n("k", "model.layers.0.self_attn.k_proj"),
                                       _n("v", "model.layers.0.self_attn.v_proj"), _n("mm_1", "model.layers.1.mlp")])
    key, value, down = (torch.randn(2, 4).bfloat16() for _ in range(3))
    matched = {"piece0": ([Match("k", "arg4_1", 0.0, 1.0, ""), Match("v", "arg4_1", 0.0075, 1.0, "")], []),
               "piece1": ([Match("mm_1", "arg4_1", 0.0, 1.0, "")], [])}
    values = {"piece0": {"arg4_1": key}, "piece1": {"arg4_1": down}}
    assert first_departure(train, {"k": key, "v": value, "mm_1": down}, matched, pieces, values) is None
    left = first_departure(train, {"k": key, "v": value, "mm_1": down + 1}, matched, pieces, values)
    assert left is not None and left.node == "mm_1"
    alone = {"piece0": ([Match("v", "arg4_1", 0.0075, 1.0, "")], []), "piece1": ([], [])}
    left = first_departure(train, {"k": key, "v": value, "mm_1": down}, alone, pieces, values)
    assert left is not None and left.node == "v"  # no other trainer value holds it: a departure
