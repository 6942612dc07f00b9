"""A region whose ops run in a method of the module's class (xIELU's `_xielu_python`, which its forward calls), on
the recorded 3-layer Apertus scan (fixtures/scans/tiny-apertus-3, a real scan; no engine): the splice re-emits the
module's forward, and applied to the model it computes what the module computes where every region rounds as HF."""

from __future__ import annotations

from pathlib import Path

import torch

from graphdiff import runtime
from graphdiff.codegen import generate
from graphdiff.codegen.cut import _module_method
from graphdiff.models.tiny import make_tiny

APERTUS = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-apertus-3"


def test_a_method_of_the_modules_class_is_told_from_a_module_function() -> None:
    import transformers.activations as acts

    assert _module_method(acts.__file__, "_xielu_python", "XIELUActivation")
    assert not _module_method(acts.__file__, "forward_not_there", "XIELUActivation")
    assert not _module_method(acts.__file__, "gelu", "XIELUActivation")  # no such module-level function either
    assert not _module_method("/elsewhere/mine.py", "_xielu_python", "XIELUActivation")


def test_the_xielu_activation_is_generated_as_its_modules_forward(tmp_path: Path) -> None:
    made = generate(APERTUS, tmp_path / "patch", exact=True)
    act = [r for r in made.regions if r.name.startswith("model.layers.*.mlp.act_fn#")]
    assert act and all(r.generated for r in act), [r.reason for r in act]
    splice = next(s for s in made.splices if s.key == "model.layers.*.mlp.act_fn")
    assert splice.target == "module"
    model = make_tiny("apertus", tmp_path / "model", layers=3)
    from graphdiff.capture.hf import load_hf_model

    model = load_hf_model(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    act_fn = model.model.layers[0].mlp.act_fn
    x = torch.randn(1, 24, model.config.intermediate_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    before = act_fn(x)
    manifest = made.model_copy(deep=True)
    for r in manifest.regions:
        r.enabled = False  # every region rounds where HF eager does: the module's own result
    path = tmp_path / "patch" / "rounding_as_hf.json"
    path.write_text(manifest.model_dump_json())
    runtime.apply(model, path)
    try:
        assert "forward" in act_fn.__dict__  # the module's forward is the splice's
        assert torch.equal(act_fn(x), before)
        assert torch.isfinite(model(input_ids=ids).logits).all()
    finally:
        runtime.remove(model)
    runtime.apply(model, tmp_path / "patch" / "manifest.json")  # aligned: the products and sums stay FP32
    try:
        aligned = act_fn(x)
    finally:
        runtime.remove(model)
    assert "forward" not in act_fn.__dict__
    assert not torch.equal(aligned, before) and torch.allclose(aligned.float(), before.float(), rtol=0.02, atol=1e-2)
