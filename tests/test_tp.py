"""Tensor parallelism without an engine: the split-K linear emulation, its splice, shard matching, rank naming."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from graphdiff import runtime
from graphdiff.analysis.tensor_parallel import match_shards, rank_of, same_weight
from graphdiff.codegen import generate
from graphdiff.codegen.tp_linear import SPLIT_K_FN, linear_split_k, linear_split_k_truncated
from graphdiff.engines.vllm.tp import omp_bind, rank_kernel_ids
from graphdiff.records import Decision, Evidence, Graph, Kernel, Node, Region, SideRef, SideState, Site

QWEN3 = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-qwen3"


def exact_probe(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """BF16 values k/8, |k| <= 16: every product and every partial sum below is exact in FP32 and in float64."""
    return (torch.randint(-16, 17, shape, generator=gen).double() / 8).to(torch.bfloat16)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_split_k_linear_rounds_each_rank_partial_then_their_fp32_sum(shards: int) -> None:
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(exact_probe((48, 64), gen))
    x = exact_probe((3, 5, 64), gen)
    got = linear_split_k(lin, x, shards)
    # reference in float64 (exact here): each rank's partial product rounded once to BF16, summed, rounded again
    step = 64 // shards
    partials = [(x[..., r * step:(r + 1) * step].double() @ lin.weight[:, r * step:(r + 1) * step].double().T)
                .to(torch.bfloat16).double() for r in range(shards)]
    want = sum(partials).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    one = (x.double() @ lin.weight.double().T).to(torch.bfloat16)  # one GEMM: one rounding
    if shards == 1:
        assert torch.equal(got, F.linear(x, lin.weight)) and torch.equal(got, one)
    else:
        assert (got != one).any(), "the probe must make the partials' rounding visible"
    x.requires_grad_(True)
    linear_split_k(lin, x, shards).float().sum().backward()  # differentiable: a training step can run through it
    assert torch.isfinite(x.grad).all()


def test_split_k_linear_bias_goes_into_rank_0_partial_and_refuses_uneven_shards() -> None:
    gen = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(64, 16, bias=True, dtype=torch.bfloat16)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    p0 = F.linear(x[:, :32], lin.weight[:, :32], lin.bias).float()
    p1 = F.linear(x[:, 32:], lin.weight[:, 32:]).float()
    assert torch.equal(linear_split_k(lin, x, 2), (p0 + p1).to(torch.bfloat16))
    with pytest.raises(ValueError, match="not divisible"):
        linear_split_k(lin, x, 3)


def test_split_k_truncated_stores_the_fp32_sum_toward_zero_and_passes_the_gradient() -> None:
    gen = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(64, 16, bias=False, dtype=torch.bfloat16)
    x = torch.randn(8, 64, generator=gen).to(torch.bfloat16).requires_grad_(True)
    total = sum(F.linear(x[:, r * 32:(r + 1) * 32], lin.weight[:, r * 32:(r + 1) * 32]).float() for r in (0, 1))
    got = linear_split_k_truncated(lin, x, 2)
    # toward zero on the BF16 grid: |total| in [2^(e-1), 2^e) has BF16 spacing 2^(e-8)
    spacing = torch.ldexp(torch.ones_like(total.double()), torch.frexp(total.double()).exponent - 8)
    toward_zero = (total.double().abs() / spacing).floor() * spacing * total.double().sign()
    assert torch.equal(got.double(), toward_zero) and not torch.equal(got, linear_split_k(lin, x, 2))
    got.float().sum().backward()
    assert torch.equal(x.grad, (torch.ones(8, 16) @ lin.weight.float()).to(torch.bfloat16))


def _with_allreduce_region(src: Path, dst: Path) -> list[str]:
    """A copy of a TP=1 scan with the o_proj matmuls decided as allreduce sites of a TP=2 engine (what
    tensor_parallel.allreduce_plan writes), so that codegen and the runtime run without an engine."""
    shutil.copytree(src, dst)
    scan = json.loads((dst / "scan.json").read_text())
    train = Graph.model_validate(json.loads((dst / "train.capture.json").read_text())["graphs"][0])
    mms = [n for n in train.nodes if n.target.startswith("aten.mm") and (n.module or "").endswith("self_attn.o_proj")]
    assert mms
    name = "model.layers.*.self_attn.o_proj#allreduce"
    for n in mms:
        d = Decision(id=f"{n.module}/linear.py:125/mm.0", node=n.name, op=n.target, module=n.module,
                     train=SideState(dtype="float32"), engine=SideState(dtype="bfloat16", rounds=True, on_grid=True),
                     rule="opaque-registry", site=True, region=name, kind="allreduce",
                     evidence=Evidence(kernel="torch.ops._C.shm_allreduce.default:9"))
        scan["plan"].append(d.model_dump(mode="json"))
        scan["sites"].append(Site(id=d.id, region=name, kind="allreduce", layer=int(n.module.split(".")[2]),
                                  rounded_on="engine", train=SideRef(node=n.name, op=n.target, module=n.module),
                                  matched=False, confidence=1.0, changed_fraction=0.37, evidence="").model_dump())
    scan["regions"].append(Region(name=name, kind="allreduce", module="model.layers.*.self_attn.o_proj",
                                  layers=sorted({int(n.module.split(".")[2]) for n in mms}),
                                  sites=[f"{n.module}/linear.py:125/mm.0" for n in mms],
                                  rounded_on=["engine"]).model_dump())
    scan["engine_config"]["tensor_parallel_size"] = 2
    (dst / "scan.json").write_text(json.dumps(scan))
    return [n.module for n in mms]


def test_allreduce_region_patches_the_linear_as_split_k(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from graphdiff.capture.hf import load_hf_model

    modules = _with_allreduce_region(QWEN3, tmp_path / "scan")
    manifest = generate(tmp_path / "scan", tmp_path / "patch")
    splice = next(s for s in manifest.splices if s.target == "linear")
    assert splice.shards == 2 and splice.module_class == "Linear" and not splice.problems
    assert (tmp_path / "patch" / "graphdiff_patch.py").read_text().count(f"def {SPLIT_K_FN}(") == 1
    model = load_hf_model(tiny_models["qwen3"])
    seen: dict[str, tuple] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, (args[0], out)))
             for name, m in model.named_modules() if name in modules]
    ids = torch.tensor([[17, 912, 33, 1500, 7, 256, 1024, 3, 88, 640, 1999, 5, 42, 9, 77, 1200]])
    region = "model.layers.*.self_attn.o_proj#allreduce"
    runtime.apply(model, tmp_path / "patch" / "manifest.json", regions=[region])
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert set(seen) == set(modules)
    for name, (x, out) in seen.items():
        weight = model.get_submodule(name).weight
        want = (F.linear(x[..., :128], weight[:, :128]).float() + F.linear(x[..., 128:], weight[:, 128:]).float())
        assert torch.equal(out, want.to(torch.bfloat16)), name
        assert not torch.equal(out, F.linear(x, weight)), name
    runtime.apply(model, tmp_path / "patch" / "manifest.json", regions=[])  # not aligned: HF's own linear
    seen.clear()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for name, (x, out) in seen.items():
        assert torch.equal(out, F.linear(x, model.get_submodule(name).weight)), name
    runtime.remove(model)
    for h in hooks:
        h.remove()


def _node(name: str, shape: list[int], module: str, target: str = "aten.mul.Tensor") -> Node:
    return Node(name=name, op="call_function", target=target, dtype="bfloat16", shape=shape, module=module)


def test_a_rank_shard_matches_its_part_of_the_trainer_value() -> None:
    gen = torch.Generator().manual_seed(2)
    full = torch.randn(1, 16, 4, 64, generator=gen).to(torch.bfloat16)  # [batch, seq, heads, dim]
    mod = "model.layers.0.self_attn.q_norm"
    train = Graph(name="train", nodes=[_node("q", [1, 16, 4, 64], mod)])
    for rank in (0, 1):
        shard = full.reshape(16, 4, 64)[:, rank * 2:(rank + 1) * 2]  # the engine's [tokens, heads / tp, dim]
        other = full.reshape(16, 4, 64)[:, (1 - rank) * 2:(2 - rank) * 2]
        engine = Graph(name=f"rank{rank}/engine_graph_0" if rank else "engine_graph_0",
                       nodes=[_node("mine", [16, 2, 64], mod), _node("theirs", [16, 2, 64], mod + "x")])
        found = match_shards(train, {"q": full}, engine, {"mine": shard.float(), "theirs": other.float()}, ["q"],
                             2, rank_of(engine))
        assert [(m.train, m.engine, m.distance) for m in found] == [("q", "mine", 0.0)], rank
        assert f"part {rank} of 2 along dim 2" in found[0].evidence


def test_rank_names_kernel_ids_binding_and_shard_weights() -> None:
    g = Graph(name="engine_graph_0", nodes=[Node(name="a", op="call_function", target="x", kernel="k:3")],
              kernels=[Kernel(id="k:3", name="k", kind="generated", nodes=["a"])])
    assert rank_kernel_ids(g.model_copy(deep=True), 0) == {}
    renamed = g.model_copy(deep=True)
    assert rank_kernel_ids(renamed, 1) == {"k:3": "k:r1.3"}
    assert renamed.name == "rank1/engine_graph_0" and renamed.nodes[0].kernel == "k:r1.3"
    assert rank_of(renamed) == 1 and rank_of(g) == 0 and rank_of("engine_graph_2") == 0
    assert omp_bind(2, {0, 1}) == "0|1" and omp_bind(2, {4, 5, 6, 7}) == "4,5|6,7"
    with pytest.raises(Exception, match="at least 2 CPU cores"):
        omp_bind(2, {0})
    w = torch.arange(24.0).reshape(6, 4)
    assert same_weight(w, w.clone()) and same_weight(w, w[3:]) and not same_weight(w, w[3:] + 1)


def _c10d_tp_graph() -> Graph:
    """A row-parallel linear as Inductor compiles it where vLLM CPU's all-reduce is torch.distributed's (its
    `_C_AVX2` ops build has no shared-memory all-reduce; oneDNN has no BF16 matmul there): `extern_kernels.mm` into a
    buffer that `_c10d_functional.all_reduce_` reduces in place (it returns that buffer), then `wait_tensor`."""
    mod = "model.layers.0.self_attn.o_proj"
    nodes = [Node(name="x", op="placeholder", target="x", dtype="bfloat16", shape=[3, 8]),
             Node(name="w", op="placeholder", target="w", dtype="bfloat16", shape=[16, 8]),
             Node(name="permute", op="call_function", target="aten.permute.default", inputs=["w"],
                  dtype="bfloat16", shape=[8, 16], module=mod),
             Node(name="mm_1", op="call_function", target="aten.mm.default", inputs=["x", "permute"],
                  call=[[{"node": "x"}, {"node": "permute"}], {}], dtype="bfloat16", shape=[3, 16], module=mod),
             Node(name="all_reduce_1", op="call_function", target="_c10d_functional.all_reduce_.default",
                  inputs=["mm_1"], call=[[{"node": "mm_1"}, "sum", "3"], {}], dtype="bfloat16", shape=[3, 16],
                  module=mod),
             Node(name="wait_tensor_1", op="call_function", target="_c10d_functional.wait_tensor.default",
                  inputs=["all_reduce_1"], call=[[{"node": "all_reduce_1"}], {}], dtype="bfloat16", shape=[3, 16],
                  module=mod)]
    kernels = [Kernel(id="extern_kernels.mm:9", name="extern_kernels.mm", kind="extern", nodes=["mm_1"]),
               Kernel(id="torch.ops._c10d_functional.all_reduce_.default:10",
                      name="torch.ops._c10d_functional.all_reduce_.default", kind="extern", nodes=["all_reduce_1"]),
               Kernel(id="torch.ops._c10d_functional.wait_tensor.default:11",
                      name="torch.ops._c10d_functional.wait_tensor.default", kind="extern", nodes=["wait_tensor_1"])]
    return Graph(name="engine_graph_0", nodes=nodes, kernels=kernels)


def test_extern_attribution_skips_an_origin_node_that_runs_another_op() -> None:
    """Inductor gives the out= buffer of an mm that an in-place all_reduce_ reduces the wait_tensor as origin_node
    (measured on vLLM CPU's `_C_AVX2` path): the extern computes the origin that runs its op."""
    from graphdiff.capture.assemble import _extern_nodes
    from graphdiff.capture.inductor_code import KernelCall
    from graphdiff.capture.inductor_hooks import Compiled

    targets = {n.name: n.target for n in _c10d_tp_graph().nodes}
    mm = KernelCall(id="extern_kernels.mm:9", name="extern_kernels.mm", extern=True, args=["buf13", "arg11_1"])
    moved = Compiled(placeholders=[], origins={mm.id: ["all_reduce_1", "mm_1", "wait_tensor_1"]},
                     origin_node={mm.id: "wait_tensor_1"})
    assert _extern_nodes(mm, moved, targets) == ["mm_1"]
    kept = Compiled(placeholders=[], origins={mm.id: ["mm_1"]}, origin_node={mm.id: "mm_1"})
    assert _extern_nodes(mm, kept, targets) == ["mm_1"]
    other = Compiled(placeholders=[], origins={mm.id: ["addmm"]}, origin_node={mm.id: "addmm"})  # none runs mm
    assert _extern_nodes(mm, other, {**targets, "addmm": "aten.addmm.default"}) == ["addmm"]


def test_a_torch_distributed_allreduce_is_found_in_place_and_its_calls_recorded() -> None:
    from graphdiff.analysis.tensor_parallel import allreduce_truncates
    from graphdiff.capture.collectives import AllReduce, allreduces
    from graphdiff.engines.vllm.tp_worker import EXTERN_OPS, extern_records

    g = _c10d_tp_graph()
    assert allreduces(g) == [AllReduce("engine_graph_0", "torch.ops._c10d_functional.all_reduce_.default:10", "mm_1",
                                       "extern_kernels.mm:9")]
    x, w = torch.randn(3, 8).bfloat16(), torch.randn(16, 8).bfloat16()
    partial, reduced = F.linear(x, w), F.linear(x, w) * 2
    calls: dict[str, list[dict]] = {op: [] for op in EXTERN_OPS}
    calls["extern_kernels.mm"].append({"before": [x, w.t()], "after": [x, w.t()]})
    calls["_c10d_functional.all_reduce_"].append({"before": [partial, None, None], "after": [reduced, None, None]})
    records, notes = extern_records([g], calls)
    ext = records["torch.ops._c10d_functional.all_reduce_.default:10"]["extern"]
    assert not notes and ext["buffer"] == "mm_1" and ext["matmul"] == "extern_kernels.mm:9"
    assert ext["partial"] is partial and ext["reduced"] is reduced and ext["matmul_input"] is x
    # only vLLM's own shared-memory all-reduce stores by its build's truncation; torch.distributed's rounds (measured)
    assert allreduce_truncates("torch.ops._C.shm_allreduce.default:9", "_C_AVX512")
    assert not allreduce_truncates("torch.ops._C.shm_allreduce.default:9", "_C")
    assert not allreduce_truncates("torch.ops._c10d_functional.all_reduce_.default:10", "_C_AVX2")


def test_the_extern_recorder_records_an_inductor_mm_and_a_completed_c10d_allreduce(tmp_path: Path) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives  # noqa: F401  (registers the _c10d_functional ops)
    from torch._inductor.select_algorithm import extern_kernels

    from graphdiff.engines.vllm.tp_worker import EXTERN_OPS, ExternRecorder

    mm = extern_kernels.mm
    owned = not dist.is_initialized()  # an in-process engine earlier in the session may have made one (world 1)
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        rec = ExternRecorder(EXTERN_OPS)
        rec.armed = True
        x, w, out = torch.randn(3, 8).bfloat16(), torch.randn(16, 8).bfloat16(), torch.empty(3, 16).bfloat16()
        extern_kernels.mm(x, w.t(), out=out)  # as Inductor's wrapper calls it
        buf = out.clone()
        torch.ops._c10d_functional.all_reduce_.default(buf, "sum", dist.group.WORLD.group_name)
        torch.ops._c10d_functional.wait_tensor.default(buf)  # the wrapper's own: nothing left to wait for
        rec.remove()
    finally:
        if owned:
            dist.destroy_process_group()
    assert extern_kernels.mm is mm
    [call] = rec.calls["extern_kernels.mm"]
    assert torch.equal(call["before"][0], x) and torch.equal(out, F.linear(x, w))
    [ar] = rec.calls["_c10d_functional.all_reduce_"]
    assert torch.equal(ar["before"][0], out) and torch.equal(ar["after"][0], buf)


def test_the_linear_splice_stores_as_its_allreduce_stores() -> None:
    from graphdiff.codegen.tp_linear import allreduce_splice

    g = _c10d_tp_graph()
    nodes = {n.name: n.model_copy(update={"module_type": "Linear"}) for n in g.nodes}
    region = Region(name="model.layers.*.self_attn.o_proj#allreduce", kind="allreduce",
                    module="model.layers.*.self_attn.o_proj", layers=[0], sites=["s"], rounded_on=["engine"])
    c10d = region.model_copy(update={"kernels": ["torch.ops._c10d_functional.all_reduce_.default"]})
    shm = region.model_copy(update={"kernels": ["torch.ops._C.shm_allreduce.default"]})
    fn = {name: allreduce_splice(r, nodes, {"s": "mm_1"}, 2, build)[0].torch_fn
          for name, r, build in (("c10d", c10d, "_C_AVX2"), ("shm", shm, "_C_AVX512"), ("shm-rne", shm, "_C"),
                                 ("unnamed", region, "_C_AVX512"))}
    assert fn == {"c10d": "linear_split_k", "shm": "linear_split_k_truncated", "shm-rne": "linear_split_k",
                  "unnamed": "linear_split_k_truncated"}
    assert not allreduce_splice(c10d, nodes, {"s": "mm_1"}, 2, "_C_AVX2")[0].problems
    assert "ring" in allreduce_splice(c10d, nodes, {"s": "mm_1"}, 4, "_C_AVX2")[0].problems[0]


TP2 = Path(__file__).resolve().parent.parent / "fixtures" / "captures" / "tiny-qwen3-tp2"


@pytest.fixture(scope="module")
def tp2_scan(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """The recorded TP=2 capture of tiny Qwen3 (both ranks, with their all-reduce calls) analysed as
    `scan --engine-dump` does, into a scan directory."""
    from graphdiff.artifacts import ScanDir
    from graphdiff.engines.store import save_engine_capture
    from graphdiff.pipeline import scan

    d = ScanDir(tmp_path_factory.mktemp("scan-tp2"))
    outcome = scan(str(tiny_models["qwen3"]), engine_dump=TP2, out=d)
    save_engine_capture(outcome.engine, outcome.buffers, d.engine_dir)
    d.save_train(outcome.train.capture)
    d.save_scan(outcome.result)
    return d.root, outcome.result


def test_recorded_tp2_capture_replays_every_kernel_of_both_ranks(tp2_scan) -> None:
    _, result = tp2_scan
    kernels = {r.kernel: r for r in result.replay}
    ranks = {0: [k for k in kernels if ":r1." not in k and not k.startswith("torch.ops")],
             1: [k for k in kernels if ":r1." in k and not k.startswith("torch.ops")]}
    assert ranks[0] and len(ranks[0]) == len(ranks[1])
    assert all(kernels[k].predicted_bitexact >= 0.999 for r in ranks.values() for k in r)
    assert not result.not_replayed and not result.unexplained and not result.unregistered_externs
    assert any("rank 1 decides" in n and "differs" not in n for n in result.notes), result.notes


def test_recorded_tp2_capture_has_the_allreduce_sites_and_the_tp1_sites(tp2_scan) -> None:
    _, result = tp2_scan
    regions = {r.name: r for r in result.regions}
    for name in ("model.layers.*.self_attn.o_proj#allreduce", "model.layers.*.mlp.down_proj#allreduce"):
        assert regions[name].kind == "allreduce" and regions[name].rounded_on == ["engine"] and regions[name].proven
    allreduce = [s for s in result.sites if s.kind == "allreduce"]
    assert len(allreduce) == 4 and all(0.2 < s.changed_fraction < 0.6 for s in allreduce)
    checks = [r for r in result.replay if r.kernel.startswith("torch.ops._C.shm_allreduce")]
    assert len(checks) == 8 and all(r.predicted_bitexact == 1.0 and r.naive_bitexact < 0.9 for r in checks)
    tp1 = json.loads((QWEN3 / "scan.json").read_text())  # the TP=1 scan of the same model and prompt
    assert {s.id for s in result.sites if s.kind != "allreduce"} == {s["id"] for s in tp1["sites"]}


def test_generated_split_k_linear_equals_the_recorded_allreduce_outputs(tp2_scan, tmp_path: Path) -> None:
    from graphdiff.codegen.verify import verify

    scan_dir, _ = tp2_scan
    generate(scan_dir, tmp_path / "patch")
    checks = [c for c in verify(scan_dir, tmp_path / "patch", triton=False) if "recorded all-reduce" in c.splice]
    assert len(checks) == 4 and all(c.identical and c.ok for c in checks), checks
