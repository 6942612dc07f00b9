"""Row sums and residual sums as the engine's fused norm kernels hold them, re-derived from recorded real scans with
their engine graphs (no engine). Cohere (fixtures/scans/tiny-cohere-reread-3): vLLM sums `residual + (attn + mlp)`;
Inductor computes layer 2's incoming sum in the kernel of layer 2's input norm, stores it in BF16, takes the norm's
mean of the FP32 sum and reads the BF16 copy back for the rest of the norm, and layer 2's residual add (in the next
kernel) loads that copy too. Gemma 2 (fixtures/scans/tiny-gemma2-3): two norms fused in one kernel, summed in other
lanes."""

from __future__ import annotations

from pathlib import Path

from graphdiff.analysis.match import Match
from graphdiff.analysis.reads import mark_rounded_reads
from graphdiff.analysis.scan import norm_rereads, ordered_sums
from graphdiff.artifacts import ScanDir
from graphdiff.codegen import generate
from graphdiff.records import ScanResult

COHERE = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-cohere-reread-3"


def _matched(scan: ScanResult) -> dict[str, tuple[list[Match], list[str]]]:
    """The matcher's pairs, as the recorded plan holds them."""
    matched: dict[str, tuple[list[Match], list[str]]] = {}
    for d in scan.plan:
        if d.rule == "matched" and d.evidence.engine_node:
            matched.setdefault(d.evidence.engine_graph, ([], []))[0].append(
                Match(train=d.node, engine=d.evidence.engine_node, distance=0.0, confidence=1.0, evidence=""))
    return matched


def test_a_sum_the_next_kernel_loads_from_its_store_is_read_rounded_there() -> None:
    scan, train = ScanDir(COHERE).load_scan(), ScanDir(COHERE).load_train()
    engine = ScanDir(COHERE).load_engine_graphs()
    assert engine is not None
    for d in scan.plan:
        d.evidence.read_rounded_by = []
    mark_rounded_reads(train.graphs[0], scan.plan, engine.graphs)
    read = {d.layer: d.evidence.read_rounded_by for d in scan.plan if d.evidence.read_rounded_by}
    # layer 1's sum (stored by layer 2's norm kernel) is read back by layer 2's own residual add, a value with no
    # engine match (the engine adds `attn + mlp` first); layer 0's sum is recomputed in FP32 by each kernel
    assert read == {1: ["model.layers.2/modeling_cohere.py:336/add.0"]}
    inside = next(d for d in scan.plan if d.id == read[1][0])
    assert inside.rule == "inside-kernel"


def test_a_written_out_layer_norm_reading_its_store_back_is_found() -> None:
    scan, train = ScanDir(COHERE).load_scan(), ScanDir(COHERE).load_train()
    engine = ScanDir(COHERE).load_engine_graphs()
    assert engine is not None
    assert norm_rereads(train.graphs[0], engine.graphs, _matched(scan)) == ["model.layers.2.input_layernorm"]
    assert norm_rereads(train.graphs[0], engine.graphs, {}) == []  # found from the matched mean only


def test_the_patch_reads_the_store_where_the_engine_does(tmp_path: Path) -> None:
    made = generate(COHERE, tmp_path / "patch", exact=True)
    carries = {s.key: s for s in made.splices if s.target == "carry"}
    last = carries["model.layers.*@layers 2"]
    assert last.torch_fn == "carry_fp32_rounded" and last.fp32_children == ["input_layernorm"]
    assert all(s.torch_fn == "carry_fp32" for k, s in carries.items() if k != "model.layers.*@layers 2")
    module = (tmp_path / "patch" / made.module_file).read_text()
    norms = {block.split("(")[0]: block for block in module.split("\ndef ")
             if block.startswith("torch_model_layers_N_input_layernorm")}
    assert sorted(norms) == ["torch_model_layers_N_input_layernorm_layers_0_1",
                             "torch_model_layers_N_input_layernorm_layers_2"]  # layer 2 reads its store back
    reread = norms["torch_model_layers_N_input_layernorm_layers_2"]
    first_mean = next(line for line in reread.splitlines() if line.strip().startswith("mean = "))
    assert "(hidden_states_1, [-1]" in first_mean  # the first loop: the mean of the FP32 sum
    rest = reread.split("variance_sub = ", 1)[1]
    assert rest.startswith("hidden_states_1_stored - mean")  # the later loops: the reloaded BF16 copy
    assert "hidden_states_sub = hidden_states_1_stored - mean" in rest
    assert "_stored" not in norms["torch_model_layers_N_input_layernorm_layers_0_1"]


GEMMA2 = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-gemma2-3"


def test_a_mean_matched_beside_the_engines_takes_that_reductions_lanes(tmp_path: Path) -> None:
    """Gemma 2 (fixtures/scans/tiny-gemma2-3, a real scan with its engine graph): its post-attention norm's mean is
    matched to the engine's `mean + eps` (the same values within the matcher's tolerance); the norm's kernel sums it
    in 32 lanes, the pre-feedforward norm fused beside it in 16."""
    scan, train = ScanDir(GEMMA2).load_scan(), ScanDir(GEMMA2).load_train()
    engine = ScanDir(GEMMA2).load_engine_graphs()
    assert engine is not None
    beside = [d for d in scan.plan if d.rule == "matched" and d.op == "aten.mean.dim"
              and not d.evidence.engine_node.startswith("mean")]
    assert {d.module for d in beside} >= {"model.layers.0.post_attention_layernorm"}
    found = ordered_sums(train.graphs[0], _matched(scan), engine.graphs, {})
    for layer in range(3):
        assert found[f"model.layers.{layer}.post_attention_layernorm"] == 32
        assert found[f"model.layers.{layer}.pre_feedforward_layernorm"] == 16
    made = generate(GEMMA2, tmp_path / "patch", exact=True)
    splice = next(s for s in made.splices if s.key == "model.layers.*.post_attention_layernorm")
    assert splice.reduction_lanes == {f"model.layers.{layer}.post_attention_layernorm": 32 for layer in range(3)}
