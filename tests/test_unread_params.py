"""Engine parameters loaded but never read by the compiled graphs (capture.engine_model.unread_params), on a module tree
shaped like vLLM's ERNIE-4.5-MoE / GLM-4-MoE layers, with graph input names as the real captures name them
(recorded from `graphdiff scan` of the tiny ernie4_5_moe and glm4_moe checkpoints on vLLM CPU 0.32.0)."""

from __future__ import annotations

import torch
from torch import nn

from graphdiff.capture.engine_model import unread_params
from graphdiff.records import Graph


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0))  # packed away: vLLM keeps an empty parameter
        self.e_score_correction_bias = nn.Parameter(torch.tensor([0.3, -0.1, 0.2, 0.0]))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.gate = _Gate()
        self.mlp.experts = nn.Module()
        self.mlp.experts.w13_weight = nn.Parameter(torch.ones(4, 8, 4))
        self.mlp.experts.shared = nn.Linear(4, 4)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(4))


def _model() -> nn.Module:
    m = nn.Module()
    m.model = nn.Module()
    m.model.layers = nn.ModuleList([_Layer(), _Layer()])
    m.lm_head = nn.Linear(4, 4)  # runs outside the compiled module
    return m


def _graph(names: list[str]) -> Graph:
    return Graph(name="g", nodes=[], inputs={f"arg{i}_1": n for i, n in enumerate(names)})


def test_a_correction_bias_the_router_never_reads_is_flagged() -> None:
    model = _model()
    read = [n for i in (0, 1) for n in (f"model.layers.{i}.input_layernorm.weight",
                                        f"model.layers.{i}.mlp.gate#cpu_linear_closure_0_cell_contents_handler_tensor",
                                        f"model.layers.{i}.mlp.experts.w13_weight",
                                        f"model.layers.{i}.mlp.experts#modules_shared_cpu_linear_closure_1_cell_contents")]
    want = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (0, 1)]
    assert unread_params(model, [_graph(read)]) == want


def test_a_bias_read_through_a_handle_or_holding_zeros_is_not_flagged() -> None:
    model = _model()
    read = [n for i in (0, 1) for n in (f"model.layers.{i}.input_layernorm.weight",
                                        f"model.layers.{i}.mlp.experts.w13_weight",
                                        f"model.layers.{i}.mlp.experts#modules_shared_cpu_linear_closure_1_cell_contents")]
    read.append("model.layers.0.mlp.gate#router_e_score_correction_bias")  # GLM-4-MoE's grouped router reads it
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()  # ignoring zeros changes nothing
    assert unread_params(model, [_graph(read)]) == []
    # a linear read by its weight alone: its bias is not read
    assert unread_params(model, [_graph([*read, "model.layers.0.mlp.experts.shared.weight"])]) == []
    model.model.layers[0].mlp.experts.shared.bias.data.fill_(1.0)
    partial = [n for n in read if "shared" not in n] + ["model.layers.0.mlp.experts.shared.weight",
                                                        "model.layers.1.mlp.experts.shared.weight",
                                                        "model.layers.1.mlp.experts.shared.bias"]
    assert unread_params(model, [_graph(partial)]) == ["model.layers.0.mlp.experts.shared.bias"]


def test_parameters_read_through_the_experts_layer_under_their_other_names_are_not_flagged() -> None:
    """vLLM CPU's `_C_AVX2` build (no oneDNN; recorded from `graphdiff scan` of a tiny GLM-4-MoE there): the
    shared expert is registered twice (`mlp.shared_experts`, and `mlp.experts.shared_experts.layer` inside the fused
    MoE layer, which the graph reads it through), and the router's correction bias is read through the layer's
    unregistered `router` attribute."""
    model = _model()
    for layer in model.model.layers:
        layer.mlp.shared_experts = nn.Linear(4, 4, bias=False)
        layer.mlp.experts.shared_experts = nn.Module()
        layer.mlp.experts.shared_experts.layer = nn.Module()
        layer.mlp.experts.shared_experts.layer.down_proj = layer.mlp.shared_experts
    read = [n for i in (0, 1) for n in (
        f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.mlp.experts.w13_weight",
        f"model.layers.{i}.mlp.experts#modules_shared_cpu_linear_closure_1_cell_contents",
        f"model.layers.{i}.mlp.experts#modules_shared_experts_modules_layer_modules_down_proj_parameters_weight",
        f"model.layers.{i}.mlp.experts#router_e_score_correction_bias")]
    assert unread_params(model, [_graph(read)]) == []
    assert unread_params(model, [_graph([n for n in read if "router" not in n and "down_proj" not in n])]) == [
        f"model.layers.{i}.mlp.{p}" for i in (0, 1)  # each parameter under the first name the model gives it
        for p in ("gate.e_score_correction_bias", "experts.shared_experts.layer.down_proj.weight")]


def test_shared_experts_held_under_private_names_are_read() -> None:
    """vLLM 0.32's fused-MoE runner holds the shared expert as `experts._shared_experts._layer` (recorded from a
    `graphdiff scan --exact` of a tiny Qwen2-MoE on `_C_AVX2`); Dynamo names the graph inputs with the underscores
    squeezed (`experts#modules_shared_experts_modules_layer_modules_gate_up_proj_parameters_weight`). The shared
    expert and its gate are read, not 'never read'."""
    model = _model()
    for layer in model.model.layers:
        layer.mlp.shared_expert_gate = nn.Linear(4, 1, bias=False)
        layer.mlp.shared_expert = nn.Module()
        layer.mlp.shared_expert.gate_up_proj = nn.Linear(4, 8, bias=False)
        layer.mlp.shared_expert.down_proj = nn.Linear(4, 4, bias=False)
        layer.mlp.shared_expert.expert_gate = layer.mlp.shared_expert_gate
        layer.mlp.experts._shared_experts = nn.Module()
        layer.mlp.experts._shared_experts._layer = layer.mlp.shared_expert
    handles = [f"model.layers.{i}.mlp.experts#modules_shared_experts_modules_layer_modules_{p}_parameters_weight"
               for i in (0, 1) for p in ("gate_up_proj", "down_proj", "expert_gate")]
    read = [n for i in (0, 1) for n in (f"model.layers.{i}.input_layernorm.weight",
                                        f"model.layers.{i}.mlp.experts.w13_weight",
                                        f"model.layers.{i}.mlp.experts.shared.weight",
                                        f"model.layers.{i}.mlp.experts.shared.bias",
                                        f"model.layers.{i}.mlp.gate.e_score_correction_bias")]
    assert unread_params(model, [_graph(read + handles)]) == []
    unread = unread_params(model, [_graph(read + [h for h in handles if "down_proj" not in h])])
    assert [name.startswith(f"model.layers.{i}.") and name.endswith(".down_proj.weight")  # its first name
            for i, name in enumerate(unread)] == [True, True]
