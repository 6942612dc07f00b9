"""The training runtime: apply/remove on a real HF model, toggles, refusals, training-step gradients."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.codegen import generate
from graphdiff.runtime import PatchError

QWEN3 = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-qwen3"
IDS = torch.tensor([[17, 912, 33, 1500, 7, 256, 1024, 3, 88, 640, 1999, 5, 42, 9, 77, 1200]])


@pytest.fixture(scope="module")
def patch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("patch")
    generate(QWEN3, out)
    return out


@pytest.fixture()
def qwen3(tiny_models: dict[str, Path]):
    from graphdiff.capture.hf import load_hf_model

    return load_hf_model(tiny_models["qwen3"])


def logits(model) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


def test_no_region_aligned_is_bit_identical_to_hf_and_remove_restores(qwen3, patch_dir: Path) -> None:
    base = logits(qwen3)
    runtime.apply(qwen3, patch_dir / "manifest.json", regions=[])
    assert torch.equal(logits(qwen3), base)  # the generated code rounds exactly where HF eager does
    runtime.apply(qwen3, patch_dir / "manifest.json")
    patched = logits(qwen3)
    assert not torch.equal(patched, base)
    runtime.apply(qwen3, patch_dir)  # idempotent: re-applying replaces, never stacks
    assert torch.equal(logits(qwen3), patched)
    assert runtime.active_regions(qwen3) is not None
    runtime.remove(qwen3)
    runtime.remove(qwen3)
    assert runtime.active_regions(qwen3) is None
    assert torch.equal(logits(qwen3), base)


def test_each_region_toggles_alone(qwen3, patch_dir: Path) -> None:
    base = logits(qwen3)
    names = [r["name"] for r in json.loads((patch_dir / "manifest.json").read_text())["regions"]]
    for name in names:
        runtime.apply(qwen3, patch_dir, regions=[name])
        assert not torch.equal(logits(qwen3), base), name
    runtime.remove(qwen3)


def test_patched_models_in_one_process_do_not_affect_each_other(tiny_models: dict[str, Path],
                                                                  patch_dir: Path) -> None:
    """A function splice (apply_rotary_pos_emb) is one module-level name for the whole process: each model
    still runs its own alignment, and an unpatched model the original."""
    from graphdiff.capture.hf import load_hf_model

    a, b, c = (load_hf_model(tiny_models["qwen3"]) for _ in range(3))
    base = logits(c)
    runtime.apply(a, patch_dir)
    aligned = logits(a)
    rope = ["model.layers.*.self_attn#rope"]
    runtime.apply(b, patch_dir, regions=rope)
    rope_only = logits(b)
    assert not torch.equal(rope_only, base) and not torch.equal(rope_only, aligned)
    assert torch.equal(logits(a), aligned)  # b's patch left a's alignment alone
    assert torch.equal(logits(c), base)  # and the unpatched model runs HF's own function
    runtime.remove(a)
    assert torch.equal(logits(b), rope_only)
    runtime.remove(b)
    assert torch.equal(logits(b), base)


def test_apply_and_remove_leave_transformers_globals_as_they_were(tiny_models: dict[str, Path],
                                                                   patch_dir: Path) -> None:
    """The attention function apply registers with transformers and the module-level function it replaces are
    there while a patched model uses them, and gone once the last one is removed (nothing leaks across applies)."""
    from transformers import AttentionInterface
    from transformers.models.qwen3 import modeling_qwen3

    from graphdiff.capture.hf import load_hf_model

    a, b, kept = (load_hf_model(tiny_models["qwen3"]) for _ in range(3))
    runtime.apply(kept, patch_dir)  # a model patched before and kept: what it registered stays as it was
    registry, rope, impl = dict(AttentionInterface._global_mapping), modeling_qwen3.apply_rotary_pos_emb, \
        a.config._attn_implementation
    runtime.apply(a, patch_dir)
    runtime.apply(b, patch_dir)
    name = a.config._attn_implementation  # the patch's attention function, registered under its own name
    assert name != impl and name.startswith("graphdiff_") and name in AttentionInterface._global_mapping
    # the HF function is swapped for the runtime's dispatcher (one may be installed already by a model an earlier
    # test patched and kept: then it is the same dispatcher, standing in for the same HF function)
    hf_rope = getattr(rope, "__wrapped__", rope)
    assert modeling_qwen3.apply_rotary_pos_emb is not hf_rope
    assert modeling_qwen3.apply_rotary_pos_emb.__wrapped__ is hf_rope
    runtime.remove(a)
    assert b.config._attn_implementation == name and name in AttentionInterface._global_mapping  # b still runs it
    assert a.config._attn_implementation == impl
    runtime.remove(b)
    assert dict(AttentionInterface._global_mapping) == registry and modeling_qwen3.apply_rotary_pos_emb is rope
    runtime.apply(a, patch_dir)
    runtime.remove(a)
    assert dict(AttentionInterface._global_mapping) == registry
    runtime.remove(kept)


def loss_and_grads(model) -> tuple[float, dict[str, torch.Tensor]]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    out = model(input_ids=IDS, labels=IDS, use_cache=False)
    out.loss.backward()
    return float(out.loss), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_training_step_gradients_are_finite_and_close(qwen3, patch_dir: Path) -> None:
    qwen3.train()
    loss0, g0 = loss_and_grads(qwen3)
    runtime.apply(qwen3, patch_dir)
    loss1, g1 = loss_and_grads(qwen3)
    assert g0.keys() == g1.keys()
    assert abs(loss1 - loss0) < 0.02 * abs(loss0)
    for name, g in g1.items():
        assert torch.isfinite(g).all(), name
        rel = float((g - g0[name]).norm() / g0[name].norm().clamp_min(1e-12))
        assert rel < 0.1, (name, rel)  # BF16 gradients: the patch moves them by rounding-noise amounts
    # Gradient checkpointing recomputes the patched forward: same gradients.
    qwen3.gradient_checkpointing_enable()
    loss2, g2 = loss_and_grads(qwen3)
    assert loss2 == loss1
    for name, g in g2.items():
        assert torch.equal(g, g1[name]), name
    runtime.remove(qwen3)


def test_refuses_another_architecture(tiny_models: dict[str, Path], patch_dir: Path) -> None:
    from graphdiff.capture.hf import load_hf_model

    llama = load_hf_model(tiny_models["llama"])
    with pytest.raises(PatchError, match="manifest is for Qwen3ForCausalLM"):
        runtime.apply(llama, patch_dir)


def test_refuses_a_changed_module_or_other_versions(qwen3, patch_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(patch_dir, bad)
    with (bad / "graphdiff_patch.py").open("a") as f:
        f.write("# edited\n")
    with pytest.raises(PatchError, match="changed after generation"):
        runtime.apply(qwen3, bad)
    old = tmp_path / "old"
    shutil.copytree(patch_dir, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["versions"]["transformers"] = "4.40.0"
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PatchError, match="transformers .* allow_version_mismatch"):
        runtime.apply(qwen3, old)
    runtime.apply(qwen3, old, allow_version_mismatch=True)
    runtime.remove(qwen3)
    with pytest.raises(PatchError, match="no region nope"):
        runtime.apply(qwen3, patch_dir, regions=["nope"])


def test_refuses_another_config(qwen3, patch_dir: Path) -> None:
    qwen3.config.rms_norm_eps = 1e-5
    with pytest.raises(PatchError, match="rms_norm_eps=1e-05, the scanned one 1e-06"):
        runtime.apply(qwen3, patch_dir)


def test_runtime_imports_neither_vllm_nor_the_scanner() -> None:
    import subprocess
    import sys

    code = ("import sys, graphdiff.runtime; bad = [m for m in sys.modules if m == 'vllm' or m.startswith(("
            "'vllm.', 'graphdiff.analysis', 'graphdiff.capture', 'graphdiff.replay', 'graphdiff.pipeline', "
            "'graphdiff.codegen'))]; print(bad); sys.exit(1 if bad else 0)")
    # a trainer's process: not one posing as another CPU kind (its sitecustomize loads graphdiff.capture.cpu_kind)
    env = {k: v for k, v in os.environ.items() if k not in ("GRAPHDIFF_CPU_KIND", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and "forced_kind" not in p)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_config_check_reads_the_published_config_form(patch_dir: Path, tmp_path: Path) -> None:
    """A scan of an HF id runs the published config.json (torch_dtype, top-level rope_theta), cut to a few
    layers; the trainer loads the whole model, normalized by transformers and with its own run settings.
    The patch still fits it, and still refuses a model that computes differently."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from graphdiff.analysis.scan import scanned_config_of
    from graphdiff.models.resolve import _with_layers, bundled_config
    from graphdiff.runtime.manifest import check_model

    published = bundled_config("Qwen/Qwen3-8B")
    assert "torch_dtype" in published and "rope_theta" in published
    (tmp_path / "config.json").write_text(json.dumps(published))
    config = AutoConfig.from_pretrained(tmp_path)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    manifest = runtime.load_manifest(patch_dir).model_copy(
        update={"layers_scanned": 2, "config": scanned_config_of(_with_layers(published, 2))})
    check_model(model, manifest, patch_dir / "manifest.json", allow_version_mismatch=False)
    model.config.intermediate_size += 1
    with pytest.raises(PatchError, match="intermediate_size=12289, the scanned one 12288"):
        check_model(model, manifest, patch_dir / "manifest.json", allow_version_mismatch=False)


