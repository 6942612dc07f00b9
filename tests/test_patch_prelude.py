"""The helpers a generated patch carries as source, tested as the real functions they are: the truncating store
(one definition, the scanner's too) and the carry hooks."""

from __future__ import annotations

import functools

import pytest
import torch

from graphdiff.capture.cpu_kind import store_like
from graphdiff.codegen import prelude
from graphdiff.codegen.carry import carry_done, carry_fp32, carry_fp32_child, carry_fp32_rounded
from graphdiff.codegen.prelude import namespace, round_toward_zero


def test_round_toward_zero_stores_bf16_by_truncation_and_passes_the_gradient() -> None:
    x = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100).requires_grad_(True)
    got = round_toward_zero(x)
    kept = got.detach()
    assert torch.equal(kept.to(torch.bfloat16).float(), kept)  # on the BF16 grid
    assert (kept.abs() <= x.detach().abs()).all() and (kept.sign() == x.detach().sign()).all()  # toward zero
    step = torch.ldexp(torch.ones_like(kept), torch.frexp(x.detach()).exponent - 8)  # BF16 spacing at |x|
    assert ((x.detach() - kept).abs() < step).all()  # the nearest grid value toward zero
    nearest = x.detach().to(torch.bfloat16).float()
    assert (nearest != kept).any() and torch.equal(round_toward_zero(nearest), nearest)
    got.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    # the scanner's store on a truncating ops build is the same definition
    assert torch.equal(store_like(x.detach(), "_C_AVX512"), kept.to(torch.bfloat16))


def test_the_prelude_namespace_names_what_emitted_code_calls() -> None:
    ns = namespace()
    x = torch.tensor([1.00390625, -3.0078125])  # between BF16 neighbours: 1 + 2^-8, -(3 + 2^-7)
    assert ns["_round"](x, torch.bfloat16).tolist() == [1.0, -3.0] and ns["_round"](x, torch.bfloat16).dtype == x.dtype
    assert ns["_f32"](x.bfloat16()).dtype == torch.float32 and ns["_f32"](torch.arange(3)).dtype == torch.int64
    assert {"ordered_sum", "ordered_mean", "round_toward_zero", "truncate_to_bf16", "torch", "F"} <= set(ns)


class _Norm(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x
        return x * 2


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _Norm()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.own = hidden_states
        return hidden_states + self.norm(hidden_states)


def test_carry_fp32_hands_the_layer_an_fp32_activation() -> None:
    layer = _Layer()
    layer.register_forward_pre_hook(carry_fp32, with_kwargs=True)
    x = torch.randn(2, 8).bfloat16()
    assert layer(x).dtype == torch.float32 and layer(hidden_states=x).dtype == torch.float32
    assert carry_fp32(layer, (3,), {"hidden_states": None}) == ((3,), {"hidden_states": None})


def test_carry_rounded_gives_the_layer_bf16_values_and_the_named_child_the_fp32_ones() -> None:
    layer = _Layer()
    layer.register_forward_pre_hook(carry_fp32_rounded, with_kwargs=True)
    layer.norm.register_forward_pre_hook(functools.partial(carry_fp32_child, layer))
    layer.register_forward_hook(carry_done)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))  # FP32, off the BF16 grid
    for call in (lambda: layer(x), lambda: layer(hidden_states=x)):
        out = call()
        rounded = x.bfloat16().float()
        assert torch.equal(layer.own, rounded) and torch.equal(layer.norm.seen, x)
        assert torch.equal(out, rounded + x * 2) and "_graphdiff_carry" not in layer.__dict__


def test_inductor_math_is_the_compiled_function_and_differentiable() -> None:
    """cos / sin / tanh / exp through Inductor: what a torch.compile'd function of the op returns (the engine's
    kernels' math library), for any shape without recompiling per shape, with the op's gradient."""
    from graphdiff.codegen.prelude import inductor_math

    gen = torch.Generator().manual_seed(0)
    for name in ("cos", "sin", "tanh", "exp"):
        reference = torch.compile(getattr(torch, name), dynamic=True)
        for size in (37, 4096):
            x = torch.randn(size, generator=gen) * 8
            assert torch.equal(inductor_math(name, x), reference(x)), name
    x = torch.randn(64, generator=gen).requires_grad_(True)
    inductor_math("sin", x).sum().backward()
    assert torch.allclose(x.grad, x.detach().cos(), rtol=1e-6, atol=1e-6)


def test_source_refuses_a_file_edited_after_import(tmp_path, monkeypatch):
    """A function whose file changed on disk after the import: its lines are another function's now, so a patch
    would carry the wrong code; `source` says so in one line instead."""
    import importlib
    import linecache

    from graphdiff.errors import GraphdiffError

    module = tmp_path / "carried_part.py"
    module.write_text("def scale(x):\n    return x * 2\n\n\ndef shift(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    part = importlib.import_module("carried_part")
    assert prelude.source((part.shift,)) == ["def shift(x):", "    return x + 1"]
    module.write_text("import math\n\n\n\ndef scale(x):\n    return x * 2\n\n\ndef shift(x):\n    return x + 1\n")
    linecache.checkcache(str(module))
    with pytest.raises(GraphdiffError, match="changed on disk"):
        prelude.source((part.shift,))
