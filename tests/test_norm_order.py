"""Norms with no rounding site that the engine sums in its own lane order get a `sum_order` region
(graphdiff.codegen.norm_order), from the recorded 3-layer tiny Gemma scan (fixtures/scans/README.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.codegen import generate
from graphdiff.codegen.norm_order import order_regions
from graphdiff.models.tiny import make_tiny
from graphdiff.records import Graph, ScanResult
from graphdiff.replay.sum_order import ordered_mean
from tests.conftest import FIXTURES

GEMMA = FIXTURES / "scans" / "tiny-gemma-3"
INPUT_NORM = "model.layers.*.input_layernorm#sum_order"


@pytest.fixture(scope="module")
def patch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gemma") / "patch"
    generate(GEMMA, out, attention="engine")
    return out


def test_every_norm_the_engine_orders_is_a_region_with_its_kernels_lanes(patch: Path) -> None:
    manifest = runtime.load_manifest(patch / "manifest.json")
    regions = {r.name: r for r in manifest.regions if r.kind == "sum_order"}
    assert sorted(regions) == [INPUT_NORM, "model.layers.*.post_attention_layernorm#sum_order", "model.norm#sum_order"]
    assert all(r.generated and r.sites == [] for r in regions.values())
    assert regions[INPUT_NORM].layers == [0, 1, 2]
    splice = next(s for s in manifest.splices if INPUT_NORM in s.regions)
    assert splice.target == "module" and splice.module == "model.layers.*.input_layernorm" and not splice.problems
    # per module, as the recorded kernels sum: layer 1's input norm kernel in 16 lanes, the others in 32
    assert splice.reduction_lanes == {"model.layers.0.input_layernorm": 32, "model.layers.1.input_layernorm": 16,
                                      "model.layers.2.input_layernorm": 32}


def test_no_region_where_a_scanned_region_orders_the_module_or_nothing_is_ordered() -> None:
    scan = ScanResult.model_validate_json((GEMMA / "scan.json").read_text())
    graph = Graph.model_validate(__import__("json").loads((GEMMA / "train.capture.json").read_text())["graphs"][0])
    assert len(order_regions(scan, graph)) == 3
    assert order_regions(scan.model_copy(update={"ordered_sums": {}}), graph) == []
    # a norm region with sites that sums the module's rows already: the module gets no second region
    owned = scan.regions[0].model_copy(update={"reduction_lanes": {m: 32 for m in scan.ordered_sums
                                                                   if "input_layernorm" in m}})
    names = {r.name for r in order_regions(scan.model_copy(update={"regions": [owned, *scan.regions[1:]]}), graph)}
    assert INPUT_NORM not in names and len(names) == 2


def test_the_splice_sums_the_row_in_the_engine_kernels_order(patch: Path, tmp_path: Path) -> None:
    """Aligned, the norm's output is HF's Gemma RMSNorm with its mean of squares summed in the kernel's lanes; on
    some of these rows that differs from HF's own (ATen's order), so the splice is what changes them."""
    from graphdiff.capture.hf import load_hf_model

    model = load_hf_model(make_tiny("gemma", tmp_path / "gemma", layers=3))
    x = torch.randn(4096, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    norms = {ly: model.model.layers[ly].input_layernorm for ly in (0, 1)}
    hf = {ly: norm(x) for ly, norm in norms.items()}

    def engine_order(norm: torch.nn.Module, lanes: int) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(ordered_mean(h.pow(2), [-1], True, lanes) + norm.eps)
        return (h * (1.0 + norm.weight.float())).to(x.dtype)

    runtime.apply(model, patch, regions=[INPUT_NORM])
    try:
        for ly, lanes in ((0, 32), (1, 16)):
            out = norms[ly](x)
            assert torch.equal(out, engine_order(norms[ly], lanes))
            assert not torch.equal(out, hf[ly])
    finally:
        runtime.remove(model)
    assert torch.equal(norms[0](x), hf[0])  # removed: HF's own code again


STABLELM = FIXTURES / "scans" / "tiny-stablelm-3"
POST_NORM = "model.layers.*.post_attention_layernorm#sum_order"


def test_ordered_layer_norm_is_inductors_layer_norm_bit_for_bit() -> None:
    """Two passes of 32-lane row sums and eager `rsqrt` (the kernel's fast-math `1 / std::sqrt`) reproduce an
    Inductor-compiled layer norm on every row; ATen's own layer norm differs on some."""
    import torch.nn.functional as F

    from graphdiff.replay.sum_order import ordered_layer_norm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 256, generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(256, generator=gen)).to(torch.bfloat16)
    b = (0.1 * torch.randn(256, generator=gen)).to(torch.bfloat16)

    def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (256,), w.float(), b.float(), 1e-5).to(torch.bfloat16)

    from torch._inductor.utils import run_and_get_code

    from graphdiff.replay.sum_order import cpp_sum_lanes

    compiled, code = run_and_get_code(torch.compile(layer_norm, backend="inductor", dynamic=True), x, w, b)
    lanes = cpp_sum_lanes("\n".join(code))  # this CPU's vector width (32 with AVX-512)
    assert lanes > 0
    ours = ordered_layer_norm(x.float(), [256], w.float(), b.float(), 1e-5, lanes)[0].to(torch.bfloat16)
    assert torch.equal(ours, compiled)
    assert not torch.equal(layer_norm(x, w, b), compiled)


