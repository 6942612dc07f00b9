"""`--exact` codegen on a recorded MoE scan (tiny Mixtral, fixtures/scans/tiny-mixtral-3: its router has no site):
which splices run the engine's own ops, what the manifest names, and a portable patch without it."""

from __future__ import annotations

from pathlib import Path

from graphdiff.analysis import moe_engine
from graphdiff.analysis.moe import addmm_folds, engine_experts_op
from graphdiff.analysis.reads import mark_fp32_reads
from graphdiff.artifacts import ScanDir
from graphdiff.codegen import exact_ops, generate
from graphdiff.codegen.generate import make_patch
from graphdiff.codegen.moe_order import router_regions
from graphdiff.records import Graph, Node

MIXTRAL = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-mixtral-3"


def test_exact_runs_the_engines_ops_and_names_what_it_imports(tmp_path: Path) -> None:
    scan = ScanDir(MIXTRAL).load_scan()
    assert scan.engine_experts == {"op": "_C.cpu_fused_moe", "activation": "silu", "isa": "vec",
                                   "padded_intermediate": "128"}
    assert not any(r.kind == "router" for r in scan.regions)
    made = generate(MIXTRAL, tmp_path / "exact", exact=True)
    by_target = {s.target: s for s in made.splices}
    assert by_target["experts"].torch_fn == moe_engine.ENGINE_EXPERTS_FN
    assert by_target["attention"].torch_fn == "attention_engine_op"
    assert by_target["experts"].imports == by_target["attention"].imports == ["vllm._custom_ops"]
    router = next(r for r in made.regions if r.kind == "router")
    assert router.name == "model.layers.*.mlp.gate#router" and not router.sites and router.generated
    assert by_target["router"].torch_fn == moe_engine.ROUTER_FN and not by_target["router"].imports
    module = (tmp_path / "exact" / made.module_file).read_text()
    assert "MOE_ISA, MOE_ACTIVATION, MOE_PADDED_INTERMEDIATE, MOE_ROUTER_LANES = 'vec', 'silu', 128, 0" in module
    assert "torch.ops._C.cpu_fused_moe(" in module

    portable = generate(MIXTRAL, tmp_path / "portable")
    assert not any(getattr(s, "imports", []) for s in portable.splices)
    assert not any(r.kind == "router" for r in portable.regions)
    assert "cpu_fused_moe(" not in (tmp_path / "portable" / portable.module_file).read_text()


def test_exact_refuses_the_engine_op_where_the_scan_recorded_none(tmp_path: Path) -> None:
    scan = ScanDir(MIXTRAL).load_scan()
    scan.engine_experts = {}
    d = ScanDir(tmp_path / "scan")
    d.save_scan(scan)
    d.save_train(ScanDir(MIXTRAL).load_train())
    made = generate(d.root, tmp_path / "patch", exact=True)
    experts = next(r for r in made.regions if r.kind == "expert_combine")
    assert not experts.generated and "cpu_fused_moe" in experts.reason
    assert not router_regions(scan, ScanDir(MIXTRAL).load_train().graphs[0])  # no engine op: no router of its own


