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

from graphdiff.codegen import carry
from graphdiff.codegen.fragment import rounded_sums
from graphdiff.records import Graph, ManifestSplice, Node, ScanResult
from graphdiff.runtime import _round_sums


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
    splice = ManifestSplice(key="model.layers.*", target="carry", module="model.layers.*", regions=["r"],
                            rounded_sums=rounded)
    _round_sums(carry, splice, name, layer, state)  # the carry module's parts, as the generated module carries them
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


def test_the_scan_names_post_norm_sums_the_engine_stores() -> None:
    """Hand-made plan: layer 0's sum of the post-norm's output is stored by the engine in BF16, layer 1's is FP32
    (fused into the final norm)."""
    def add(name: str, layer: int, inputs: list[str]) -> Node:
        return Node(name=name, op="call_function", target="aten.add.Tensor", inputs=inputs, dtype="bfloat16",
                    module=f"model.layers.{layer}")

    def norm_out(name: str, layer: int) -> Node:
        return Node(name=name, op="call_function", target="aten.mul.Tensor", inputs=[], dtype="bfloat16",
                    module=f"model.layers.{layer}.post_attention_layernorm")

    graph = Graph(name="t", nodes=[norm_out("n0", 0), add("a0", 0, ["x", "n0"]), norm_out("n1", 1),
                                   add("a1", 1, ["a0", "n1"]), Node(name="x", op="placeholder", target="x")])
    plan = [{"id": "a0", "node": "a0", "op": "aten.add.Tensor", "rule": "matched", "train": {"dtype": "bfloat16"},
             "engine": {"dtype": "bfloat16", "rounds": True, "on_grid": True}},
            {"id": "a1", "node": "a1", "op": "aten.add.Tensor", "rule": "matched", "train": {"dtype": "bfloat16"},
             "engine": {"dtype": "float32"}}]
    scan = ScanResult.model_validate({**json.loads(Path("fixtures/scans/tiny-qwen3/scan.json").read_text()),
                                      "plan": plan})
    assert rounded_sums(scan, graph, "model.layers.*") == {"post_attention_layernorm": [0]}


def test_an_op_the_mode_passes_on_keeps_its_callers_source() -> None:
    from graphdiff.capture.fx import _source

    trace = ('  File "/m/modeling_exaone4.py", line 307, in forward\n    hidden_states = residual + hidden_states\n'
             '  File "/p/graphdiff_patch.py", line 576, in __torch_function__\n'
             '    out = func(*args, **(kwargs or {}))\n')
    src = _source(trace)
    assert src is not None and (src.file, src.line) == ("/m/modeling_exaone4.py", 307)