def test_a_kernel_that_reads_its_stored_input_back_is_told_apart() -> None:
    import json

    from graphdiff.replay.sum_order import cpp_rereads_store, cpp_sum_lanes

    code = json.loads((STABLELM / "layer_norm_kernels.json").read_text())
    recompute, reread = (next(c for k, c in code.items() if k.split(":")[0].endswith(end)) for end in ("_2", "_5"))
    assert cpp_sum_lanes(recompute) == cpp_sum_lanes(reread) == 32
    assert not cpp_rereads_store(recompute) and cpp_rereads_store(reread)


def test_layer_norms_are_generated_per_group_of_kernels_that_read_alike(tmp_path: Path) -> None:
    """StableLM's layer norms (one ATen op in the trainer) get `sum_order` regions; the post-attention norm is cut in
    two groups: layer 1's kernel reads the input back from its BF16 store after the mean, layers 0 and 2 do not."""
    scan = ScanResult.model_validate_json((STABLELM / "scan.json").read_text())
    assert scan.ordered_sums and set(scan.ordered_sums.values()) == {32}
    assert scan.norm_rereads == ["model.layers.1.post_attention_layernorm"]
    manifest = generate(STABLELM, tmp_path / "patch", attention="engine")
    post = [s for s in manifest.splices if POST_NORM in s.regions]
    assert sorted(s.layers for s in post) == [[0, 2], [1]] and not any(s.problems for s in post)
    source = (tmp_path / "patch" / "graphdiff_patch.py").read_text()
    calls = [line for line in source.splitlines() if "= ordered_layer_norm(" in line]
    assert len(calls) == 4  # input norm, post-attention norm (two groups), final norm
    assert sum("lanes, torch.bfloat16)" in line for line in calls) == 1


def test_a_carried_fp32_input_reaches_the_layer_norm_splice(tmp_path: Path) -> None:
    """The runtime gives an `nn.LayerNorm` an FP32 input (the carried residual) in FP32; where a splice replaced its
    forward, the splice computes it: the mean over the FP32 values, the rest over the BF16 store (layer 1)."""
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.replay.sum_order import ordered_layer_norm

    generate(STABLELM, tmp_path / "patch", attention="engine")
    model = load_hf_model(make_tiny("stablelm", tmp_path / "stablelm", layers=3))
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 4
    runtime.apply(model, tmp_path / "patch", regions=[POST_NORM])
    try:
        for ly, stored in ((0, None), (1, torch.bfloat16)):
            norm = model.model.layers[ly].post_attention_layernorm
            want = ordered_layer_norm(x, [x.shape[-1]], norm.weight.float(), norm.bias.float(), norm.eps, 32, stored)
            assert torch.equal(norm(x), want[0].to(torch.bfloat16))
    finally:
        runtime.remove(model)