def test_the_engines_experts_op_is_read_from_its_graph() -> None:
    engine = ScanDir(Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-qwen3").load_engine(None)
    assert engine_experts_op(engine[0].graphs) == {}  # a dense model


GLM4_MOE = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-glm4_moe-3"


def test_an_fp32_router_gemm_of_the_engine_is_read_from_its_graph() -> None:
    engine = ScanDir(GLM4_MOE).load_engine_graphs()
    assert engine is not None
    assert engine_experts_op(engine.graphs)["router_gemm"] == "_C.onednn_mm"
    mixtral = ScanDir(MIXTRAL).load_scan()
    assert "router_gemm" not in mixtral.engine_experts  # a BF16 router GEMM: ATen's sums are the engine's


def test_a_norm_product_the_engines_router_reads_unrounded_is_a_site() -> None:
    """The post-attention norm's product: BF16 for the experts and shared experts, its FP32 value for the router's
    GEMM (converted inside the norm's kernel). A site in the MoE layers (1, 2), not in the dense layer 0."""
    scan, train = ScanDir(GLM4_MOE).load_scan(), ScanDir(GLM4_MOE).load_train()
    engine = ScanDir(GLM4_MOE).load_engine_graphs()
    assert engine is not None
    products = [d for d in scan.plan if (d.module or "").endswith("post_attention_layernorm") and d.rule == "matched"
                and d.op.endswith("mul.Tensor")]
    assert sorted(d.layer for d in products if d.site) == [1, 2]
    for d in products:  # as the plan stood before: the engine's BF16 store taken for the value
        if d.site and d.engine is not None:
            d.site, d.engine = False, d.engine.model_copy(update=dict(dtype="bfloat16", rounds=True, on_grid=True))
    mark_fp32_reads(train.graphs[0], scan.plan, engine.graphs)
    assert sorted(d.layer for d in products if d.site and d.engine and not d.engine.rounds) == [1, 2]
    assert [d.layer for d in products if not d.site] == [0]  # its product feeds the dense MLP's GEMMs only


def test_exact_runs_the_engines_router_gemm_and_keeps_the_norm_product_fp32_for_it(tmp_path: Path) -> None:
    made = generate(GLM4_MOE, tmp_path / "exact", exact=True)
    router = next(s for s in made.splices if s.target == "router")
    assert router.torch_fn == moe_engine.ENGINE_ROUTER_FN and router.imports == ["vllm._custom_ops"]
    assert next(r for r in made.regions if r.kind == "router").generated
    module = (tmp_path / "exact" / made.module_file).read_text()
    # layers 1 and 2: the norm's product leaves in FP32 while its region and the experts' are aligned
    assert ("return (mul if a0 and 'model.layers.*.mlp.experts#expert_combine' in align else "
            "mul.to(torch.bfloat16),)") in module
    assert "ops.onednn_mm(" in module
    portable = generate(GLM4_MOE, tmp_path / "portable")
    assert not any(s.target == "router" for s in portable.splices)
    assert "onednn_mm(" not in (tmp_path / "portable" / portable.module_file).read_text()


def _fused_moe_graph(reader_args: list, topk_sorted: bool = True) -> Graph:
    """An engine graph with a fused-MoE call writing `out`, its weights from a top-k (`topk_sorted`), and one reader
    of `out` (aten.mul with `reader_args`)."""
    def node(name: str, target: str, inputs: list[str], call: list | None = None, **kw) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=inputs, call=[call or [], {}], **kw)

    moe_args = [{"node": "out"}, {"node": "x"}, {"node": "w13"}, {"node": "w2"}, None, None, {"node": "weights"},
                {"node": "ids"}, False, "silu", "vec"]
    return Graph(name="g", nodes=[
        Node(name="w13", op="placeholder", target="w13", dtype="bfloat16", shape=[8, 256, 64]),
        node("out", "aten.empty.memory_format", []), node("x", "aten.mul.Tensor", []),
        node("logits", "aten.mm.default", []),
        node("ids", "aten.topk.default", ["logits"], [{"node": "logits"}, 4, -1, True, topk_sorted]),
        node("weights", "aten.div.Tensor", ["ids"]),
        Node(name="w2", op="placeholder", target="w2"),
        node("moe", "_C.cpu_fused_moe.default", ["out", "x", "w13", "w2", "weights", "ids"], moe_args),
        node("scaled", "aten.mul.Tensor", ["out"], reader_args)])


def test_a_routed_scaling_of_the_experts_sum_is_read_from_the_engines_graph() -> None:
    scaled = engine_experts_op([_fused_moe_graph([{"node": "out"}, 2.5])])
    assert scaled["output_scale"] == "2.5" and scaled["padded_intermediate"] == "128"
    assert "output_scale" not in engine_experts_op([_fused_moe_graph([{"node": "out"}, {"node": "x"}])])


def test_an_addmm_of_the_experts_sum_is_read_from_the_engines_graph() -> None:
    """vLLM CPU's _C_AVX2 build (no oneDNN) leaves its GEMMs to ATen, and Inductor folds the add of a shared expert's
    down GEMM and the experts' (scaled) sum into one addmm: recorded where the addmm's bias is that sum."""
    def addmm(bias: str) -> Node:
        return Node(name="addmm", op="call_function", target="aten.addmm.default", inputs=[bias, "x", "w2"],
                    call=[[{"node": bias}, {"node": "x"}, {"node": "w2"}], {}])

    for bias, want in (("scaled", True), ("out", True), ("x", False)):
        graph = _fused_moe_graph([{"node": "out"}, 1.5])
        graph.nodes.append(addmm(bias))
        assert ("addmm_combine" in engine_experts_op([graph])) is want, bias
    assert "addmm_combine" not in engine_experts_op([_fused_moe_graph([{"node": "out"}, 1.5])])
    assert "MOE_ADDMM_COMBINE = True" in moe_engine.moe_constants({"addmm_combine": "extern_kernels.addmm"})
    assert "MOE_ADDMM_COMBINE = False" in moe_engine.moe_constants({})


