"""The HF (trainer-side) capture: the traced eager graph is faithful, named and serializable."""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch

from graphdiff.capture.fx import target_name
from graphdiff.capture.hf import capture_hf, load_hf_model, run_graph
from graphdiff.errors import GraphdiffError
from graphdiff.models.tiny import make_tiny
from graphdiff.records import Capture, load_capture, save_json

ARCHS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


@pytest.fixture(scope="module", params=list(ARCHS))
def captured(request, tmp_path_factory):
    arch = request.param
    path = make_tiny(arch, tmp_path_factory.mktemp(arch), layers=2, seed=0)
    capture, extra = capture_hf(path, num_tokens=12, seed=3)
    return arch, capture, extra


def by_target(capture: Capture, target: str) -> list:
    return [n for n in capture.graphs[0].nodes if n.target == target]


def test_graph_reproduces_eager_logits(captured):
    _, capture, extra = captured
    model = extra.model
    with torch.no_grad():
        eager = model(torch.tensor([capture.prompt_tokens]), use_cache=False).logits
    assert eager.dtype == torch.bfloat16
    assert torch.equal(extra.graph_module(*extra.inputs), eager)
    assert torch.equal(run_graph(extra.graph_module, model, capture.prompt_tokens), eager)


def test_capture_metadata(captured):
    arch, capture, _ = captured
    assert capture.side == "train" and capture.engine == "hf" and capture.dtype == "bfloat16"
    assert capture.architecture == ARCHS[arch]
    assert len(capture.prompt_tokens) == 12
    assert set(capture.versions) == {"torch", "transformers", "graphdiff"}


def test_graph_has_bf16_ops_params_modules_and_sources(captured):
    arch, capture, _ = captured
    graph = capture.graphs[0]
    nodes = graph.node_map()
    modeling_file = f"modeling_{arch}.py"

    # Every input names an earlier node: the node list is a topological order.
    seen: set[str] = set()
    for node in graph.nodes:
        assert set(node.inputs) <= seen, node.name
        seen.add(node.name)

    silu = [n for n in by_target(capture, "aten.silu.default") if n.module.startswith("model.layers.0.mlp")]
    assert len(silu) == 1 and silu[0].dtype == "bfloat16" and silu[0].shape == [1, 12, 512]

    # RMSNorm: rsqrt in float32, then the cast back to BF16 that eager materializes before the weight multiply.
    rsqrt = by_target(capture, "aten.rsqrt.default")
    assert rsqrt and all(n.dtype == "float32" and n.module_type.endswith("RMSNorm") for n in rsqrt)
    assert rsqrt[0].source.file.endswith(modeling_file) and "rsqrt" in rsqrt[0].source.code
    casts = [n for n in by_target(capture, "aten._to_copy.default") if n.module == "model.layers.0.input_layernorm"]
    assert [n.dtype for n in casts] == ["float32", "bfloat16"]

    params = {n.param: n for n in graph.nodes if n.param}
    up = params["model.layers.0.mlp.up_proj.weight"]
    assert up.op == "placeholder" and up.dtype == "bfloat16" and up.shape == [512, 256]
    assert graph.inputs[up.name] == "model.layers.0.mlp.up_proj.weight"
    assert "input_ids" in graph.inputs.values()
    users = [n for n in graph.nodes if up.name in n.inputs]
    assert [(n.target, n.module) for n in users] == [("aten.t.default", "model.layers.0.mlp.up_proj")]

    attn = [n for n in graph.nodes if n.module == "model.layers.0.self_attn"]
    assert attn and attn[0].module_type.endswith("Attention")
    # Linear lowers to mm, or addmm where it has a bias (Qwen2's q/k/v).
    q_proj_mm = [n for n in graph.nodes if n.module == "model.layers.0.self_attn.q_proj" and "mm" in n.target]
    assert len(q_proj_mm) == 1 and q_proj_mm[0].dtype == "bfloat16"
    assert q_proj_mm[0].source.file.endswith(modeling_file) and "q_proj" in q_proj_mm[0].source.code

    output = graph.nodes[-1]
    assert output.op == "output" and nodes[output.inputs[0]].shape == [1, 12, 2048]


def test_capture_round_trips_through_json(captured, tmp_path):
    _, capture, _ = captured
    assert Capture.model_validate_json(capture.model_dump_json()) == capture
    assert load_capture(save_json(capture, tmp_path / "capture.json")) == capture


def test_given_input_ids_are_used_and_seeded_ids_are_deterministic(tmp_path):
    path = make_tiny("qwen3", tmp_path / "m", layers=1)
    given, _ = capture_hf(path, input_ids=[5, 6, 7])
    assert given.prompt_tokens == [5, 6, 7] and given.graphs[0].nodes[-2].shape == [1, 3, 2048]
    assert capture_hf(path, seed=1)[0].prompt_tokens == capture_hf(path, seed=1)[0].prompt_tokens
    with pytest.raises(GraphdiffError):
        capture_hf(path, input_ids=[10**6])


def test_target_name():
    assert target_name(torch.ops.aten.mul.Tensor) == "aten.mul.Tensor"
    assert target_name(torch.ops.prims.convert_element_type.default) == "prims.convert_element_type.default"
    assert target_name(torch.ops.aten.mul) == "aten.mul"
    assert target_name(operator.getitem) == "getitem"
    assert target_name("output") == "output"


def _load_error(path: Path) -> str:
    with pytest.raises(GraphdiffError) as info:
        load_hf_model(path)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def test_load_errors_are_one_line(tmp_path):
    assert "no model directory" in _load_error(tmp_path / "missing")
    assert "no config.json" in _load_error(tmp_path)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"model_type": ')
    assert "config.json" in _load_error(corrupt)
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "no_such_model"}')
    _load_error(unknown)


def test_load_errors_for_weights(tmp_path):
    path = make_tiny("llama", tmp_path / "m", layers=1)
    (path / "model.safetensors").write_bytes(b"not safetensors")
    assert "cannot load" in _load_error(path)
    (path / "model.safetensors").unlink()
    assert "cannot load" in _load_error(path)
