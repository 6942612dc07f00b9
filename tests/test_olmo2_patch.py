"""OLMo 2 at the engine, from the recorded 3-layer tiny OLMo 2 scan (fixtures/scans/tiny-olmo2-3, recorded from a real
run: fixtures/scans/README.md).

vLLM runs OLMo 2 through its Transformers backend, compiled by Inductor. What the engine's kernels do there that the
patch must do too: the q and k norms' outputs reach `x * cos` in FP32 while `rotate_half` reads the halves a kernel
stores in BF16 (the k norm's in the same kernel, in a later loop); each layer's last residual sum is recomputed in
FP32 by the next layer's first residual add while the next layer's attention projections read its stored BF16 copy;
the rotary embedding's cos and sin are Inductor's vectorized math, which parts from ATen's past the first positions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.analysis.reads import mark_recomputed_reads
from graphdiff.artifacts import ScanDir
from graphdiff.capture.hf import load_hf_model
from graphdiff.codegen import generate
from graphdiff.models.tiny import make_tiny
from tests.conftest import FIXTURES

OLMO2 = FIXTURES / "scans" / "tiny-olmo2-3"
K_NORM = "model.layers.0.self_attn.k_norm/modeling_olmo2.py:64/_to_copy.0"
LAST_SUM = "model.layers.0/modeling_olmo2.py:314/add.0"
STORED_COPY = "model.layers.*.self_attn#stored_copy"


@pytest.fixture(scope="module")
def patch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("olmo2") / "patch"
    generate(OLMO2, out)
    return out


def test_a_value_read_in_fp32_beside_its_stored_copy_is_a_site() -> None:
    """The plan's rule, re-run on the recorded graphs from the engine state a stored value first gets."""
    scan_dir = ScanDir(OLMO2)
    scan, train, engine = scan_dir.load_scan(), scan_dir.load_train(), scan_dir.load_engine_graphs()
    assert engine is not None
    plan = [d.model_copy(deep=True) for d in scan.plan]
    for d in plan:
        if d.id in (K_NORM, LAST_SUM):
            assert d.site and d.engine is not None and d.engine.dtype == "float32"
            d.engine = d.engine.model_copy(update=dict(dtype="bfloat16", rounds=True, on_grid=True, how="rounded"))
            d.site, d.evidence.read_rounded_by = False, []
    mark_recomputed_reads(train.graphs[0], plan, engine.graphs)
    found = {d.id: d for d in plan}
    # the k norm: one kernel stores only its rotate-half halves and reads it in FP32 for `k * cos`
    k_norm = found[K_NORM]
    assert k_norm.site and k_norm.engine is not None and not k_norm.engine.rounds
    assert sorted(r.rsplit("/", 1)[1] for r in k_norm.evidence.read_rounded_by) == ["cat.1", "neg.1"]
    # layer 0's output: layer 1's residual add reads it in FP32, though that add's own sum is stored rounded
    last = found[LAST_SUM]
    assert last.site and last.engine is not None and not last.engine.rounds
    assert {r.split("/")[0] for r in last.evidence.read_rounded_by} == {
        f"model.layers.1.self_attn.{p}_proj" for p in "qkv"}


def test_the_readers_of_stored_copies_and_the_rotary_math_are_generated(patch: Path) -> None:
    manifest = json.loads((patch / "manifest.json").read_text())
    assert {r["name"]: r["reason"] for r in manifest["regions"] if not r["generated"]} == {}
    copy = next(s for s in manifest["splices"] if STORED_COPY in s["regions"])
    assert copy["target"] == "function" and copy["function"].endswith("modeling_olmo2.rotate_half")
    source = (patch / "graphdiff_patch.py").read_text()
    rotate = source[source.index("def torch_rotate_half("):]
    rotate = rotate[:rotate.index("\n    return")]
    assert "x2_stored = _round(x2, torch.bfloat16)" in rotate and "x1_stored = _round(x1, torch.bfloat16)" in rotate
    carry = next(s for s in manifest["splices"] if s["target"] == "carry")
    assert carry["rounded_children"] == ["self_attn"] and "def carry_rounded_child(" in source
    rotary = source[source.index("def torch_model_rotary_emb("):]
    assert "inductor_math('cos', emb)" in rotary[:rotary.index("\n    return")]


