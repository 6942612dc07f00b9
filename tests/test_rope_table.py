"""cos/sin the engine gathers from a low-precision table: vLLM's rotary embedding reads its `cos_sin_cache` in the
model's dtype, HF's ERNIE 4.5 rotary module returns cos/sin in FP32. On the recorded 3-layer ERNIE 4.5 scan
(fixtures/scans/tiny-ernie4_5-3, a real scan with its engine graph; no engine)."""

from __future__ import annotations

from pathlib import Path

from graphdiff.analysis.scan import rope_table_dtype
from graphdiff.artifacts import ScanDir
from graphdiff.codegen import generate

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "scans"
ERNIE = FIXTURES / "tiny-ernie4_5-3"


def test_the_engines_rope_table_dtype_is_read_from_its_graph() -> None:
    engine = ScanDir(ERNIE).load_engine_graphs()
    assert engine is not None
    assert rope_table_dtype(engine.graphs) == "bfloat16"
    assert ScanDir(ERNIE).load_scan().engine_rope_table == "bfloat16"
    engine.graphs[0].nodes = [n for n in engine.graphs[0].nodes if "rotary" not in (n.module or "")]
    assert rope_table_dtype(engine.graphs) == ""


def test_the_rope_splice_rounds_fp32_cos_sin_to_the_table_only_when_aligned(tmp_path: Path) -> None:
    made = generate(ERNIE, tmp_path / "patch", exact=True)
    rope = next(r for r in made.regions if r.kind == "rope")
    assert rope.generated
    module = (tmp_path / "patch" / made.module_file).read_text()
    fn = module.split("def torch_apply_rotary_pos_emb(")[1].split("\ndef ")[0]
    assert "cos = _round(_f32(cos), torch.bfloat16) if a0 else _f32(cos)" in fn
    assert "sin = _round(_f32(sin), torch.bfloat16) if a0 else _f32(sin)" in fn
    assert "def triton_apply_rotary_pos_emb" not in module  # the PyTorch path only


def test_bf16_cos_sin_are_left_as_they_are(tmp_path: Path) -> None:
    """Qwen3's rotary module returns cos/sin in the activations' dtype: the table's rounding is the trainer's too."""
    qwen3 = ScanDir(FIXTURES / "tiny-qwen3")
    scan = qwen3.load_scan()
    scan.engine_rope_table = "bfloat16"
    d = ScanDir(tmp_path / "scan")
    d.save_scan(scan)
    d.save_train(qwen3.load_train())
    made = generate(d.root, tmp_path / "patch", exact=True)
    assert next(r for r in made.regions if r.kind == "rope").generated
    assert "the engine reads a" not in (tmp_path / "patch" / made.module_file).read_text()
