"""The replay's kernel fragments on hand-made graphs."""

from __future__ import annotations

from graphdiff.kernel_replay import kernel_fragment
from graphdiff.model import Graph, Kernel, Node


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
    from graphdiff.kernel_reload import SUFFIX, reload_variant, reloaded_stores
    from graphdiff.model import BufferArg

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
