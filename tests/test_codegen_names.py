"""How generated code names its values (graphdiff.codegen.names): by the source line's variable, fresh every time,
never a name the emitted code or its kernels use for something else."""

from __future__ import annotations

from graphdiff.codegen.fragment import Fragment
from graphdiff.codegen.names import Namer, arguments, assigned, value_names
from graphdiff.records import Node, Source


def test_the_assigned_variable_is_read_from_simple_assignments_only() -> None:
    assert assigned("q_embed = (q * cos) + (rotate_half(q) * sin)") == "q_embed"
    assert assigned("    x: torch.Tensor = x.float()") == "x"
    for code in ("return self.weight * hidden_states.to(input_dtype)", "cos, sin = position_embeddings",
                 "self.scale = 2", "x += 1", "if a == b:", "else: y = 1"):
        assert assigned(code) is None, code


def test_names_are_fresh_and_leave_the_emitted_codes_own_names_alone() -> None:
    namer = Namer()
    assert [namer.claim(b) for b in ("x", "x", "x_1", "_to_copy", "torch", "mask", "a0", "g1_ptr", "lambda")] == \
        ["x", "x_1", "x_1_1", "to_copy", "torch_1", "mask_1", "a0_1", "g1_ptr_1", "lambda_1"]
    # a kernel derives x_ptr, x_rows, x_s and the adjoint d_x from x: none of them can name another value
    assert namer.claim("x_ptr") == "x_ptr_1" and namer.claim("d_x") == "d_x_2"  # d_x_1: x_1's adjoint
    other = Namer()
    assert other.claim("d_h") == "d_h" and other.claim("h") == "h_1"  # h's adjoint would be d_h
    assert Namer.holding({"a": "variance"}).claim("variance") == "variance_1"


def _node(name: str, target: str, inputs: list[str], code: str, line: int) -> Node:
    return Node(name=name, op="call_function", target=target, inputs=inputs,
                source=Source(file="m.py", line=line, code=code, function="f"))


def test_values_are_named_by_the_line_they_complete() -> None:
    line = "q_embed = (q * cos) + (rotate_half(q) * sin)"
    nodes = [_node("mul_9", "aten.mul.Tensor", ["t", "c"], line, 3),
             _node("neg", "aten.neg.default", ["t"], "return torch.cat((-x2, x1), dim=-1)", 9),
             _node("mul_10", "aten.mul.Tensor", ["neg", "s"], line, 3),
             _node("add_4", "aten.add.Tensor", ["mul_9", "mul_10"], line, 3),
             _node("rsqrt_2", "aten.rsqrt.default", ["add_4"], "return torch.rsqrt(x)", 12)]
    frag = Fragment(key="f", target="function", module="m", module_class="", nodes=nodes, inputs=["t", "c", "s"])
    names = value_names(frag, arguments(frag, ["q", "cos", "sin"]))
    assert names == {"t": "q", "c": "cos", "s": "sin", "mul_9": "q_embed_mul", "neg": "neg",
                     "mul_10": "q_embed_mul_1", "add_4": "q_embed", "rsqrt_2": "rsqrt"}
    assert arguments(frag) == ["arg0", "arg1", "arg2"]  # before the binding
