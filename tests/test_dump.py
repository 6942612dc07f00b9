"""Dump import on a dump recorded from a real engine run (fixtures/dumps/vllm-cpu-tiny-qwen3/README.md)."""

from __future__ import annotations

import pytest

from graphdiff.capture.inductor_code import parse_kernel_calls, parse_kernel_defs
from graphdiff.engines.dump import import_dump, parse_fx_graph
from graphdiff.errors import GraphdiffError
from tests.conftest import FIXTURES

DUMP = FIXTURES / "dumps" / "vllm-cpu-tiny-qwen3"
GRAPH_DIR = DUMP / "torchinductor" / "model__0_inference_0.0"


def test_kernel_defs_name_their_loads_and_stores():
    defs = parse_kernel_defs((GRAPH_DIR / "output_code.py").read_text())
    silu = defs["cpp_fused_mul_onednn_mm_silu_slice_3"]
    assert silu.backend == "cpp"
    assert silu.params == [("in_ptr0", "bfloat16"), ("out_ptr0", "bfloat16"), ("ks0", None)]
    # the residual stream leaves the norm kernels as an FP32 buffer
    assert ("out_ptr0", "float32") in defs["cpp_fused__to_copy_add_embedding_mean_mul_onednn_mm_pow_rsqrt_5"].params


def test_calls_are_in_order_with_handles_and_externs():
    calls = parse_kernel_calls((GRAPH_DIR / "output_code.py").read_text())
    assert [c.id.rsplit(":", 1)[1] for c in calls] == [str(i) for i in range(1, len(calls) + 1)]
    externs = {c.name for c in calls if c.extern}
    assert externs == {"torch.ops._C.onednn_mm.default", "torch.ops.vllm.unified_kv_cache_update.default",
                       "torch.ops.vllm.unified_attention_with_output.default"}
    update = next(c for c in calls if "kv_cache_update" in c.name)
    assert update.result is not None  # its return value is bound to a buffer


def test_import_builds_kernels_with_fused_nodes_and_sources():
    cap = import_dump(DUMP)
    (g,) = cap.graphs
    nodes = g.node_map()
    silu = [k for k in g.kernels if k.name == "cpp_fused_mul_onednn_mm_silu_slice_3"]
    assert len(silu) == 2  # one call per layer, same generated kernel
    for k in silu:
        ops = {nodes[n].target for n in k.nodes}
        assert {"aten.exp.default", "aten.div.Tensor", "aten.mul.Tensor"} <= ops
        assert [a.role for a in k.args] == ["in", "out", "scalar"]
    src = nodes["mul_15"].source
    assert src is not None and src.file.endswith("layernorm.py") and "weight" in src.code
    assert nodes["arg0_1"].sym == "s72"
    owned = [n for k in g.kernels if k.kind == "generated" for n in k.nodes]
    assert owned and all(nodes[n].kernel is not None for n in owned)


def test_printed_graph_parses_structured_arguments():
    nodes = {n.name: n for n in parse_fx_graph((GRAPH_DIR / "fx_graph_transformed.py").read_text())}
    conv = nodes["convert_element_type_1"]
    assert conv.call == [[{"node": "embedding"}, {"dtype": "float32"}], {}]
    assert nodes["getitem_8"].target == "getitem"


def test_corrupt_graph_file_is_one_clear_error(tmp_path):
    import shutil

    bad = tmp_path / "dump"
    shutil.copytree(DUMP, bad)
    (bad / "torchinductor" / "model__0_inference_0.0" / "fx_graph_transformed.py").write_text("def forward(:\n")
    with pytest.raises(GraphdiffError, match="unreadable dump"):
        import_dump(bad)


TRITON_DUMP = FIXTURES / "dumps" / "inductor-triton-h200-tiny-qwen3-hf"


