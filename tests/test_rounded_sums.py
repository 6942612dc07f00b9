"""The carry's rounded residual sums: a post-norm layer whose sums the engine stores in BF16 (Exaone 4, OLMo 2).

The patch holds the post-norm's output in FP32 (the engine's add reads it unrounded); eager type promotion then keeps
the sum FP32 into the next add and the next layer, where the engine stored it in BF16. The carry rounds those sums
in the layers the scan names, and nowhere else."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from graphdiff.analysis.match import Match
from graphdiff.codegen import carry
from graphdiff.codegen.carry_plan import rounded_sums
from graphdiff.records import CarrySplice, Graph, Node, ScanResult
from graphdiff.runtime.carry import round_sums


class _Norm(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 1.001  # a post-norm whose output the patch holds in FP32


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.post_attention_layernorm = _Norm()
        self.post_feedforward_layernorm = _Norm()

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        mid = hidden_states
        hidden_states = mid + self.post_feedforward_layernorm(hidden_states)
        return mid, hidden_states


def _hooked(rounded: dict[str, list[int]], name: str = "model.layers.0") -> tuple[_Layer, Any]:
    layer, state = _Layer(), SimpleNamespace(undo=[])
    splice = CarrySplice(key="model.layers.*", module="model.layers.*", regions=["r"],
                            rounded_sums=rounded)
    round_sums(carry, splice, name, layer, state)  # the carry module's parts, as the generated module carries them
    return layer, state


def _run(rounded: dict[str, list[int]], name: str = "model.layers.0") -> tuple[torch.Tensor, torch.Tensor]:
    layer, _ = _hooked(rounded, name)
    return layer(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).bfloat16())


def test_the_named_sums_are_rounded_in_the_named_layers_only() -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    mid, out = _run({"post_attention_layernorm": [0, 1], "post_feedforward_layernorm": [0]})
    want_mid = (x.float() + x.float() * 1.001).bfloat16()
    assert mid.dtype == torch.bfloat16 and torch.equal(mid, want_mid)
    assert torch.equal(out, (want_mid.float() + want_mid.float() * 1.001).bfloat16())
    mid, out = _run({"post_attention_layernorm": [0, 1], "post_feedforward_layernorm": [0]}, "model.layers.1")
    assert mid.dtype == torch.bfloat16 and out.dtype == torch.float32  # the last layer's sum: FP32 for the final norm
    mid, out = _run({"post_attention_layernorm": [1]})
    assert mid.dtype == torch.float32 and out.dtype == torch.float32  # no hooks on layer 0


def test_the_mode_is_left_and_the_hooks_removed() -> None:
    layer, state = _hooked({"post_attention_layernorm": [0]})
    layer(torch.randn(2, 8).bfloat16())
    assert not torch.overrides._is_torch_function_mode_enabled() and "_graphdiff_sums" not in layer.__dict__
    with pytest.raises(AttributeError):
        layer("not a tensor")  # a forward that raises leaves the mode too
    assert not torch.overrides._is_torch_function_mode_enabled()
    for undo in state.undo:
        undo()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in layer.modules())


def test_gradients_flow_through_a_rounded_sum() -> None:
    layer, _ = _hooked({"post_attention_layernorm": [0]})
    x = torch.randn(4, 16).bfloat16().requires_grad_()
    mid, out = layer(x)
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all() and x.grad.abs().sum() > 0


def test_the_carry_names_each_rounded_sum_by_the_child_it_sums() -> None:
    """Layer 0's sum of the post-norm's output is one the engine rounds, layer 1's (read by the final norm's kernel in
    FP32) is not."""
    def add(name: str, layer: int, inputs: list[str]) -> Node:
        return Node(name=name, op="call_function", target="aten.add.Tensor", inputs=inputs, dtype="bfloat16",
                    module=f"model.layers.{layer}")

    def norm_out(name: str, layer: int) -> Node:
        return Node(name=name, op="call_function", target="aten.mul.Tensor", inputs=[], dtype="bfloat16",
                    module=f"model.layers.{layer}.post_attention_layernorm")

    graph = Graph(name="t", nodes=[norm_out("n0", 0), add("a0", 0, ["x", "n0"]), norm_out("n1", 1),
                                   add("a1", 1, ["a0", "n1"]), Node(name="x", op="placeholder", target="x")])
    scan = ScanResult.model_validate({**json.loads(Path("fixtures/scans/tiny-qwen3/scan.json").read_text()),
                                      "rounded_sums": ["a0"]})
    assert rounded_sums(scan, graph, "model.layers.*") == {"post_attention_layernorm": [0]}


def test_an_op_the_mode_passes_on_keeps_its_callers_source() -> None:
    from graphdiff.capture.fx import _source

    trace = ('  File "/m/modeling_exaone4.py", line 307, in forward\n    hidden_states = residual + hidden_states\n'
             '  File "/p/graphdiff_patch.py", line 576, in __torch_function__\n'
             '    out = func(*args, **(kwargs or {}))\n')
    src = _source(trace)
    assert src is not None and (src.file, src.line) == ("modeling_exaone4.py", 307)  # no package: its name


class _PreNormLayer(torch.nn.Module):
    """StableLM's order: the sum after attention feeds the post-attention norm and the residual add after the MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _Norm()
        self.post_attention_layernorm = _Norm()

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states + self.attn(hidden_states)
        normed = self.post_attention_layernorm(residual)
        return normed, residual + normed.bfloat16()