def test_a_dense_add_the_engine_folds_into_an_addmm_is_read_from_its_graph() -> None:
    """Falcon on vLLM CPU's `_C_AVX2` build: `mlp_output += attention_output` compiled to one addmm of the MLP's
    output, the attention's input and its dense weight (recorded: `graphdiff scan` of a tiny Falcon there); an
    addmm adding a linear's own bias vector is no fold."""
    def node(name: str, target: str, inputs: list[str], shape: list | None = None, module: str = "") -> Node:
        return Node(name=name, op="call_function", target=target, inputs=inputs, shape=shape, module=module or None)

    dense, mlp = "transformer.h.0.self_attention.dense", "transformer.h.0.mlp.dense_4h_to_h"
    graph = Graph(name="g", inputs={"arg1_1": f"{dense}.weight", "arg2_1": f"{mlp}.weight", "arg3_1": "lm_head.bias"},
                  nodes=[Node(name="arg1_1", op="placeholder", target="arg1_1"),
                         Node(name="arg2_1", op="placeholder", target="arg2_1"),
                         Node(name="arg3_1", op="placeholder", target="arg3_1", shape=[32]),
                         node("act", "aten.mul.Tensor", [], ["s0", 64]),
                         node("attn", "aten.view.default", [], ["s0", 32]),
                         node("permute", "aten.permute.default", ["arg2_1"]),
                         node("mm", "aten.mm.default", ["act", "permute"], ["s0", 32], mlp),
                         node("permute_1", "aten.permute.default", ["arg1_1"]),
                         node("addmm", "aten.addmm.default", ["mm", "attn", "permute_1"], ["s0", 32],
                              "transformer.h.0"),
                         node("addmm_1", "aten.addmm.default", ["arg3_1", "addmm", "permute_1"], ["s0", 32],
                              "transformer.h.1")])
    assert addmm_folds([graph]) == {"transformer.h.*": ["transformer.h.*.self_attention.dense"]}
    scan = ScanDir(QWEN2_MOE).load_scan()
    scan.addmm_folds = addmm_folds([graph])
    module = make_patch(scan, ScanDir(QWEN2_MOE).load_train()).module
    assert "ADDMM_FOLDS = {'transformer.h.*': ['transformer.h.*.self_attention.dense']}" in module
    assert "def addmm_folded_forward(" in module


def test_a_residual_add_the_engine_folds_in_the_norm_after_it_is_folded_in_hfs_decoder_layer(tmp_path: Path) -> None:
    """vLLM's fused add-norm adds the residual in the norm after the linear (Nemotron's addmm of o_proj is tagged
    `post_attention_layernorm`, of down_proj the next layer's `input_layernorm` and `model.norm`, recorded at hidden
    320 on vLLM CPU's `_C_AVX2` build); HF adds it in the decoder layer, which the patch folds (the recorded tiny
    Qwen2-MoE trainer graph: the same adds)."""
    from graphdiff import runtime
    from graphdiff.analysis.moe import trainer_folds
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.codegen.generate import write_patch
    from graphdiff.models.tiny import make_tiny

    o_proj, up_proj = "model.layers.*.self_attn.o_proj", "model.layers.*.mlp.shared_expert.up_proj"
    engine = {"model.layers.*.post_attention_layernorm": [o_proj], "model.layers.*.mlp": [up_proj]}
    scan, train = ScanDir(QWEN2_MOE).load_scan(), ScanDir(QWEN2_MOE).load_train()
    # o_proj's output is added in the decoder layer; a linear inside its key's module keeps the key
    assert trainer_folds(engine, train.graphs[0]) == {"model.layers.*": [o_proj], "model.layers.*.mlp": [up_proj]}
    # a linear whose output no add reads (the gate product reads the shared expert's down projection): its key stays
    down = {"model.norm": ["model.layers.*.mlp.shared_expert.down_proj"]}
    assert trainer_folds(down, train.graphs[0]) == down
    scan.addmm_folds = {"model.layers.*.post_attention_layernorm": [o_proj]}
    write_patch(make_patch(scan, train, regions=[]), tmp_path / "patch")
    model = load_hf_model(make_tiny("qwen2_moe", tmp_path / "m", layers=3))
    runtime.apply(model, tmp_path / "patch")
    try:
        layer = model.model.layers[1]
        weights = layer.__dict__["forward"].__wrapped__.args[2]  # no recorded bias: no keyword
        assert len(weights) == 1 and weights[0] is layer.self_attn.o_proj.weight
    finally:
        runtime.remove(model)
    assert "forward" not in model.model.layers[1].__dict__