def test_real_triton_backend_dump_imports():
    """A Triton-backend dump recorded on a GPU (README beside it): every generated call is a Triton kernel
    with its fused FX nodes, pointer roles and dtypes; SiLU·up and the q/k norm + RoPE fusions are found."""
    text = (TRITON_DUMP / "torchinductor" / "model__0_inference_0.0" / "output_code.py").read_text()
    defs = parse_kernel_defs(text)
    assert defs and all(d.backend == "triton" for d in defs.values())
    assert defs["triton_poi_fused__unsafe_view_mul_silu_10"].params[:2] == [("in_out_ptr0", "bfloat16"),
                                                                            ("in_ptr0", "bfloat16")]
    cap = import_dump(TRITON_DUMP)
    (g,) = cap.graphs
    nodes = g.node_map()
    generated = [k for k in g.kernels if k.kind == "generated"]
    assert len(generated) == 19 and all("@triton.jit" in k.code and k.nodes for k in generated)
    assert {k.name for k in g.kernels if k.kind == "extern"} == {
        "extern_kernels.mm", "torch.ops.aten._scaled_dot_product_cudnn_attention.default"}
    silu = [k for k in generated if k.name == "triton_poi_fused__unsafe_view_mul_silu_10"]
    assert len(silu) == 2  # one call per layer
    for k in silu:
        assert {"aten.exp.default", "aten.div.Tensor", "aten.mul.Tensor"} <= {nodes[n].target for n in k.nodes}
        assert [a.role for a in k.args] == ["inout", "in", "scalar"]
    rope = [k for k in generated if "cos" in k.name and "rsqrt" in k.name and "sin" in k.name]
    assert rope and all({"aten.rsqrt.default", "aten.neg.default", "aten.cat.default"}
                        <= {nodes[n].target for n in k.nodes} for k in rope)
    assert all(nodes[n].kernel is not None for k in generated for n in k.nodes)
    assert any(n.source and n.source.file.endswith("modeling_qwen3.py") for n in g.nodes)


def test_an_externs_out_buffer_holds_its_node_for_certain():
    """`extern_kernels.mm(a, b, out=buf4)`: the buffer is named as the mm node's (rounding.buffer_nodes), so a
    kernel reading two layers' projection outputs binds them by name, not by a replay that cannot tell them apart
    (a commutative sum)."""
    from graphdiff.analysis.rounding import buffer_nodes

    (g,) = import_dump(TRITON_DUMP).graphs
    mms = [k for k in g.kernels if k.name == "extern_kernels.mm"]
    outs = [a for k in mms for a in k.args if a.role == "out"]
    assert mms and len(outs) == len(mms) and len({a.name for a in outs}) == len(outs)
    known = buffer_nodes(g)
    assert all(known[a.name] == k.nodes[0] for k in mms for a in k.args if a.role == "out")


def test_an_out_buffer_a_kernel_later_writes_in_place_is_not_the_externs_for_the_whole_graph():
    """Phi's engine adds a layer's projection outputs into the fc2 GEMM's out= buffer (`in_out_ptr0`): later kernels
    read the sum there, so the buffer is the sum's, not the GEMM's."""
    from graphdiff.analysis.rounding import buffer_nodes
    from graphdiff.records import BufferArg, Graph, Kernel, Node

    nodes = [Node(name="x", op="placeholder", target="x"),
             Node(name="mm", op="call_function", target="aten.mm.default", inputs=["x"], call=[[{"node": "x"}], {}]),
             Node(name="mm2", op="call_function", target="aten.mm.default", inputs=["x"], call=[[{"node": "x"}], {}]),
             Node(name="add", op="call_function", target="aten.add.Tensor", inputs=["mm", "x"])]
    kernels = [Kernel(id="extern_kernels.mm:1", name="extern_kernels.mm", kind="extern", nodes=["mm"],
                      args=[BufferArg(name="x", role="inout"), BufferArg(name="buf5", role="out")]),
               Kernel(id="extern_kernels.mm:2", name="extern_kernels.mm", kind="extern", nodes=["mm2"],
                      args=[BufferArg(name="x", role="inout"), BufferArg(name="buf6", role="out")]),
               Kernel(id="k:3", name="k", kind="generated", nodes=["add"],
                      args=[BufferArg(name="buf5", role="inout", node="add"), BufferArg(name="x", role="in")])]
    known = buffer_nodes(Graph(name="g", nodes=nodes, kernels=kernels))
    assert known["buf5"] == "add" and known["buf6"] == "mm2"


def test_a_pass_through_frame_is_no_source_line():
    """Where vLLM CPU runs a linear as F.linear on its weight (the avx2 kind: oneDNN has no BF16 GEMM there), the
    weight is vLLM's parameter subclass and the dump's only frame for its permute/mm is that subclass's
    `__torch_function__` (line recorded from an avx2 run): not where the op was issued, so no source."""
    text = (GRAPH_DIR / "fx_graph_transformed.py").read_text()
    norm = "# File: SITE/vllm/ir/ops/layernorm.py:20 in rms_norm, code: x = x.to(weight.dtype) * weight"
    passed = ("# File: SITE/vllm/model_executor/parameter.py:124 in __torch_function__, "
              "code: return super().__torch_function__(func, types, args, kwargs)")
    assert norm in text
    nodes = {n.name: n for n in parse_fx_graph(text.replace(norm, passed, 1))}
    assert nodes["convert_element_type_2"].source is None and nodes["mul_15"].source is None
    assert nodes["onednn_mm_default_7"].source is not None  # the next group keeps its line
