"""Regions whose layers run different rounding plans: one splice per group of layers, installed on its own layers.

No engine: the recorded 3-layer Cohere scan (fixtures/scans/tiny-cohere-3, a real scan) has a `residual_norm` region
whose last layer holds a second site (the sum the final norm reads) in another engine kernel than layers 0 and 1.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.codegen import generate
from graphdiff.codegen.layer_groups import layer_groups
from graphdiff.models.tiny import make_tiny
from graphdiff.records import ScanResult
from graphdiff.runtime import PatchError, scanned_layer

COHERE = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-cohere-3"
RESIDUAL = "model.layers.*#residual_norm"


@pytest.fixture(scope="module")
def patch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cohere-patch")
    generate(COHERE, out)
    return out


def _carried(model: torch.nn.Module) -> list[int]:
    """The decoder layers whose forward pre-hooks include the generated carry."""
    return [i for i, layer in enumerate(model.model.layers)
            if any(getattr(h, "__name__", "") == "carry_fp32" for h in layer._forward_pre_hooks.values())]


def _cohere(tmp: Path, layers: int) -> torch.nn.Module:
    from graphdiff.capture.hf import load_hf_model

    return load_hf_model(make_tiny("cohere", tmp / f"cohere-{layers}", layers=layers))


def test_the_groups_come_from_the_sites_of_each_layer() -> None:
    scan = ScanResult.model_validate_json((COHERE / "scan.json").read_text())
    region = next(r for r in scan.regions if r.name == RESIDUAL)
    assert region.differing_layers and len(region.kernels) > 1  # refused as "one code for all layers" before
    assert layer_groups(scan, region) == [[0, 1], [2]]
    one_kernel = region.model_copy(update={"kernels": region.kernels[:1]})  # one kernel code: the union, one group
    assert layer_groups(scan, one_kernel) == [[]]


def test_a_region_whose_layers_differ_is_generated_per_group(patch: Path) -> None:
    manifest = json.loads((patch / "manifest.json").read_text())
    region = next(r for r in manifest["regions"] if r["name"] == RESIDUAL)
    assert region["generated"], region["reason"]
    assert region["layer_groups"] == [[0, 1], [2]]
    splices = [s for s in manifest["splices"] if RESIDUAL in s["regions"]]
    assert sorted(s["layers"] for s in splices) == [[0, 1], [2]] and not any(s["problems"] for s in splices)
    assert len({s["key"] for s in manifest["splices"]}) == len(manifest["splices"])


def test_each_group_is_installed_on_its_own_layers(patch: Path, tmp_path: Path) -> None:
    model = _cohere(tmp_path, 3)
    runtime.apply(model, patch, regions=[RESIDUAL])
    assert _carried(model) == [0, 1, 2]
    runtime.remove(model)
    assert _carried(model) == []


def test_a_deeper_model_maps_first_middle_last(patch: Path, tmp_path: Path) -> None:
    assert [scanned_layer(i, 6, 3) for i in range(6)] == [0, 1, 1, 1, 1, 2]
    assert scanned_layer(3, 6, 2) is None  # a 2-layer scan has no middle layer
    model = _cohere(tmp_path, 6)
    runtime.apply(model, patch, regions=[RESIDUAL])
    assert _carried(model) == list(range(6))


def test_groups_that_alternate_refuse_a_model_of_another_depth(patch: Path, tmp_path: Path) -> None:
    """Groups that alternate (Gemma-style layer types) cannot be mapped onto another depth: refused, named."""
    alt = tmp_path / "alternating"
    shutil.copytree(patch, alt)
    manifest = json.loads((alt / "manifest.json").read_text())
    manifest["layers_scanned"] = manifest["config"]["num_hidden_layers"] = 4  # as a 4-layer scan would hold them
    for s in manifest["splices"]:
        if RESIDUAL in s["regions"]:
            s["layers"] = [0, 2] if s["layers"] == [0, 1] else [1, 3]
    (alt / "manifest.json").write_text(json.dumps(manifest))
    model = _cohere(tmp_path, 4)
    runtime.apply(model, alt, regions=[RESIDUAL])  # the scanned depth: every layer its own group's plan
    assert _carried(model) == [0, 1, 2, 3]
    with pytest.raises(PatchError, match="rescan with --layers 6"):
        runtime.apply(_cohere(tmp_path, 6), alt, regions=[RESIDUAL])
    runtime.apply(_cohere(tmp_path, 6), alt, regions=[])  # not aligned: nothing to tell apart, HF's own code runs


def test_a_scaled_child_output_before_the_residual_add_is_carried_in_fp32():
    """`residual + self_attn(x)[0] * residual_multiplier` (Granite): the trainer rounds the product, the engine sums
    it in FP32; the carry keeps the child's output FP32 for that scale, and only where nothing else reads it."""
    from graphdiff.codegen.carry import carry_fp32_output
    from graphdiff.codegen.carry_plan import _scaled_child_outputs
    from graphdiff.records import Graph, Node

    def node(name: str, target: str, module: str, *inputs: str) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=list(inputs), module=module)

    layer = "model.layers.0"
    nodes = [Node(name="residual", op="placeholder", target="residual", module=layer),
             node("o_proj", "aten.mm.default", f"{layer}.self_attn.o_proj", "residual"),
             node("mul", "aten.mul.Tensor", layer, "o_proj"),
             node("add", "aten.add.Tensor", layer, "residual", "mul")]
    assert _scaled_child_outputs(Graph(name="g", nodes=nodes), layer, ["mul"]) == {"mul": ["self_attn"]}
    also_read = [*nodes, node("other", "aten.sum.default", layer, "o_proj")]
    assert _scaled_child_outputs(Graph(name="g", nodes=also_read), layer, ["mul"]) == {}
    not_added = [*nodes[:3], node("add", "aten.div.Tensor", layer, "residual", "mul")]
    assert _scaled_child_outputs(Graph(name="g", nodes=not_added), layer, ["mul"]) == {}
    # a parallel block (Phi): `attn_output + mlp_output + residual`, both children's outputs summed first
    parallel = [Node(name="residual", op="placeholder", target="residual", module=layer),
                node("dense", "aten.mm.default", f"{layer}.self_attn.dense", "residual"),
                node("fc2", "aten.mm.default", f"{layer}.mlp.fc2", "residual"),
                node("add", "aten.add.Tensor", layer, "dense", "fc2"),
                node("add_1", "aten.add.Tensor", layer, "add", "residual")]
    assert _scaled_child_outputs(Graph(name="g", nodes=parallel), layer, ["add"]) == {"add": ["mlp", "self_attn"]}
    # the residual add itself sums one child output and the stream: not a child sum
    assert _scaled_child_outputs(Graph(name="g", nodes=parallel), layer, ["add_1"]) == {}
    out = carry_fp32_output(torch.nn.Identity(), (), (torch.ones(2, dtype=torch.bfloat16), None))
    assert out[0].dtype == torch.float32 and out[1] is None