def _saved_bytes(model, ids: torch.Tensor) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
    """Bytes of the distinct tensors autograd keeps for the backward of one training step, the loss, the grads."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sum(saved.values()), loss.detach(), grads


def test_patched_training_step_keeps_no_more_activations_than_unpatched(qwen3, patch_dir: Path) -> None:
    """Splices keep only their inputs, FP32 outputs saved by later ops are recomputed: with every region
    aligned the step saves no more for the backward than unpatched HF (issue 13, memory)."""
    ids = IDS.repeat(2, 4)
    unpatched, _, _ = _saved_bytes(qwen3, ids)
    runtime.apply(qwen3, patch_dir)
    patched, loss, grads = _saved_bytes(qwen3, ids)
    again, loss2, grads2 = _saved_bytes(qwen3, ids)
    runtime.remove(qwen3)
    assert patched <= unpatched, (patched, unpatched)
    assert torch.equal(loss, loss2) and all(torch.equal(grads[n], grads2[n]) for n in grads)  # deterministic


def test_recomputed_fp32_output_is_the_forward_output(qwen3, patch_dir: Path) -> None:
    """What the backward gets in place of a saved FP32 splice output is bit-identical to it."""
    runtime.apply(qwen3, patch_dir)
    act = qwen3.model.layers[0].mlp.act_fn
    x = torch.randn(2, 5, qwen3.config.intermediate_size, dtype=torch.bfloat16, requires_grad=True)
    y = act(x)
    runtime.remove(qwen3)
    assert y.dtype == torch.float32 and torch.equal(y._graphdiff_recompute(), y)


TRITON_STEP = """
import sys, torch
from graphdiff import runtime
from graphdiff.capture.hf import load_hf_model
from tests.test_runtime import IDS, _saved_bytes
model = load_hf_model(sys.argv[1])
unpatched, _, _ = _saved_bytes(model, IDS)
runtime.apply(model, sys.argv[2])
patched, loss, grads = _saved_bytes(model, IDS)
assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
print(unpatched, patched)
"""


def test_triton_path_training_step_keeps_no_more_activations_than_unpatched(tiny_models, patch_dir: Path) -> None:
    """The same with the Triton kernels (in the interpreter): RoPE's prologue (rotate_half's FP32 cat) is made
    again in the backward, not kept."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "GRAPHDIFF_TRITON": "1"}
    proc = subprocess.run([sys.executable, "-c", TRITON_STEP, str(tiny_models["qwen3"]), str(patch_dir)],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    unpatched, patched = map(int, proc.stdout.split()[-2:])
    assert patched <= unpatched, (patched, unpatched)


def _step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    out = model(input_ids=IDS, labels=IDS, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_bf16_attention_gradient_keeps_the_forward_and_changes_only_the_backward(qwen3, patch_dir: Path,
                                                                                      monkeypatch) -> None:
    hf_logits = _step(qwen3)[0]
    runtime.apply(qwen3, patch_dir)
    logits32, grads32 = _step(qwen3)
    runtime.apply(qwen3, patch_dir, attention_gradient="bf16")
    attention = [m for n, m in qwen3.named_modules() if n.endswith("self_attn")]
    assert attention and all(m._graphdiff_attention_gradient == "bf16" for m in attention)
    logits16, grads16 = _step(qwen3)
    assert torch.equal(logits16, logits32)
    assert any(not torch.equal(grads16[n], g) for n, g in grads32.items() if "self_attn" in n)
    runtime.remove(qwen3)
    assert not any(hasattr(m, "_graphdiff_attention_gradient") for m in attention)
    with pytest.raises(PatchError, match="attention_gradient='fp16'"):
        runtime.apply(qwen3, patch_dir, attention_gradient="fp16")
    from graphdiff.runtime.manifest import load_generated, load_manifest

    gen = load_generated(load_manifest(patch_dir / "manifest.json"), patch_dir / "manifest.json")
    monkeypatch.delattr(gen, "ATTENTION_GRADIENTS")  # a patch generated before the option
    with pytest.raises(PatchError, match="regenerate it"):
        runtime.apply(qwen3, patch_dir, attention_gradient="bf16")
    assert runtime.active_regions(qwen3) is None  # refused midway: unpatched, not half patched
    assert torch.equal(_step(qwen3)[0], hf_logits)
    runtime.apply(qwen3, patch_dir)  # its FP32 gradient still applies
    assert torch.equal(_step(qwen3)[0], logits32)