def test_a_stored_sum_is_read_rounded_by_the_later_adds_only() -> None:
    layer, state = _PreNormLayer(), SimpleNamespace(undo=[])
    splice = CarrySplice(key="k", module="model.layers.*", regions=["r"], stored_sums={"attn": [0]})
    round_sums(carry, splice, "model.layers.0", layer, state)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).float()
    normed, out = layer(x)
    mid = x + x * 1.001
    assert torch.equal(normed, mid * 1.001)  # the norm beside it reads the FP32 sum
    assert out.dtype == torch.float32 and torch.equal(out, mid.bfloat16().float() + (mid * 1.001).bfloat16().float())
    assert not torch.equal(out, mid + (mid * 1.001).bfloat16().float())


def test_the_scan_names_a_sum_one_kernel_stores_for_the_next() -> None:
    """The engine's sum `e_add` (of the matched operands) is computed in kernel k1 (its norm reads it in FP32) and
    loaded by kernel k2; an engine sum of other operands is not the trainer's (Cohere's association)."""
    from graphdiff.analysis.scan import residual_sums
    from graphdiff.records import Kernel

    def n(name: str, target: str, inputs: list[str], kernel: str = "") -> Node:
        return Node(name=name, op="call_function", target=target, inputs=inputs, dtype="bfloat16",
                    module="model.layers.0", kernel=kernel or None)

    train = Graph(name="t", nodes=[n("x", "aten.mm.default", []), n("y", "aten.mm.default", []),
                                   n("add", "aten.add.Tensor", ["x", "y"])])
    for operands, readers, want in ((["e_x", "e_y"], [n("e_next", "aten.add.Tensor", ["e_add"], "k2")], ["add"]),
                                    (["e_x", "e_y"], [n("e_norm", "aten.mul.Tensor", ["e_add"], "k1")], []),
                                    (["e_x", "e_z"], [n("e_next", "aten.add.Tensor", ["e_add"], "k2")], [])):
        engine = Graph(name="e", nodes=[n("e_x", "aten.mm.default", []), n("e_y", "aten.mm.default", []),
                                        n("e_z", "aten.mm.default", []),
                                        n("e_add", "aten.add.Tensor", operands, "k1"), *readers],
                       kernels=[Kernel(id="k1", name="k1", kind="generated", nodes=["e_add", "e_norm"]),
                                Kernel(id="k2", name="k2", kind="generated", nodes=["e_next"])])
        matches = [Match(a, b, 0.0, 1.0, "") for a, b in (("add", "e_add"), ("x", "e_x"), ("y", "e_y"))]
        assert residual_sums(train, {"e": (matches, [])}, [engine], []) == ([], want), operands


