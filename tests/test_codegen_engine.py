"""Patches for freshly scanned tiny Qwen2 and Llama, and the patched Qwen3's log-prob gap to the real engine.

Marked `engine`: each scan starts vLLM (~40 s), the gap measurement samples from it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.codegen import generate
from tests.test_codegen import check_pytorch_path, triton_in_interpreter

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_generated_regions_of_other_architectures(arch: str, tiny_models: dict[str, Path], tmp_path: Path,
                                                  cli_scan) -> None:
    pytest.importorskip("vllm")
    from graphdiff.capture.hf import load_hf_model

    scan_dir, out = cli_scan(arch)[0], tmp_path / "patch"
    manifest = generate(scan_dir, out)
    assert {"rope", "gated_act", "residual_norm", "norm_weight"} <= {r.kind for r in manifest.regions}
    assert all(r.generated for r in manifest.regions), [r.reason for r in manifest.regions]
    check_pytorch_path(scan_dir, out)
    triton_in_interpreter(scan_dir, out)
    model = load_hf_model(tiny_models[arch])
    ids = torch.tensor([[5, 77, 300, 12, 999, 4, 18, 250]])
    with torch.no_grad():
        base = model(input_ids=ids).logits
        runtime.apply(model, out, regions=[])
        assert torch.equal(model(input_ids=ids).logits, base)
    runtime.apply(model, out)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    runtime.remove(model)


def test_patch_shrinks_the_log_prob_gap_to_the_engine(tiny_models: dict[str, Path], tmp_path: Path,
                                                      cli_scan) -> None:
    """Tiny Qwen3 scanned against this machine's engine (its attention kernel decides whether there is an attention
    region), 8 prompts x 128 sampled tokens, vLLM compiled vs HF eager."""
    pytest.importorskip("vllm")
    from graphdiff.engines.samples import random_prompts
    from graphdiff.measure.kl import measure
    from graphdiff.models.resolve import read_config

    generate(cli_scan("qwen3")[0], tmp_path / "patch")
    model_dir = tiny_models["qwen3"]
    prompts = random_prompts(read_config(model_dir), 8, 16, 0)
    result = measure(model_dir, prompts, max_tokens=128, manifest=tmp_path / "patch" / "manifest.json",
                     out_dir=tmp_path / "kl")
    plain = next(m for m in result.measurements if not m.regions)
    patched = next(m for m in result.measurements if m.regions)
    # k3 is the low-variance per-token KL estimate: at 1024 tokens k1's standard error (~1e-3) is
    # larger than the whole effect, so a k1 threshold would test noise (benchmarks/exact_kl.py measures the
    # exact KL: -99.5%). The goals: KL -80%, RMS of the log-prob difference -40%.
    assert patched.k3 <= 0.2 * plain.k3, (plain.k3, patched.k3)
    assert patched.rms <= 0.6 * plain.rms, (plain.rms, patched.rms)
