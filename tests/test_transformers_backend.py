"""A model vLLM runs through its Transformers backend (Phi: Inductor compiles HF's own code), from a recorded scan.

No engine: fixtures/scans/tiny-phi-3 is a real scan of a 3-layer seeded tiny Phi (AMD EPYC, AVX-512 BF16, no AMX).
Its parallel block sums `attn_output + mlp_output + residual`, the engine's kernel both children's outputs in FP32;
the final norm's kernel loads the last layer's incoming sum from the BF16 copy the previous kernel stored, while that
kernel's norm read it in FP32; and the engine computes RoPE's cos / sin and GELU's tanh in Inductor-generated
kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.codegen import generate
from graphdiff.models.tiny import make_tiny

PHI = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-phi-3"


@pytest.fixture(scope="module")
def patch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("phi-patch")
    generate(PHI, out)
    return out


def test_the_carry_sums_the_children_in_fp32_and_reads_the_stored_sum_in_the_last_layer(patch: Path) -> None:
    manifest = json.loads((patch / "manifest.json").read_text())
    carries = {tuple(s["layers"]): s for s in manifest["splices"] if s["target"] == "carry" and not s["problems"]}
    assert sorted(carries) == [(0,), (1,), (2,)], sorted(carries)
    assert all(s["fp32_outputs"] == ["mlp", "self_attn"] for s in carries.values())
    assert carries[(2,)]["torch_fn"] == "carry_fp32_rounded" and carries[(2,)]["fp32_children"] == ["input_layernorm"]
    assert carries[(0,)]["torch_fn"] == carries[(1,)]["torch_fn"] == "carry_fp32"


def test_the_engines_transcendental_math_is_computed_by_inductor_when_aligned(patch: Path) -> None:
    source = (patch / "graphdiff_patch.py").read_text()
    for name in ("cos", "sin", "tanh"):
        assert f"inductor_math({name!r}, " in source, name
    assert "inductor_math('exp'" not in source  # Phi's graph has no exp


def test_the_patch_installs_each_layers_carry(patch: Path, tmp_path: Path) -> None:
    from graphdiff.capture.hf import load_hf_model

    model = load_hf_model(make_tiny("phi", tmp_path / "phi", layers=3))
    ids = torch.tensor([[5, 900, 31, 77, 1200, 8, 64, 300]])
    with torch.no_grad():
        base = model(input_ids=ids, use_cache=False).logits
    runtime.apply(model, patch)

    def hooks(mod: torch.nn.Module) -> set[str]:
        return {getattr(getattr(h, "func", h), "__name__", "") for h in
                [*mod._forward_pre_hooks.values(), *mod._forward_hooks.values()]}

    layers = model.model.layers
    assert "carry_fp32" in hooks(layers[0]) and "carry_fp32" in hooks(layers[1])
    assert "carry_fp32_rounded" in hooks(layers[2]) and "carry_fp32" not in hooks(layers[2])
    assert all("carry_fp32_output" in hooks(layer.self_attn) and "carry_fp32_output" in hooks(layer.mlp)
               for layer in layers)
    with torch.no_grad():
        patched = model(input_ids=ids, use_cache=False).logits
    assert torch.isfinite(patched).all() and not torch.equal(patched, base)
    # a scan of the patched trainer traces it: Inductor's math stays one recorded op, computed when the graph runs
    from graphdiff.capture.hf import run_graph, trace_hf

    gm, _ = trace_hf(model, ids)
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"graphdiff.inductor_cos.default", "graphdiff.inductor_tanh.default"} <= ops, ops
    assert torch.equal(run_graph(gm, model, ids), patched)
    runtime.remove(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, base)