def test_a_parallel_blocks_mlp_is_added_to_the_attention_output_before_the_residual() -> None:
    """vLLM's parallel block (Cohere) adds the MLP's down projection to the attention's output projection in one addmm
    and the residual after it (recorded at hidden 320: the addmm's bias is o_proj's GEMM); HF's `residual + attn +
    mlp` sums left to right. Folded with that bias, the module computes `residual + addmm(attn, act, down.T)`; a
    linear added to anything but its recorded bias's output is not folded."""
    import torch

    from graphdiff.analysis.moe import addmm_biases
    from graphdiff.analysis.moe_engine import _AddmmCombine

    graph = Graph(name="g", inputs={"w1": "model.layers.0.self_attn.o_proj.weight",
                                    "w2": "model.layers.0.mlp.down_proj.weight"},
                  nodes=[Node(name="w1", op="placeholder", target="w1"), Node(name="w2", op="placeholder", target="w2"),
                         Node(name="t1", op="call_function", target="aten.permute.default", inputs=["w1"]),
                         Node(name="t2", op="call_function", target="aten.permute.default", inputs=["w2"]),
                         Node(name="mm", op="call_function", target="aten.mm.default", inputs=["a", "t1"]),
                         Node(name="addmm", op="call_function", target="aten.addmm.default",
                              inputs=["mm", "act", "t2"], module="model.layers.0")])
    assert addmm_biases([graph]) == {"model.layers.*.mlp.down_proj": "model.layers.*.self_attn.o_proj"}

    gen = torch.Generator().manual_seed(0)
    residual = torch.randn(64, 32, generator=gen) * 8
    a, act = (torch.randn(64, 32, generator=gen).bfloat16() for _ in range(2))
    o_proj, down = (torch.randn(32, 32, generator=gen).bfloat16() for _ in range(2))
    F = torch.nn.functional
    with _AddmmCombine((down,), ((down, o_proj),)):
        attn = F.linear(a, o_proj)
        folded = residual + attn + F.linear(act, down)
    want = residual + torch.addmm(F.linear(a, o_proj), act, down.t())
    assert torch.equal(folded, want)
    assert not torch.equal(folded, residual + F.linear(a, o_proj) + F.linear(act, down))
    with _AddmmCombine((down,), ((down, o_proj),)):  # added to another value: as written
        plain = residual.bfloat16() + F.linear(act, down)
    assert torch.equal(plain, residual.bfloat16() + F.linear(act, down))
    # Falcon's `mlp_output += attention_output`, both FalconLinear's `x @ weight.T`: the recorded bias (the MLP's
    # GEMM) is the other addend, folded as before
    with _AddmmCombine((o_proj,), ((o_proj, down),)):
        mlp_output = act @ down.T
        mlp_output += a @ o_proj.T
    assert torch.equal(mlp_output, torch.addmm(act @ down.T, a, o_proj.t()))
    assert not torch.equal(mlp_output, act @ down.T + a @ o_proj.T)


def test_an_unsorted_router_top_k_is_read_from_the_engines_graph() -> None:
    """vLLM CPU takes its router's top-k unsorted: the experts' order, which decides the order their weights and
    outputs are summed in, is the CPU top-k's own, and the router splice takes it so too."""
    assert engine_experts_op([_fused_moe_graph([{"node": "out"}, 2.5], topk_sorted=False)])["router_topk"] == "unsorted"
    assert "router_topk" not in engine_experts_op([_fused_moe_graph([{"node": "out"}, 2.5])])
    assert "MOE_ROUTER_TOPK_SORTED = False" in moe_engine.moe_constants({"router_topk": "unsorted"})
