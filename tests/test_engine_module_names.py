"""Engine node modules named as the model names them (capture.engine_model.canonical_modules), on a module tree
shaped like vLLM's GLM-4-MoE layer: its shared experts are registered as `mlp.shared_experts` but called through a
closure of the fused-MoE layer, the path Dynamo records (as in the capture of `graphdiff scan` of the tiny glm4_moe
checkpoint on vLLM CPU 0.32.0)."""

from __future__ import annotations

from torch import nn

from graphdiff.capture.engine_model import canonical_modules
from graphdiff.records import Graph, Node

CLOSURE = "model.layers.0.mlp.experts._shared_experts._mk_can_overlap_shared_experts.__closure__.0.cell_contents"


class _Runner(nn.Module):
    """Holds the shared experts only through a closure, as vLLM's fused-MoE runner does."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        holder = nn.Module()
        holder._layer = shared

        def _mk_can_overlap_shared_experts() -> nn.Module:
            return holder

        self._mk_can_overlap_shared_experts = _mk_can_overlap_shared_experts


def _model() -> nn.Module:
    m = nn.Module()
    m.model = nn.Module()
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.shared_experts = nn.Module()
    layer.mlp.shared_experts.gate_up_proj = nn.Linear(4, 8)
    layer.mlp.experts = nn.Module()
    layer.mlp.experts._shared_experts = _Runner(layer.mlp.shared_experts)
    m.model.layers = nn.ModuleList([layer])
    return m


def _graph(*modules: str | None) -> Graph:
    return Graph(name="g", nodes=[Node(name=f"n{i}", op="call_function", target="aten.mm.default", module=m)
                                  for i, m in enumerate(modules)])


def test_a_module_reached_through_a_closure_gets_its_registered_name() -> None:
    graph = _graph(f"{CLOSURE}._layer.gate_up_proj", f"{CLOSURE}._layer")
    canonical_modules(graph, _model())
    assert [n.module for n in graph.nodes] == ["model.layers.0.mlp.shared_experts.gate_up_proj",
                                               "model.layers.0.mlp.shared_experts"]


def test_paths_that_name_a_module_or_resolve_to_none_are_left_as_they_are() -> None:
    kept = ["model.layers.0.mlp.experts", "model.layers.0.mlp.experts._shared_experts", None,
            "model.layers.0.mlp.nowhere", f"{CLOSURE}.missing"]
    graph = _graph(*kept)
    canonical_modules(graph, _model())
    assert [n.module for n in graph.nodes] == kept