def test_a_sum_of_two_child_outputs_handed_to_a_child_is_carried_in_fp32():
    """`inputs_embeds + position_embeds` in the decoder's own forward (GPT-2, OPT), read by the first decoder layer
    only (its norm and its residual add): both embeddings are held FP32; not where a second child reads the sum."""
    from graphdiff.codegen.carry_plan import _scaled_child_outputs
    from graphdiff.records import Graph, Node

    def node(name: str, target: str, module: str, *inputs: str) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=list(inputs), module=module)

    nodes = [node("embedding", "aten.embedding.default", "transformer.wte"),
             node("embedding_1", "aten.embedding.default", "transformer.wpe"),
             node("add_1", "aten.add.Tensor", "transformer", "embedding", "embedding_1"),
             node("native_layer_norm", "aten.native_layer_norm.default", "transformer.h.0.ln_1", "add_1"),
             node("add_2", "aten.add.Tensor", "transformer.h.0", "add_1", "native_layer_norm")]
    found = _scaled_child_outputs(Graph(name="g", nodes=nodes), "transformer", ["add_1"])
    assert found == {"add_1": ["wpe", "wte"]}
    two_layers = [*nodes, node("add_3", "aten.add.Tensor", "transformer.h.1", "add_1", "add_2")]
    assert _scaled_child_outputs(Graph(name="g", nodes=two_layers), "transformer", ["add_1"]) == {}