def test_the_routers_weights_exp_is_computed_as_the_engines_unvectorized_loop() -> None:
    """Tiny Qwen2-MoE's router kernel (recorded: fixtures/scans/qwen2_moe_router_kernel.json; a top-2 router that does
    not renormalize) computes its weights `exp(v - logsumexp)` in a two-wide loop Inductor did not vectorize:
    `std::exp`, the C library's, which SLEEF's vector exp misses in the last bit on some weights. The scan reads that
    from the kernel, and the patch's scalar form is the engine's weights bit for bit."""
    import json

    import torch

    from graphdiff.analysis.moe import router_exp_scalar
    from graphdiff.replay.inductor_math import inductor_math

    rec = json.loads((MIXTRAL.parent / "qwen2_moe_router_kernel.json").read_text())
    assert router_exp_scalar(rec["code"])
    assert not router_exp_scalar(rec["code"].replace("std::exp(tmp4)", "tmp4.exp()"))  # a vectorized last exp
    values = torch.tensor(rec["topk_logits_bf16_bits"], dtype=torch.int16).view(torch.bfloat16).reshape(-1, rec["k"])
    log_z = torch.tensor(rec["log_z_bf16_bits"], dtype=torch.int16).view(torch.bfloat16).reshape(-1, 1)
    engine = torch.tensor(rec["weights_fp32_bits"], dtype=torch.int32).view(torch.float32).reshape(values.shape)
    x = values.float() - log_z.float()
    assert torch.equal(inductor_math("exp", x, scalar=True), engine)
    assert not torch.equal(inductor_math("exp", x), engine)  # the vector form differs on some weights
    assert "MOE_ROUTER_SCALAR_EXP = True" in moe_engine.moe_constants({"router_exp": "scalar"})
    assert "MOE_ROUTER_SCALAR_EXP = False" in moe_engine.moe_constants({})


def test_a_top1_routers_logsumexp_is_the_engines_unrolled_scalar_loop(monkeypatch) -> None:
    """A top-1 router that does not renormalize (recorded: fixtures/scans/qwen2_moe_top1_router_kernel.json, 6
    experts) runs its whole logsumexp in one loop Inductor unrolled and did not vectorize: `std::exp` of each logit
    less the max, summed left to right, `std::log`, and the sum kept in FP32 (the vectorized top-2 form stores it in
    BF16). The scan reads that from the kernel, and the router splice then gives the engine's weights bit for bit."""
    import json

    import torch

    from graphdiff.analysis.moe import router_logsumexp_form

    rec = json.loads((MIXTRAL.parent / "qwen2_moe_top1_router_kernel.json").read_text())
    assert router_logsumexp_form(rec["code"]) == "scalar-fp32"
    stored = rec["code"].replace("c10::convert<float>(tmp42)", "c10::convert<at::BFloat16>(tmp42)")
    assert router_logsumexp_form(stored) == "scalar"  # top-2 of 6: the sum stored in BF16 for the weights' loop
    vectorized = json.loads((MIXTRAL.parent / "qwen2_moe_router_kernel.json").read_text())["code"]
    assert router_logsumexp_form(vectorized) == ""
    assert "MOE_ROUTER_SCALAR_LOGSUMEXP, MOE_ROUTER_LOGSUMEXP_FP32 = True, True" in moe_engine.moe_constants(
        {"router_logsumexp": "scalar-fp32"})
    assert "MOE_ROUTER_SCALAR_LOGSUMEXP, MOE_ROUTER_LOGSUMEXP_FP32 = True, False" in moe_engine.moe_constants(
        {"router_logsumexp": "scalar"})
    logits = torch.tensor(rec["logits_bf16_bits"], dtype=torch.int16).view(torch.bfloat16).reshape(-1, rec["experts"])
    engine = torch.tensor(rec["weights_fp32_bits"], dtype=torch.int32).view(torch.float32).reshape(-1, 1)

    class Router(torch.nn.Module):  # the identity as its weight: the logits are the hidden states, exactly
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.eye(rec["experts"], dtype=torch.bfloat16))
            self.top_k, self.norm_topk_prob = rec["k"], False

        def forward(self, hidden_states: torch.Tensor):
            logits = torch.nn.functional.linear(hidden_states, self.weight)
            values, indices = torch.topk(logits.float().softmax(-1), self.top_k, dim=-1)
            return logits, values, indices

    monkeypatch.setattr(moe_engine, "MOE_ROUTER_SCALAR_EXP", True)
    monkeypatch.setattr(moe_engine, "MOE_ROUTER_TOPK_SORTED", False)
    got = {}
    for form in ((True, True), (True, False), (False, False)):
        monkeypatch.setattr(moe_engine, "MOE_ROUTER_SCALAR_LOGSUMEXP", form[0])
        monkeypatch.setattr(moe_engine, "MOE_ROUTER_LOGSUMEXP_FP32", form[1])
        _, got[form], _ = moe_engine.moe_router_like_engine(Router(), logits)
    assert torch.equal(got[True, True], engine)
    assert not torch.equal(got[True, False], engine)  # stored in BF16, the sum is another value
    assert not torch.equal(got[False, False], engine)  # so is the vectorized form's


