"""Tensor parallelism on the real engine: one `graphdiff scan --tensor-parallel-size 2` of a tiny Qwen3 (every rank
captured in its worker process), then checks on what it wrote. Slow (two workers compile; minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from graphdiff.analysis.opaque import attention_rule, extern_rule
from graphdiff.analysis.tensor_parallel import allreduce_truncates, rank_of
from graphdiff.capture.collectives import allreduces
from graphdiff.codegen.tp_linear import linear_split_k, linear_split_k_truncated
from graphdiff.records import Capture

pytestmark = [pytest.mark.engine, pytest.mark.kind]

START_FAILURES = ("vLLM could not start", "needs at least 2 CPU cores", "NUMA")


@pytest.fixture(scope="module")
def tp_scan(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm")
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor_parallel_size 2 on vLLM CPU needs two cores (one per rank); this process may use one")
    out = tmp_path_factory.mktemp("scan-tp2")
    proc = subprocess.run([sys.executable, "-m", "graphdiff_cli.main", "scan", str(tiny_models["qwen3"]), "--out",
                           str(out), "--tensor-parallel-size", "2", "--shapes", "13", "--tokens", "13", "--patch"],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 and any(s in proc.stderr for s in START_FAILURES):
        pytest.skip("vLLM could not start with tensor_parallel_size 2 here: "
                    + next(ln for ln in proc.stderr.splitlines() if "error" in ln.lower())[-400:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_every_kernel_of_both_ranks_replays_bit_exactly(tp_scan: Path) -> None:
    scan = json.loads((tp_scan / "scan.json").read_text())
    cap = Capture.model_validate_json((tp_scan / "engine" / "capture.json").read_text())
    assert scan["engine_config"]["tensor_parallel_size"] == 2
    assert [g.name for g in cap.graphs] == ["engine_graph_0", "rank1/engine_graph_0"]
    generated = {k.id for g in cap.graphs for k in g.kernels if k.kind == "generated"}
    by_rank = {r: [k.id for g in cap.graphs if rank_of(g) == r for k in g.kernels if k.kind == "generated"]
               for r in (0, 1)}
    assert by_rank[0] and len(by_rank[0]) == len(by_rank[1]) and all(":r1." in k for k in by_rank[1])
    replayed = {r["kernel"]: r for r in scan["replay"]}
    assert generated <= set(replayed), generated - set(replayed)
    assert not scan["not_replayed"] and not scan["unexplained"]
    assert all(replayed[k]["predicted_bitexact"] >= 0.999 for k in generated)  # the scan's proof threshold


def _is_allreduce(kernel: str) -> bool:
    rule = extern_rule(kernel.split(":")[0])
    return rule is not None and rule.kind == "allreduce"


def test_the_allreduce_of_row_parallel_partials_is_a_site_with_its_check(tp_scan: Path) -> None:
    scan = json.loads((tp_scan / "scan.json").read_text())
    cap = Capture.model_validate_json((tp_scan / "engine" / "capture.json").read_text())
    # vLLM's shared-memory all-reduce where its ops build has one; `_C_AVX2` has none: torch.distributed's (gloo)
    op = "_c10d_functional.all_reduce_" if cap.attention.get("build") == "_C_AVX2" else "_C.shm_allreduce"
    regions = {r["name"]: r for r in scan["regions"]}
    for name in ("model.layers.*.self_attn.o_proj#allreduce", "model.layers.*.mlp.down_proj#allreduce"):
        assert regions[name]["kind"] == "allreduce" and regions[name]["rounded_on"] == ["engine"], name
        assert regions[name]["layers"] == [0, 1] and regions[name]["proven"], name
    decisions = [d for d in scan["plan"] if d["kind"] == "allreduce"]
    assert len(decisions) == 4 and all(d["rule"] == "opaque-registry" and d["site"] for d in decisions)
    assert all(d["evidence"]["kernel"].startswith(f"torch.ops.{op}.") for d in decisions)
    assert all(d["evidence"]["replay_predicted"] == 1.0 and d["evidence"]["replay_naive"] < 0.9 for d in decisions)
    rows = [r for r in scan["replay"] if _is_allreduce(r["kernel"])]
    assert len(rows) == 8  # 2 layers x (o_proj, down_proj) x 2 ranks
    assert all(r["predicted_bitexact"] == 1.0 and r["naive_bitexact"] < 0.9 for r in rows)
    # the other kinds are still found on the ranks' sharded values (q/k norms, RoPE, SiLU)
    kinds = {r["kind"] for r in scan["regions"]}
    assert {"rope", "qk_norm", "gated_act", "residual_norm", "norm_weight", "allreduce"} <= kinds
    rule = attention_rule(cap.attention)  # an attention region where the engine keeps P in FP32 (vLLM CPU's vec)
    assert ("attention" in kinds) == (rule is not None and rule.probabilities_fp32), (cap.attention, kinds)


def test_split_k_linear_equals_the_recorded_allreduce_outputs_bit_for_bit(tp_scan: Path,
                                                                          tiny_models: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    cap = Capture.model_validate_json((tp_scan / "engine" / "capture.json").read_text())
    records = next(iter(torch.load(tp_scan / "engine" / "buffers.pt", weights_only=False).values()))
    weights = load_file(str(tiny_models["qwen3"] / "model.safetensors"))
    ranks = [[a for g in cap.graphs if rank_of(g) == r for a in allreduces(g)] for r in (0, 1)]
    # the all-reduce stores as it does (vLLM's shm one truncates on _C_AVX512; torch.distributed's rounds to nearest
    # even): so does the patch's splice
    truncates = {allreduce_truncates(a.kernel, cap.attention.get("build", "")) for a in ranks[0]}
    assert len(truncates) == 1
    split_k = linear_split_k_truncated if truncates.pop() else linear_split_k
    nodes = {g.name: g.node_map() for g in cap.graphs}
    checked = 0
    for a0, a1 in zip(*ranks):
        r0, r1 = records[a0.kernel]["extern"], records[a1.kernel]["extern"]
        assert torch.equal(r0["reduced"], r1["reduced"])  # every rank holds the same all-reduce output
        if not a0.matmul:
            continue  # the embedding's all-reduce: masked rows, no matmul
        module = nodes[a0.graph][a0.buffer].module
        linear = SimpleNamespace(weight=weights[f"{module}.weight"], bias=None)
        x = torch.cat([r0["matmul_input"], r1["matmul_input"]], dim=-1)  # rank r holds K part r
        assert torch.equal(split_k(linear, x, 2), r0["reduced"]), module
        assert not torch.equal(F.linear(x, linear.weight), r0["reduced"]), module  # one GEMM rounds otherwise
        checked += 1
    assert checked == 4


def test_the_patch_splices_the_row_parallel_linears(tp_scan: Path) -> None:
    manifest = json.loads((tp_scan / "patch" / "manifest.json").read_text())
    linear = [s for s in manifest["splices"] if s["target"] == "linear"]
    assert sorted(s["key"] for s in linear) == ["model.layers.*.mlp.down_proj", "model.layers.*.self_attn.o_proj"]
    assert all(s["shards"] == 2 and not s["problems"] for s in linear)
    assert all(r["generated"] for r in manifest["regions"]), [r["reason"] for r in manifest["regions"]]