def test_a_scaled_child_output_handed_to_a_child_is_carried_in_fp32():
    """`inputs_embeds * embedding_multiplier` in the model's own forward (Granite), read by the first decoder layer:
    the trainer rounds the product, the engine computes it in FP32 in the first layer's kernels. The handoff is
    recognized only where the child's output feeds the scale alone and the product's value readers lie in one child;
    the hooks hand that child the FP32 product and leave every other reader (a rotary embedding reading its dtype)
    the trainer's value."""
    from graphdiff.codegen.carry import SCALED_PARTS
    from graphdiff.codegen.carry_plan import scaled_handoffs
    from graphdiff.records import Graph, Node

    def node(name: str, target: str, module: str, *inputs: str) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=list(inputs), module=module)

    nodes = [Node(name="weight", op="placeholder", target="weight", module="model.embed_tokens"),
             node("embedding", "aten.embedding.default", "model.embed_tokens", "weight"),
             node("mul", "aten.mul.Tensor", "model", "embedding"),
             node("_to_copy", "aten._to_copy.default", "model.layers.0.input_layernorm", "mul"),
             node("add", "aten.add.Tensor", "model.layers.0", "mul", "_to_copy")]
    assert scaled_handoffs(Graph(name="g", nodes=nodes), "model", ["mul"]) == {"mul": ("embed_tokens", "layers.0")}
    read_twice = [*nodes, node("other", "aten.sum.default", "model", "embedding")]
    assert scaled_handoffs(Graph(name="g", nodes=read_twice), "model", ["mul"]) == {}
    two_children = [*nodes, node("sum", "aten.sum.default", "model.layers.1", "mul")]
    assert scaled_handoffs(Graph(name="g", nodes=two_children), "model", ["mul"]) == {}
    own_read = [*nodes, node("sum", "aten.sum.default", "model", "mul")]
    assert scaled_handoffs(Graph(name="g", nodes=own_read), "model", ["mul"]) == {}

    _, start, source, _end, reader, done = SCALED_PARTS

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(8, 4, dtype=torch.bfloat16)
            self.layer = torch.nn.Identity()
            self.dtype_seen: torch.dtype | None = None

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed_tokens(ids) * 12.0
            self.dtype_seen = x.dtype  # a reader of its dtype alone
            return self.layer(x)

    model = Model()
    model.register_forward_pre_hook(start)
    model.embed_tokens.register_forward_hook(functools.partial(source, model))
    model.layer.register_forward_pre_hook(functools.partial(reader, model), with_kwargs=True, prepend=True)
    model.register_forward_hook(done, always_call=True)
    ids = torch.arange(8).reshape(2, 4)
    out = model(ids)
    assert out.dtype == torch.float32 and model.dtype_seen == torch.bfloat16
    assert torch.equal(out, model.embed_tokens(ids).float() * 12.0)
    assert not torch.equal(out, (model.embed_tokens(ids) * 12.0).float())  # the trainer's rounding differs
    assert torch.overrides._get_current_function_mode_stack() == []  # the child called alone enters no mode


def test_a_child_output_gated_by_an_activation_of_another_child_output_is_carried_in_fp32():
    """`sigmoid(shared_expert_gate(x)) * shared_expert(x)` before the MoE block's own add (Qwen2-MoE): the trainer
    rounds the product, the engine computes it in FP32 in the kernel that adds it. Both round the sigmoid (the engine
    stores it as BF16), so only the gated child's output is held FP32; the gate's too where the sigmoid is a site."""
    from graphdiff.codegen.carry_plan import _scaled_child_outputs
    from graphdiff.records import Graph, Node

    def node(name: str, target: str, module: str, *inputs: str) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=list(inputs), module=module)

    block = "model.layers.0.mlp"
    nodes = [Node(name="x", op="placeholder", target="x", module=block),
             node("down", "aten.mm.default", f"{block}.shared_expert.down_proj", "x"),
             node("gate", "aten.mm.default", f"{block}.shared_expert_gate", "x"),
             node("sigmoid", "aten.sigmoid.default", block, "gate"),
             node("experts", "aten.sum.dim_IntList", f"{block}.experts", "x"),
             node("mul", "aten.mul.Tensor", block, "sigmoid", "down"),
             node("add", "aten.add.Tensor", block, "experts", "mul")]
    graph = Graph(name="g", nodes=nodes)
    assert _scaled_child_outputs(graph, block, ["mul"]) == {"mul": ["shared_expert"]}
    both = {"mul": ["shared_expert", "shared_expert_gate"], "sigmoid": ["shared_expert", "shared_expert_gate"]}
    assert _scaled_child_outputs(graph, block, ["mul", "sigmoid"]) == both
    gate_read = [*nodes, node("other", "aten.sum.default", block, "gate")]  # the gate's output read elsewhere
    assert _scaled_child_outputs(Graph(name="g", nodes=gate_read), block, ["mul"]) == {}
    not_act = [*nodes[:3], node("sigmoid", "aten.exp.default", block, "gate"), *nodes[4:]]  # no activation
    assert _scaled_child_outputs(Graph(name="g", nodes=not_act), block, ["mul"]) == {}
    own = [*nodes[:5], node("mul", "aten.mul.Tensor", block, "sigmoid", "x"), nodes[6]]  # no child output gated
    assert _scaled_child_outputs(Graph(name="g", nodes=own), block, ["mul"]) == {}