def test_two_norms_in_one_kernel_take_each_its_own_lanes() -> None:
    """A kernel fusing two RMSNorms (Gemma 2's post-attention and pre-feedforward norms) sums one row in 32 lanes,
    the next in 16: no single lane count, but each mean node pairs with its accumulator in order."""
    import json

    from graphdiff.analysis.scan import _reduction_lanes
    from graphdiff.records import Kernel, Node
    from graphdiff.replay.sum_order import cpp_sum_lanes, cpp_sum_lanes_each

    ((kid, code),) = json.loads((FIXTURES / "scans" / "gemma2_two_norms_kernel.json").read_text()).items()
    assert cpp_sum_lanes_each(code) == [32, 16] and cpp_sum_lanes(code) == 0
    means = [Node(name=f"mean_{i}", op="call_function", target="aten.mean.dim", kernel=kid) for i in (1, 2)]
    graph = Graph(name="g", nodes=means, kernels=[Kernel(id=kid, name=kid.split(":")[0], kind="generated",
                                                         nodes=["mean_1", "mean_2"], code=code)])
    assert _reduction_lanes([graph]) == {("g", "mean_1"): 32, ("g", "mean_2"): 16}
    assert _reduction_lanes([graph.model_copy(update={"nodes": means[:1]})]) == {}  # as many or none


def test_a_norm_region_with_sites_is_cut_where_its_kernels_read_the_store_back() -> None:
    """Nemotron's LayerNorm1P regions have sites (the weight + 1 in BF16) and a second layer whose norm kernel reads
    its input back from the BF16 copy it stored: that layer gets its own code, reading the store back (here on the
    recorded StableLM scan, whose post-attention norms read alike)."""
    from graphdiff.codegen.layer_groups import layer_groups
    from graphdiff.records import Region

    scan = ScanResult.model_validate_json((STABLELM / "scan.json").read_text())
    sited = Region(name="model.layers.*.post_attention_layernorm#norm_weight", kind="norm_weight",
                   module="model.layers.*.post_attention_layernorm", layers=[0, 1, 2], sites=[], rounded_on=["train"],
                   reduction_lanes={f"model.layers.{i}.post_attention_layernorm": 32 for i in range(3)})
    assert scan.norm_rereads == ["model.layers.1.post_attention_layernorm"]
    assert layer_groups(scan, sited) == [[1], [0, 2]]


# Granite's last layer (4 layers, hidden 512): the residual sum stored in a loop nest of its own, then the mean of
# squares and the normalization both loaded from that BF16 store (the kernel's code, cut to its loads and stores)
ALONE = """extern "C"  void  kernel(at::BFloat16* in_out_ptr0, const at::BFloat16* in_ptr0, float* out_ptr0)
{
    {
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(4096L); x0+=static_cast<int64_t>(32L))
        {
            auto tmp0 = at::vec::Vectorized<at::BFloat16>::loadu(in_out_ptr0 + static_cast<int64_t>(x0), 32);
            auto tmp2 = at::vec::Vectorized<at::BFloat16>::loadu(in_ptr0 + static_cast<int64_t>(x0), 32);
            tmp20.store(in_out_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(32));
        }
    }
    {
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(16L); x0+=static_cast<int64_t>(1L))
        {
            {
                float tmp_acc0 = 0;
                for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(256L); x1+=static_cast<int64_t>(32L))
                {
                    auto tmp0 = at::vec::Vectorized<at::BFloat16>::loadu(in_out_ptr0 + static_cast<int64_t>(x1), 32);
                    tmp_acc0_vec = tmp_acc0_vec + tmp2;
                }
                out_ptr0[static_cast<int64_t>(x0)] = static_cast<float>(tmp_acc0);
            }
            for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(256L); x1+=static_cast<int64_t>(32L))
            {
                auto tmp0 = at::vec::Vectorized<at::BFloat16>::loadu(in_out_ptr0 + static_cast<int64_t>(x1), 32);
            }
        }
    }
}"""