def test_a_layers_own_stored_sum_leaves_its_incoming_activation_fp32(tmp_path: Path) -> None:
    """StableLM's second layer (the recorded fixtures/scans/tiny-stablelm-3 scan): its own `residual + attn` sum is
    stored in BF16 by one kernel and read back by the layer's next add in another, which the plan names
    (`read_rounded_by`). That is the layer's own sum (`stored_sums`), not its incoming activation: the carry stays
    `carry_fp32` for every layer (a rounded carry rounded the residual stream and lost StableLM's bit-exact match)."""
    from graphdiff.codegen import generate

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-stablelm-3"
    scan = json.loads((fixture / "scan.json").read_text())
    stored = [d for d in scan["plan"] if d["node"] in scan["stored_sums"]]
    assert stored and all(d["evidence"]["read_rounded_by"] for d in stored)
    made = generate(fixture, tmp_path / "patch")
    carries = [s for s in made.splices if s.target == "carry" and not s.problems]
    assert carries and all(s.torch_fn == "carry_fp32" and not s.fp32_children for s in carries), carries
    assert any(s.stored_sums == {"self_attn.o_proj": [1]} for s in carries)


class _ScaledLayer(_PreNormLayer):
    """Granite's order: the attention output scaled by `residual_multiplier` before the add, held FP32 by the carry."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states + self.attn(hidden_states) * 0.22
        normed = self.post_attention_layernorm(residual)
        return normed, residual + normed.bfloat16() * 0.22


def test_a_stored_sum_of_a_scaled_child_output_is_named_by_the_child() -> None:
    """`residual + self_attn(x)[0] * residual_multiplier` (Granite's second layer, the sum the engine stores): the scan
    names the add, the carry names the direct child whose output the scale reads (the carry holds that output FP32),
    and the mode follows the scale to the add; the later add reads the sum rounded, the norm the FP32 sum."""
    from graphdiff.codegen.carry_plan import stored_sums

    layer = "model.layers.1"
    graph = Graph(name="t", nodes=[
        Node(name="x", op="placeholder", target="x"),
        Node(name="mm", op="call_function", target="aten.mm.default", inputs=["x"], module=f"{layer}.self_attn.o_proj"),
        Node(name="mul", op="call_function", target="aten.mul.Tensor", inputs=["mm"], module=layer),
        Node(name="add", op="call_function", target="aten.add.Tensor", inputs=["x", "mul"], module=layer)])
    scan = ScanResult.model_validate({**json.loads(Path("fixtures/scans/tiny-qwen3/scan.json").read_text()),
                                      "stored_sums": ["add"]})
    assert stored_sums(scan, graph, "model.layers.*") == {"self_attn": [1]}
    module, state = _ScaledLayer(), SimpleNamespace(undo=[])
    splice = CarrySplice(key="k", module="model.layers.*", regions=["r"], stored_sums={"attn": [0]})
    round_sums(carry, splice, "model.layers.0", module, state)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).float()
    normed, out = module(x)
    mid = x + (x * 1.001) * 0.22
    assert torch.equal(normed, mid * 1.001)
    later = ((mid * 1.001).bfloat16() * 0.22).float()
    assert out.dtype == torch.float32 and torch.equal(out, mid.bfloat16().float() + later)
    assert not torch.equal(out, mid + later)


class _ReshapingLayer(_PreNormLayer):
    """OPT's order: the sum after attention reshaped (`residual = hidden_states.reshape(-1, hidden)`) before the norm
    and the add after the MLP read it."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = hidden_states + self.attn(hidden_states)
        residual = summed.reshape(-1, summed.shape[-1])
        normed = self.post_attention_layernorm(residual)
        return normed, residual + normed.bfloat16()


def test_a_view_of_a_stored_sum_is_read_rounded_by_the_later_adds() -> None:
    layer, state = _ReshapingLayer(), SimpleNamespace(undo=[])
    splice = CarrySplice(key="k", module="model.layers.*", regions=["r"], stored_sums={"attn": [0]})
    round_sums(carry, splice, "model.layers.0", layer, state)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2)).float()
    normed, out = layer(x)
    mid = (x + x * 1.001).reshape(-1, 64)
    assert torch.equal(normed, mid * 1.001)  # the norm beside it reads the FP32 sum
    assert torch.equal(out, mid.bfloat16().float() + (mid * 1.001).bfloat16().float())
