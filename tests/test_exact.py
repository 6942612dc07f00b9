"""`--exact` codegen on a recorded MoE scan (tiny Mixtral, fixtures/scans/tiny-mixtral-3: its router has no site):
which splices run the engine's own ops, what the manifest names, and a portable patch without it."""

from __future__ import annotations

from pathlib import Path

from graphdiff.analysis import moe_engine
from graphdiff.analysis.moe import engine_experts_op
from graphdiff.artifacts import ScanDir
from graphdiff.codegen import generate
from graphdiff.codegen.moe_order import router_regions

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
    assert not any(s.imports for s in portable.splices)
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