def _rms_norm(module: str, stored: bool, alone: bool = False) -> tuple[Graph, Graph]:
    """A trainer RMS norm's nodes and an engine kernel computing the residual sum and that norm; `stored`: the kernel
    stores the sum in BF16 and its second loop reads the store back (Inductor realized the sum); `alone`: it stores
    the sum in a loop nest of its own and every later loop, the mean's too, reads the store (`ALONE`)."""
    from graphdiff.records import BufferArg, Kernel, Node

    def node(name: str, target: str, *inputs: str, dtype: str = "float32", mod: str = module, **kw: object) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=list(inputs), dtype=dtype, module=mod,
                    shape=[16, 256], **kw)

    train = Graph(name="t", nodes=[
        Node(name="x", op="placeholder", target="x", dtype="bfloat16", shape=[16, 256]),
        node("_to_copy", "aten._to_copy.default", "x"),
        node("pow_1", "aten.pow.Tensor_Scalar", "_to_copy"),
        node("mean", "aten.mean.dim", "pow_1", call=[[{"node": "pow_1"}, [-1], True], {}])])
    reread = "for(x1) {\n tmp24.store(out_ptr0 + x1, 32);\n}\nfor(x1) {\n auto tmp0 = loadu(out_ptr0 + x1, 32);\n}"
    code = "extern \"C\" void kernel(const at::BFloat16* in_ptr0, at::BFloat16* out_ptr0, float* out_ptr1)\n{\n" + (
        reread if stored else "for(x1) {\n auto tmp0 = loadu(in_ptr0 + x1, 32);\n}") + "\n}"
    k = "cpp_fused_add_mean_pow_rsqrt_5:18"
    args = [BufferArg(name="buf53", role="out", dtype="bfloat16", node="add_492"),
            BufferArg(name="buf54", role="out", dtype="float32", node="mean_3")]
    if alone:
        code = ALONE
        args = [BufferArg(name="buf53", role="inout", dtype="bfloat16", node="add_492"),
                BufferArg(name="buf50", role="in", dtype="bfloat16"), args[1]]
    engine = Graph(name="e", nodes=[
        Node(name="a", op="placeholder", target="a", dtype="bfloat16"),
        node("add_492", "aten.add.Tensor", "a", dtype="bfloat16", kernel=k, mod=None),
        node("convert_element_type_11", "prims.convert_element_type.default", "add_492", kernel=k, mod=None),
        node("pow_4", "aten.pow.Tensor_Scalar", "convert_element_type_11", kernel=k, mod=None),
        node("mean_3", "aten.mean.dim", "pow_4", kernel=k, mod=None)],
        kernels=[Kernel(id=k, name=k.split(":")[0], kind="generated", nodes=["add_492", "mean_3"], code=code,
                        args=args)])
    return train, engine


def test_an_rms_norm_whose_kernel_stores_its_input_alone_reads_the_store_in_every_pass() -> None:
    """Granite's last layer: the residual sum stored in a loop nest of its own, the mean of squares and the
    normalization both from that BF16 store: the norm reads its stored input (the mean too), not a reread."""
    from graphdiff.analysis.match import Match
    from graphdiff.analysis.scan import norm_reads_stored, norm_rereads

    module = "model.layers.3.post_attention_layernorm"
    matched = {"e": ([Match(train="mean", engine="mean_3", distance=0.0, confidence=1.0, evidence="")], [])}
    train, engine = _rms_norm(module, True, alone=True)
    assert norm_reads_stored(train, [engine], matched) == [module]
    assert norm_rereads(train, [engine], matched) == []
    train, engine = _rms_norm(module, True)  # the sum stored in the mean's own loop: a reread
    assert norm_reads_stored(train, [engine], matched) == []
    assert norm_rereads(train, [engine], matched) == [module]


def test_an_rms_norm_whose_kernel_reads_its_stored_input_back_is_a_reread() -> None:
    """Granite's second layer: Inductor realizes the residual sum in the post-attention norm's kernel, sums the mean of
    squares over the FP32 sum and normalizes the BF16 copy it stored (its second loop loads it back)."""
    from graphdiff.analysis.match import Match
    from graphdiff.analysis.scan import norm_rereads

    module = "model.layers.1.post_attention_layernorm"
    for stored in (True, False):
        train, engine = _rms_norm(module, stored)
        matched = {"e": ([Match(train="mean", engine="mean_3", distance=0.0, confidence=1.0, evidence="")], [])}
        assert norm_rereads(train, [engine], matched) == ([module] if stored else [])
        assert norm_rereads(train, [engine]) == []  # no matched mean: nothing said


