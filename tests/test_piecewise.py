"""A piecewise engine (vLLM's VLLM_COMPILE graphs, split at attention) stores the residual stream in BF16 where it
is live across a split: the plan says which consumers read that copy, the patch rounds exactly there, and the
engine capture keeps each graph's buffers apart (buffer names repeat from graph to graph)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.analysis.reads import mark_rounded_reads
from graphdiff.codegen import generate
from graphdiff.records import Capture, Decision, Evidence, Graph, Kernel, Node, SideState

QWEN3 = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-qwen3"
IDS = torch.tensor([[17, 912, 33, 1500, 7, 256, 1024, 3, 88, 640, 1999, 5, 42, 9, 77, 1200]])
LAYER0_OUT = "model.layers.0/modeling_qwen3.py:314/add.0"
LAYER1_RESIDUAL_ADD = "model.layers.1/modeling_qwen3.py:308/add.0"


def _n(name: str, target: str, inputs: list[str], dtype: str | None, module: str | None = None,
       op: str = "call_function") -> Node:
    return Node(name=name, op=op, target=target, inputs=inputs, dtype=dtype, shape=[4, 8], module=module)


def _split_engine() -> list[Graph]:
    """Graph 0 computes the layer's output sum in FP32, its norm reads the sum, its BF16 copy is a graph output;
    graph 1 (after attention) adds that copy, a BF16 graph input, to the attention projection."""
    g0 = Graph(name="engine_graph_0", inputs={"arg0_1": "x"}, nodes=[
        _n("arg0_1", "arg0_1", [], "bfloat16", op="placeholder"),
        _n("up", "prims.convert_element_type.default", ["arg0_1"], "float32"),
        _n("add_1", "aten.add.Tensor", ["up", "up"], "float32"),
        _n("pow_1", "aten.pow.Tensor_Scalar", ["add_1"], "float32"),
        _n("copy", "prims.convert_element_type.default", ["add_1"], "bfloat16"),
        _n("output", "output", ["copy", "pow_1"], None, op="output"),
    ])
    g1 = Graph(name="engine_graph_1", inputs={"arg0_1": "x_residual", "arg1_1": "model.layers.1.o.weight"}, nodes=[
        _n("arg0_1", "arg0_1", [], "bfloat16", op="placeholder"),
        _n("arg1_1", "arg1_1", [], "bfloat16", op="placeholder"),
        _n("mm", "aten.mm.default", ["arg1_1", "arg1_1"], "bfloat16"),
        _n("c0", "prims.convert_element_type.default", ["arg0_1"], "float32"),
        _n("c1", "prims.convert_element_type.default", ["mm"], "float32"),
        _n("add_2", "aten.add.Tensor", ["c0", "c1"], "float32"),
        _n("output", "output", ["add_2"], None, op="output"),
    ])
    return [g0, g1]


def _train() -> Graph:
    return Graph(name="train", nodes=[
        _n("x", "x", [], "bfloat16", op="placeholder"),
        _n("h", "aten.add.Tensor", ["x", "x"], "bfloat16", "model.layers.0"),
        _n("norm_in", "aten._to_copy.default", ["h"], "float32", "model.layers.1.input_layernorm"),
        _n("attn", "aten.mm.default", ["x", "x"], "bfloat16", "model.layers.1.self_attn.o_proj"),
        _n("r", "aten.add.Tensor", ["h", "attn"], "bfloat16", "model.layers.1"),
    ])


def _plan(train_on_grid: bool) -> list[Decision]:
    def d(node: str, id_: str, graph: str, engine_node: str, engine: SideState, train: SideState) -> Decision:
        return Decision(id=id_, node=node, op="aten.add.Tensor", train=train, engine=engine, rule="matched",
                        evidence=Evidence(engine_node=engine_node, engine_graph=graph))

    fp32 = SideState(dtype="float32", how="FP32 in a kernel")
    rounded = SideState(dtype="bfloat16", rounds=True, on_grid=True, how="rounded")
    trainer = rounded if train_on_grid else SideState(dtype="float32", how="FP32 (patched)")
    return [d("h", "layer0.out", "engine_graph_0", "add_1", fp32, trainer),
            d("r", "layer1.residual_add", "engine_graph_1", "add_2", fp32, rounded)]


def test_a_copy_read_across_a_graph_split_is_named_and_a_site_where_the_trainer_keeps_fp32() -> None:
    train, engine = _train(), _split_engine()
    plan = _plan(train_on_grid=True)
    mark_rounded_reads(train, plan, engine)
    assert plan[0].evidence.read_rounded_by == ["layer1.residual_add"]
    assert not plan[0].site  # unpatched HF rounds it too: no one-sided rounding at this value
    assert plan[1].evidence.read_rounded_by == []
    patched = _plan(train_on_grid=False)
    mark_rounded_reads(train, patched, engine)
    assert patched[0].site  # a trainer holding the sum in FP32 misses the engine's BF16 copy


def test_no_copy_is_named_inside_one_graph() -> None:
    """Inside one graph a BF16 cast in the FX graph need not round (the kernel decides; engine_state handles it)."""
    g = Graph(name="engine_graph_0", inputs={"arg0_1": "x"}, nodes=[
        _n("arg0_1", "arg0_1", [], "bfloat16", op="placeholder"),
        _n("add_1", "aten.add.Tensor", ["arg0_1", "arg0_1"], "float32"),
        _n("copy", "prims.convert_element_type.default", ["add_1"], "bfloat16"),
        _n("add_2", "aten.add.Tensor", ["copy", "arg0_1"], "float32"),
    ])
    plan = _plan(train_on_grid=False)
    for d, node in zip(plan, ("add_1", "add_2")):
        d.evidence.engine_graph, d.evidence.engine_node = "engine_graph_0", node
    mark_rounded_reads(_train(), plan, [g])
    assert plan[0].evidence.read_rounded_by == [] and not plan[0].site


def _stored_engine(norm_in_kernel: bool) -> list[Graph]:
    """One graph: kernel k1 computes the layer's output sum (declared BF16: its buffer is BF16) and, when
    `norm_in_kernel`, the next layer's norm reads it there in FP32; kernel k2 loads it for the next layer's add
    (Inductor realizes the sum before the final norm's kernel)."""
    nodes = [_n("arg0_1", "arg0_1", [], "bfloat16", op="placeholder"),
             _n("add_1", "aten.add.Tensor", ["arg0_1", "arg0_1"], "bfloat16"),
             _n("pow_1", "aten.pow.Tensor_Scalar", ["add_1"], "float32"),
             _n("mm", "aten.mm.default", ["arg0_1", "arg0_1"], "bfloat16"),
             _n("add_2", "aten.add.Tensor", ["add_1", "mm"], "bfloat16")]
    k1 = ["add_1", "pow_1"] if norm_in_kernel else ["add_1"]
    kernels = [Kernel(id="k1:1", name="k1", kind="generated", nodes=k1),
               Kernel(id="k2:2", name="k2", kind="generated", nodes=["add_2"])]
    return [Graph(name="engine_graph_0", inputs={"arg0_1": "x"}, nodes=nodes, kernels=kernels)]


def test_a_sum_one_kernel_stores_for_another_is_read_rounded_there() -> None:
    """Inside one graph: the next layer's add loads the BF16 buffer of a sum another kernel computed, while that
    kernel's norm read it in FP32; whatever the engine state at the sum says (FP32, or rounded for its store)."""
    for engine_state in (SideState(dtype="float32", how="FP32 in a kernel"),
                         SideState(dtype="bfloat16", rounds=True, on_grid=True, how="rounded: stored by k1")):
        plan = _plan(train_on_grid=False)
        plan[0].engine = engine_state
        for d, node in zip(plan, ("add_1", "add_2")):
            d.evidence.engine_graph, d.evidence.engine_node = "engine_graph_0", node
        mark_rounded_reads(_train(), plan, _stored_engine(norm_in_kernel=True))
        assert plan[0].evidence.read_rounded_by == ["layer1.residual_add"], engine_state
        assert plan[0].site  # the patched trainer holds the sum in FP32
    # a sum stored and read only through its store is plainly rounded: no reader to name
    plan = _plan(train_on_grid=False)
    plan[0].engine = SideState(dtype="bfloat16", rounds=True, on_grid=True, how="rounded: stored by k1")
    for d, node in zip(plan, ("add_1", "add_2")):
        d.evidence.engine_graph, d.evidence.engine_node = "engine_graph_0", node
    mark_rounded_reads(_train(), plan, _stored_engine(norm_in_kernel=False))
    assert plan[0].evidence.read_rounded_by == []


@pytest.fixture(scope="module")
def piecewise_patch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture scan as a piecewise engine would have decided it: layer 1's residual add reads layer 0's output
    sum as the BF16 graph output stored at the attention split."""
    scan_dir = tmp_path_factory.mktemp("scan-piecewise")
    shutil.copytree(QWEN3, scan_dir, dirs_exist_ok=True)
    scan = json.loads((scan_dir / "scan.json").read_text())
    for d in scan["plan"]:
        if d["id"] == LAYER0_OUT:
            d["evidence"]["read_rounded_by"] = [LAYER1_RESIDUAL_ADD]
    (scan_dir / "scan.json").write_text(json.dumps(scan))
    out = tmp_path_factory.mktemp("patch-piecewise")
    generate(scan_dir, out)
    return out


def test_the_patch_rounds_the_residual_for_the_layer_and_keeps_fp32_for_its_norm(
        piecewise_patch: Path, tiny_models: dict[str, Path]) -> None:
    from graphdiff.capture.hf import load_hf_model

    manifest = json.loads((piecewise_patch / "manifest.json").read_text())
    carry = next(s for s in manifest["splices"] if s["target"] == "carry")
    assert carry["torch_fn"] == "carry_fp32_rounded" and carry["fp32_children"] == ["input_layernorm"]
    model = load_hf_model(tiny_models["qwen3"])
    with torch.no_grad():
        base = model(input_ids=IDS, use_cache=False).logits
    runtime.apply(model, piecewise_patch, regions=["model.layers.*#residual_norm"])
    seen: dict[str, torch.Tensor] = {}
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    hooks = [layer0.register_forward_hook(lambda m, a, out: seen.__setitem__("out0", out[0] if isinstance(
                 out, tuple) else out)),
             layer1.register_forward_pre_hook(lambda m, a, kw: seen.__setitem__("in1", (a or [kw["hidden_states"]])[0]),
                                              with_kwargs=True),
             layer1.input_layernorm.register_forward_pre_hook(lambda m, a: seen.__setitem__("norm1", a[0]))]
    with torch.no_grad():
        patched = model(input_ids=IDS, use_cache=False).logits
    for h in hooks:
        h.remove()
    out0 = seen["out0"]
    assert out0.dtype == torch.float32 and not torch.equal(out0.bfloat16().float(), out0)  # the FP32 sum
    assert torch.equal(seen["in1"], out0.bfloat16().float())  # the layer's residual: the BF16 copy
    assert torch.equal(seen["norm1"], out0)  # its norm: the FP32 sum
    assert "_graphdiff_carry" not in layer1.__dict__  # no reference to the input kept after the forward
    runtime.remove(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS, use_cache=False).logits, base)
    assert not torch.equal(patched, base)


def test_the_single_graph_patch_keeps_one_fp32_carry(tmp_path: Path) -> None:
    manifest = generate(QWEN3, tmp_path)
    carry = next(s for s in manifest.splices if s.target == "carry")
    assert carry.torch_fn == "carry_fp32" and carry.fp32_children == []
    assert "carry_fp32_rounded" not in (tmp_path / manifest.module_file).read_text()


def test_each_graphs_buffers_are_saved_apart(tmp_path: Path) -> None:
    """arg7_1 is the norm weight in one piecewise graph and the RoPE table in another: the table stays inline."""
    from safetensors.torch import save_file

    from graphdiff.engines.store import load_engine_capture, save_engine_capture

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    norm = torch.randn(64).bfloat16()
    save_file({"model.norm.weight": norm}, str(model_dir / "model.safetensors"))
    table = torch.randn(4096, 64).bfloat16()  # 512 KiB: large enough to be saved by reference if it were a weight
    big_norm = torch.randn(2048, 64).bfloat16()

    def graph(name: str, param: str, kid: str) -> Graph:
        return Graph(name=name, inputs={"arg7_1": param},
                     nodes=[_n("arg7_1", "arg7_1", [], "bfloat16", op="placeholder")],
                     kernels=[Kernel(id=kid, name="k", kind="generated", nodes=[])])

    cap = Capture(side="engine", engine="vllm", model=str(model_dir), architecture="Qwen3ForCausalLM", graphs=[
        graph("engine_graph_0", "model.layers.0.self_attn.rotary_emb.cos_sin_cache", "k:1"),
        graph("engine_graph_2", "model.norm.weight", "k:g2.1")])
    buffers = {"prefill-16": {"k:1": {"in": {"arg7_1": table}, "out": {}},
                              "k:g2.1": {"in": {"arg7_1": big_norm}, "out": {}}}}
    save_engine_capture(cap, buffers, tmp_path / "engine")
    _, loaded = load_engine_capture(tmp_path / "engine", model_dir)
    assert torch.equal(loaded["prefill-16"]["k:1"]["in"]["arg7_1"], table)
    assert torch.equal(loaded["prefill-16"]["k:g2.1"]["in"]["arg7_1"], big_norm)  # no checkpoint shape fits: inline


def test_an_engine_dump_scan_keeps_the_compilation_config_it_was_captured_with() -> None:
    from graphdiff.engines.base import EngineOptions
    from graphdiff.errors import GraphdiffError
    from graphdiff.pipeline import _dump_config

    recorded = Capture.model_validate({"side": "engine", "engine": "vllm", "model": "m", "architecture": "A",
                                       "graphs": [], "compilation_config": {"mode": 3, "optimization_level": 2}})
    recorded_options = EngineOptions(compilation_config={"mode": 3}, optimization_level=2)
    assert _dump_config(Path("d"), recorded, EngineOptions()) == recorded_options
    assert _dump_config(Path("d"), recorded, recorded_options) == recorded_options
    with pytest.raises(GraphdiffError, match="was captured with compilation config"):
        _dump_config(Path("d"), recorded, EngineOptions(compilation_config={}))
    old = Capture.model_validate({"side": "engine", "engine": "vllm", "model": "m", "architecture": "A",
                                  "graphs": []})
    given = EngineOptions(compilation_config={"mode": 3})
    assert _dump_config(Path("d"), old, given) == given
    assert old.compilation_config == {"mode": 3}


def test_the_rounded_carry_trains_and_recomputes_under_gradient_checkpointing(
        piecewise_patch: Path, tiny_models: dict[str, Path]) -> None:
    from graphdiff.capture.hf import load_hf_model

    model = load_hf_model(tiny_models["qwen3"])
    model.train()
    runtime.apply(model, piecewise_patch)

    def step() -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=IDS, labels=IDS, use_cache=False)
        out.loss.backward()
        return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step()
    assert all(torch.isfinite(g).all() for g in grads.values())
    model.gradient_checkpointing_enable()
    loss2, grads2 = step()
    assert loss2 == loss and all(torch.equal(grads2[n], g) for n, g in grads.items())
    runtime.remove(model)
