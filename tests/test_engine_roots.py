"""The engine's graph read in the trainer's terms, from a recorded real scan (fixtures/scans/tiny-gpt_neox-3): vLLM's
Transformers backend names HF's base model `model` where HF names it `gpt_neox`, and Inductor lists, among a
generated kernel's origins, the extern op that reads its buffer and the multi-output op whose getitems it fuses."""

from __future__ import annotations

import operator
from pathlib import Path

import torch

from graphdiff.analysis.match import align_module_roots
from graphdiff.artifacts import ScanDir
from graphdiff.capture.inductor_hooks import _last_origin
from graphdiff.codegen import generate

NEOX = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-gpt_neox-3"


def test_engine_modules_under_another_root_take_the_trainers_names() -> None:
    train, engine = ScanDir(NEOX).load_train(), ScanDir(NEOX).load_engine_graphs()
    assert engine is not None
    # the scan directory keeps the engine graph as analysed; the engine's capture names the root `model`
    for g in engine.graphs:
        for n in g.nodes:
            n.module = n.module and "model" + n.module.removeprefix("gpt_neox")
    assert align_module_roots(train.graphs[0], engine.graphs) == {"model": "gpt_neox"}
    ours = {n.module for g in engine.graphs for n in g.nodes if n.module}
    theirs = {n.module for n in train.graphs[0].nodes if n.module}
    assert "gpt_neox.layers.0.mlp.dense_h_to_4h" in ours and ours & theirs >= {"gpt_neox.layers.2.attention.dense"}
    assert align_module_roots(train.graphs[0], engine.graphs) == {}  # already the trainer's: nothing to rename


def test_a_feature_size_equal_to_the_token_count_does_not_refuse_the_region(tmp_path: Path) -> None:
    made = generate(NEOX, tmp_path / "patch", exact=True)
    rope = next(r for r in made.regions if r.name == "gpt_neox.layers.*.attention#rope")
    assert rope.generated, rope.reason


def _graph_with_extern_reader() -> torch.fx.Graph:
    """x -> var_mean -> (var, mean) -> (x - mean) * rsqrt(var) -> a custom op reading it (as onednn_mm does)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    vm = g.call_function(torch.ops.aten.var_mean.correction, (x, [1]), {"correction": 0, "keepdim": True})
    var, mean = (g.call_function(operator.getitem, (vm, i)) for i in (0, 1))
    out = g.call_function(torch.ops.aten.mul.Tensor, (g.call_function(torch.ops.aten.sub.Tensor, (x, mean)),
                                                      g.call_function(torch.ops.aten.rsqrt.default, (var,))))
    g.call_function(torch.ops.graphdiff_test.reader.default, (out,))
    return g


@torch.library.custom_op("graphdiff_test::reader", mutates_args=())
def _reader(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def test_a_generated_buffers_value_is_its_last_computed_node() -> None:
    g = _graph_with_extern_reader()
    nodes = {str(n.target).split(".")[1] if n.op == "call_function" and n.target is not operator.getitem else n.name: n
             for n in g.nodes}
    reader = nodes["reader"]
    # Inductor's origins of the normalized buffer: var_mean (its getitems are not listed) and the extern reading it
    origins = {nodes["var_mean"], nodes["sub"], nodes["rsqrt"], nodes["mul"], reader}
    assert _last_origin(origins, generated=True) is nodes["mul"]
    assert _last_origin(origins - {reader}, generated=True) is nodes["mul"]
    assert _last_origin(origins) is reader  # an extern call's buffer is the op's own value