def test_an_rms_norm_that_rereads_its_store_normalizes_the_rounded_input() -> None:
    """The emitted norm (aligned, with the engine's lanes) takes the mean over the FP32 input and normalizes its
    BF16-rounded copy, as the engine kernel's second loop does; not aligned, it is HF's norm."""
    from graphdiff.codegen.emit_torch import store_readers

    region = "model.layers.*.post_attention_layernorm#norm_weight"
    frag, by_name = _norm_fragment(region, reads_store=True)
    assert store_readers(frag, by_name) == {"mul": ("_to_copy", "torch.bfloat16")}
    assert store_readers(frag.__class__(**{**frag.__dict__, "reads_store": False}), by_name) == {}
    norm = _emitted(frag, by_name)
    x = torch.randn(16, 256) * 3  # the FP32 sum the engine holds
    (out,) = norm(x, align=frozenset({region}), lanes=32)
    rms = torch.rsqrt(ordered_mean(x * x, [-1], True, 32) + 1e-06)
    assert torch.equal(out, x.to(torch.bfloat16).float() * rms) and not torch.equal(out, x * rms)
    (hf,) = norm(x, align=frozenset(), lanes=32)
    assert torch.equal(hf, x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-06))


def test_an_rms_norm_that_reads_its_stored_input_in_every_pass_normalizes_it_rounded() -> None:
    """Granite's last layer: aligned, the emitted norm rounds its input as the engine stored it and takes the mean
    and the normalization of that copy; not aligned, it is HF's norm."""
    region = "model.layers.*.post_attention_layernorm#norm_weight"
    norm = _emitted(*_norm_fragment(region, stored_input=True))
    x = torch.randn(16, 256) * 3
    (out,) = norm(x, align=frozenset({region}), lanes=32)
    low = x.to(torch.bfloat16).float()
    assert torch.equal(out, low * torch.rsqrt(ordered_mean(low * low, [-1], True, 32) + 1e-06))
    assert not torch.equal(out, low * torch.rsqrt(ordered_mean(x * x, [-1], True, 32) + 1e-06))
    (hf,) = norm(x, align=frozenset(), lanes=32)
    assert torch.equal(hf, x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-06))


def _emitted(frag, by_name: dict) -> Callable:  # noqa: ANN001
    from graphdiff.codegen.emit_torch import emit_function

    scope: dict = {}
    exec("\n".join(emit_function(frag, "norm", by_name)), {**vars(torch), "torch": torch, "_f32": lambda t: t.float(),
         "_round": lambda t, d: t.to(d).float(), "ordered_mean": ordered_mean}, scope)
    return scope["norm"]


def _norm_fragment(region: str, **flags: bool) -> tuple:
    """An RMS norm's fragment (the mean of squares, rsqrt, the product) summed in the engine kernel's order."""
    from graphdiff.codegen.fragment import Fragment
    from graphdiff.records import Node

    module = "model.layers.1.post_attention_layernorm"
    train, _ = _rms_norm(module, True)
    nodes = [*train.nodes[1:],
             Node(name="add", op="call_function", target="aten.add.Tensor", inputs=["mean"], module=module,
                  dtype="float32", call=[[{"node": "mean"}, 1e-06], {}]),
             Node(name="rsqrt", op="call_function", target="aten.rsqrt.default", inputs=["add"], module=module,
                  dtype="float32", call=[[{"node": "add"}], {}]),
             Node(name="mul", op="call_function", target="aten.mul.Tensor", inputs=["_to_copy", "rsqrt"],
                  module=module, dtype="float32", call=[[{"node": "_to_copy"}, {"node": "rsqrt"}], {}])]
    nodes[0] = nodes[0].model_copy(update={"call": [[{"node": "x"}], {"dtype": {"dtype": "float32"}}]})
    nodes[1] = nodes[1].model_copy(update={"call": [[{"node": "_to_copy"}, 2], {}]})
    by_name = {n.name: n for n in [train.nodes[0], *nodes]}
    return Fragment(key=region, target="module", module="model.layers.*.post_attention_layernorm", module_class="",
                    nodes=nodes, inputs=["x"], outputs=["mul"], regions=[region], ordered={"mean": region},
                    **flags), by_name


