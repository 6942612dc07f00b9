"""A residual sum the engine computes in FP32 inside one kernel, stores in BF16 and reads back: the recorded 3-layer
Cohere scan (fixtures/scans/tiny-cohere-reread-3, a real scan with its engine graph). vLLM's Cohere sums
`residual + (attn + mlp)`; Inductor computes layer 2's incoming sum in the kernel of layer 2's input norm, stores it
in BF16, takes the norm's mean of the FP32 sum and reads the BF16 copy back for the rest of the norm, and layer 2's
residual add (in the next kernel) loads that copy too. No engine: the plan, the rereads and the code are re-derived
from the recorded graphs."""

from __future__ import annotations

from pathlib import Path

from graphdiff.analysis.match import Match
from graphdiff.analysis.plan import mark_rounded_reads
from graphdiff.analysis.scan import norm_rereads
from graphdiff.artifacts import ScanDir
from graphdiff.codegen import generate

COHERE = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-cohere-reread-3"


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
    matched: dict[str, tuple[list[Match], list[str]]] = {}
    for d in scan.plan:
        if d.rule == "matched" and d.evidence.engine_node:
            matched.setdefault(d.evidence.engine_graph, ([], []))[0].append(
                Match(train=d.node, engine=d.evidence.engine_node, distance=0.0, confidence=1.0, evidence=""))
    assert norm_rereads(train.graphs[0], engine.graphs, matched) == ["model.layers.2.input_layernorm"]
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
