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