def test_a_regions_later_layers_sum_in_the_order_of_their_engine_modules() -> None:
    """A norm region whose sites sit in layer 0 (the later layers' values go unmatched: the engine's FP32 residual
    makes the unpatched trainer's sums other values) still serves every layer: the lanes of the engine module of the
    same name order each layer's rows (a top-1 Qwen2-MoE's layer-1 norm left 0.07% of its tokens off otherwise)."""
    from graphdiff.analysis.scan import lanes_by_module_name
    from graphdiff.records import Graph, Node

    def mean(name: str, module: str, kernel: str | None = None) -> list[Node]:
        return [Node(name=f"{name}_x", op="placeholder", target="x", dtype="float32", shape=[8, 256]),
                Node(name=name, op="call_function", target="aten.mean.dim", inputs=[f"{name}_x"],
                     call=[[{"node": f"{name}_x"}, [-1], True], {}], dtype="float32", shape=[8, 1], module=module,
                     kernel=kernel)]

    norms = [f"model.layers.{i}.post_attention_layernorm" for i in range(3)]
    train = Graph(name="t", nodes=[n for i, m in enumerate(norms) for n in mean(f"m{i}", m)])
    engine = Graph(name="e", nodes=[n for i, m in enumerate(norms) for n in mean(f"e{i}", m, f"k{i}")]
                   + mean("e9", "model.norm", "k9"))
    got = lanes_by_module_name(train, [engine], {"k0": 16, "k1": 16, "k2": 8, "k9": 8})
    assert got == {norms[0]: 16, norms[1]: 16, norms[2]: 8}  # model.norm: no trainer row sum of that name
    assert lanes_by_module_name(train, [engine], {"k0": 16}) == {norms[0]: 16}  # no order read: none claimed


QWEN2_MOE = FIXTURES / "scans" / "tiny-qwen2-moe-3"


def test_a_final_norm_the_patch_feeds_fp32_rounds_as_its_input_dtype_says(tmp_path: Path) -> None:
    """A final norm no value match paired (its engine input is the FP32 residual) is a `sum_order` region; HF's
    `.to(input_dtype)` before the weight rounds a BF16 input's normalized value and is no cast for the FP32 one the
    carry hands it, as the engine's kernel on its FP32 residual does not round there. The splice does the same."""
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.codegen.generate import load_scan_dir, make_patch, write_patch

    scan, train = load_scan_dir(QWEN2_MOE)
    unmatched = scan.model_copy(update={"regions": [r for r in scan.regions if r.module != "model.norm"]})
    manifest = write_patch(make_patch(unmatched, train, regions=["model.norm#sum_order"]), tmp_path / "patch")
    splice = next(s for s in manifest.splices if s.module == "model.norm")
    assert splice.reduction_lanes == {"model.norm": 16} and "input's dtype" in splice.triton_problem
    model = load_hf_model(make_tiny("qwen2_moe", tmp_path / "m", layers=3))
    norm = model.model.norm
    x = torch.randn(4096, model.config.hidden_size, generator=torch.Generator().manual_seed(2)) * 3

    def engine_order(h: torch.Tensor, round_normed: bool) -> torch.Tensor:
        normed = h.float() * torch.rsqrt(ordered_mean(h.float().pow(2), [-1], True, 16) + norm.variance_epsilon)
        normed = normed.to(torch.bfloat16).float() if round_normed else normed
        return (norm.weight.float() * normed).to(torch.bfloat16)

    runtime.apply(model, tmp_path / "patch")
    try:
        out = norm(x)
        assert torch.equal(out, engine_order(x, round_normed=False))
        assert not torch.equal(out, engine_order(x, round_normed=True))  # rounding as traced would differ
        low = x.to(torch.bfloat16)
        assert torch.equal(norm(low), engine_order(low, round_normed=True))
    finally:
        runtime.remove(model)
