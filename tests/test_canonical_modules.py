"""Engine node modules named as the model names them (capture.engine_model.canonical_modules), on a module tree shaped
like vLLM's Qwen2-MoE block: its fused MoE calls the block's shared expert through a closure, and Dynamo records that
access path (recorded from `graphdiff scan` of the tiny qwen2_moe checkpoint on vLLM CPU 0.32.0)."""

from __future__ import annotations

from torch import nn

from graphdiff.capture.engine_model import canonical_modules
from graphdiff.records import Graph, Node

RECORDED = ("model.layers.0.mlp.experts._shared_experts._mk_can_overlap_shared_experts.__closure__.0.cell_contents."
            "_shared_experts._layer")


class _Runner(nn.Module):  # holds the shared expert unregistered, as vLLM's shared-experts wrapper does
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.__dict__["_layer"] = shared


class _FusedMoE(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        owner = nn.Module()
        owner.__dict__["_shared_experts"] = _Runner(shared)

        def _mk_can_overlap_shared_experts() -> nn.Module:
            return owner

        self.__dict__["_shared_experts"] = nn.Module()
        self._shared_experts.__dict__["_mk_can_overlap_shared_experts"] = _mk_can_overlap_shared_experts


def test_a_module_reached_through_a_closure_takes_the_name_the_model_registers_it_under() -> None:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    block = model.model.layers[0].mlp = nn.Module()
    block.shared_expert = nn.Module()
    block.shared_expert.act_fn = nn.SiLU()
    block.experts = _FusedMoE(block.shared_expert)

    def node(name: str, module: str | None) -> Node:
        return Node(name=name, op="call_function", target="aten.silu.default", inputs=[], module=module)

    rotary = nn.Module()  # one rotary embedding registered in every layer, as vLLM's cached one is
    model.model.layers.append(nn.Module())
    for layer in model.model.layers:
        layer.self_attn = nn.Module()
        layer.self_attn.rotary_emb = rotary

    graph = Graph(name="g", nodes=[node("silu", f"{RECORDED}.act_fn"), node("sigmoid", RECORDED),
                                   node("add", "model.layers.0.mlp.experts"), node("lost", "model.layers.0.gone.x"),
                                   node("none", None), node("rope", "model.layers.1.self_attn.rotary_emb")])
    canonical_modules(graph, model)
    assert [n.module for n in graph.nodes] == ["model.layers.0.mlp.shared_expert.act_fn",
                                               "model.layers.0.mlp.shared_expert", "model.layers.0.mlp.experts",
                                               "model.layers.0.gone.x", None, "model.layers.1.self_attn.rotary_emb"]
