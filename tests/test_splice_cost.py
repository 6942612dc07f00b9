"""Each region's training-step cost: its splice timed alone, patched and as HF runs it, recorded in the manifest and
printed beside its effect on the gap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graphdiff.codegen import generate
from graphdiff.measure import splice_cost
from graphdiff.measure.gate import with_step_costs
from graphdiff.runtime import active_regions, load_manifest

QWEN3 = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-qwen3"


@pytest.fixture(scope="module")
def patch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("patch")
    generate(QWEN3, out)
    return out


def test_every_splice_the_model_calls_gets_a_row(tiny_models: dict[str, Path], patch_dir: Path) -> None:
    from graphdiff.capture.hf import load_hf_model

    model = load_hf_model(tiny_models["qwen3"]).train()
    ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
    rows = splice_cost.splice_costs(model, patch_dir, ids, repeat=1, autograd=True)
    manifest = load_manifest(patch_dir / "manifest.json")
    called = {s.key for s in manifest.splices if s.target in ("module", "function", "attention")}
    assert set(rows) == called
    layers = model.config.num_hidden_layers
    assert rows["model.norm"]["calls"] == 1 and rows["model.layers.*.input_layernorm"]["calls"] == layers
    for row in rows.values():
        assert row["patched_fwd_bwd_ms"] > 0 and row["unpatched_fwd_bwd_ms"] > 0
        added = row["calls"] * (row["patched_fwd_bwd_ms"] - row["unpatched_fwd_bwd_ms"])
        assert row["added_ms"] == pytest.approx(added, abs=0.01)
        assert row["autograd_fwd_bwd_ms"] > 0 and "autograd_added_ms" in row
    assert active_regions(model) is None  # left unpatched


def test_the_manifest_records_each_regions_cost_and_the_table_prints_it(tiny_models: dict[str, Path],
                                                                         patch_dir: Path, capsys) -> None:  # noqa: ANN001
    from cli.render import print_patch
    from graphdiff.capture.hf import load_hf_model

    base = load_hf_model(tiny_models["qwen3"])
    manifest = with_step_costs(base, load_manifest(patch_dir / "manifest.json"), patch_dir, tokens=32)
    on_disk = load_manifest(patch_dir / "manifest.json")
    assert on_disk.step_tokens == 32 and on_disk.step_layers == base.config.num_hidden_layers
    costed = {r.name for r in on_disk.regions if r.step_ms is not None}
    # every region with a splice of its own; the carry's hooks are no splice (their cost is the step's rest)
    assert costed == {r.name for r in on_disk.regions if r.kind != "residual_norm"}
    print_patch(manifest)
    printed = " ".join(capsys.readouterr().out.split())
    assert f"of the scanned model ({base.config.num_hidden_layers} layers, 32 tokens)" in printed