def test_qwen2_moes_gated_shared_expert_is_carried_and_its_router_exp_is_scalar(tmp_path: Path) -> None:
    """The recorded tiny Qwen2-MoE scan (fixtures/scans/tiny-qwen2-moe-3): its block's
    `sigmoid(shared_expert_gate(x)) * shared_expert(x)` site is generated (the carry holds the shared expert's output
    in FP32, with the block's own add), its shared expert's SiLU is a site of its own, and the router computes the
    weights' exp unvectorized."""
    qwen2_moe = MIXTRAL.parent / "tiny-qwen2-moe-3"
    scan = ScanDir(qwen2_moe).load_scan()
    assert scan.engine_experts["router_exp"] == "scalar"
    made = generate(qwen2_moe, tmp_path / "exact", exact=True)
    assert all(r.generated for r in made.regions), [(r.name, r.reason) for r in made.regions if not r.generated]
    carry = next(s for s in made.splices if s.key == "model.layers.*.mlp")
    assert carry.target == "carry" and carry.fp32_outputs == ["shared_expert"]
    assert set(carry.regions) == {"model.layers.*.mlp#other", "model.layers.*.mlp#residual_norm"}
    assert any(r.name == "model.layers.*.mlp.shared_expert.act_fn#gated_act" for r in made.regions)
    assert "MOE_ROUTER_SCALAR_EXP = True" in (tmp_path / "exact" / made.module_file).read_text()


QWEN2_MOE = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-qwen2-moe-3"


def test_exact_runs_the_blocks_one_output_linears_as_the_engines_gemm(tmp_path: Path) -> None:
    """Where the engine runs a one-output linear (Qwen2-MoE's shared expert gate) as its own GEMM, the experts
    splice's module carries that GEMM and says so; a scan that records none leaves the linear to ATen."""
    scan, train = ScanDir(QWEN2_MOE).load_scan(), ScanDir(QWEN2_MOE).load_train()
    for recorded, want in (("_C.onednn_mm", True), (None, False)):
        scan.engine_experts.pop("one_output_gemm", None)
        if recorded:
            scan.engine_experts["one_output_gemm"] = recorded
        module = make_patch(scan, train, exact=True).module
        assert f"MOE_ONE_OUTPUT_GEMM = {want}" in module and "def linear_engine_op(" in module
    scan.engine_experts["one_output_gemm"] = "_C.onednn_mm"
    portable = make_patch(scan, train).module  # no engine GEMM: the runtime must not look for one
    assert "linear_engine_op" not in portable and "MOE_ONE_OUTPUT_GEMM = False" in portable


def test_the_exact_op_per_device_is_data_and_the_cuda_ones_are_named_not_emitted(tmp_path: Path) -> None:
    for target in ("attention", "experts", "gemm"):
        assert exact_ops.EXACT_OPS["cpu", target].emitted and exact_ops.not_emitted("cpu", target) is None
        assert not exact_ops.EXACT_OPS["cuda", target].emitted
    assert "flash_attn_varlen_func" in str(exact_ops.not_emitted("cuda", "attention"))
    assert "fused_experts" in str(exact_ops.not_emitted("cuda", "experts"))
    assert "not emitted" in str(exact_ops.not_emitted("cuda", "gemm"))
    scan_dir = ScanDir(MIXTRAL)
    scan, train = scan_dir.load_scan(), scan_dir.load_train()
    scan.engine_attention = {**scan.engine_attention, "device": "cuda"}  # the same scan as a CUDA engine's
    by_target = {s.target: s for s in make_patch(scan, train, exact=True).manifest.splices}
    assert any("flash_attn_varlen_func" in p for p in by_target["attention"].problems)
    assert any("fused_experts" in p for p in by_target["experts"].problems)