def test_the_attention_reads_the_stored_copy_of_an_fp32_residual(patch: Path, tmp_path: Path) -> None:
    model = load_hf_model(make_tiny("olmo2", tmp_path / "model", layers=3))
    layer = model.model.layers[1]
    seen: dict[str, torch.dtype] = {}

    def record(name: str):  # noqa: ANN202 - a forward pre-hook
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            seen.setdefault(name, (args[0] if args else kwargs["hidden_states"]).dtype)
        return hook

    # registered first: they see what the module is called with, before the patch's own hooks
    hooks = [layer.register_forward_pre_hook(record("layer"), with_kwargs=True),
             layer.self_attn.q_proj.register_forward_pre_hook(record("q_proj"), with_kwargs=True)]
    runtime.apply(model, patch)
    try:
        ids = torch.randint(0, model.config.vocab_size, (1, 12))
        out = model(input_ids=ids).logits
        out.float().logsumexp(-1).sum().backward()
    finally:
        runtime.remove(model)
        for h in hooks:
            h.remove()
    assert seen == {"layer": torch.float32, "q_proj": torch.bfloat16}
    assert torch.isfinite(out).all() and model.model.layers[1].self_attn.q_proj.weight.grad is not None
    assert "_graphdiff_held" not in layer.__dict__


def test_the_portable_attention_reads_an_fp32_handoff_as_the_engine_stores_it(patch: Path) -> None:
    """The portable patch hands the q norm's FP32 output on through HF's RoPE (no cast back: OLMo 2 casts to the
    input's dtype), and its FP32 attention splice reads q, k and v rounded to BF16, as the engine's op loads them."""
    from graphdiff.codegen.attention_splice import _attention_in_fp32, attention_fp32_inputs

    source = (patch / "graphdiff_patch.py").read_text()
    q_norm = source[source.index("def torch_model_layers_N_self_attn_q_norm("):]
    assert "to_copy if a0 and 'model.layers.*.self_attn#attention' in align" in q_norm[:q_norm.index("\n\n\n")]
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal = True
    query, key, value = (torch.randn(1, 2, 8, 16) for _ in range(3))
    rounded = [t.to(torch.bfloat16) for t in (query, key, value)]
    out = attention_fp32_inputs(module, query, key, value.to(torch.bfloat16), None)[0]
    assert out.dtype == torch.bfloat16 and torch.equal(out, attention_fp32_inputs(module, *rounded, None)[0])
    unrounded = _attention_in_fp32(module, query, key, rounded[2], None)[0].to(torch.bfloat16)
    assert not torch.equal(out, unrounded)  # these inputs tell the two apart


def test_the_summary_line_claims_no_more_replay_than_scan_json_holds(tmp_path: Path) -> None:
    """One kernel call replays at 99.9977% (the q RoPE kernel at 512 tokens): the summary line and the report's card
    say 99.99%, a lower bound, not 100.00%."""
    from graphdiff.report.headline import bound_percent, headline
    from graphdiff.report.html import write_report

    scan = ScanDir(OLMO2).load_scan()
    worst = min(r.predicted_bitexact for r in scan.replay if not r.error)
    assert 0.9999 < worst < 1.0
    assert "≥ 99.99% bit-identical on every generated kernel" in headline(scan)[0]
    assert bound_percent(0.999977, lower=False) == "100.00%" and bound_percent(1.0) == "100.00%"
    report = write_report(OLMO2, "html", out=tmp_path / "report.html")[0].read_text()
    assert re.findall(r'class="n">([^<]*)</div><div class="l">kernel replay', report) == ["99.99%"]
