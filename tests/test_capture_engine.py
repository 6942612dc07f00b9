"""The real vLLM engine on a tiny Qwen3: partition, buffers, names, and the dump agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from graphdiff.capture.cpu_kind import cpu_kind
from graphdiff.engines.dump import find_graph_dirs, import_dump
from graphdiff.records import Graph, Kernel
from tests.conftest import reference_buffers

pytestmark = [pytest.mark.engine, pytest.mark.kind]


def _graph(engine_run) -> Graph:
    assert len(engine_run.capture.graphs) == 1, "the CPU compile path gives one graph"
    return engine_run.capture.graphs[0]


def _closure(k: Kernel, g: Graph, seeds: set[str]) -> set[str]:
    """Nodes of kernel k that depend (within k) on any of `seeds`."""
    nodes = g.node_map()
    inside, reached = set(k.nodes), set(seeds)
    changed = True
    while changed:
        changed = False
        for name in inside - reached:
            if any(i in reached for i in nodes[name].inputs):
                reached.add(name)
                changed = True
    return reached


def test_a_kernel_fuses_silu_with_the_up_projection_multiply(engine_run):
    g = _graph(engine_run)
    nodes = g.node_map()
    found = []
    for k in g.kernels:
        silu = {n for n in k.nodes if "silu" in (nodes[n].decomposed_from or nodes[n].target)}
        if k.kind != "generated" or not silu:
            continue
        after_silu = _closure(k, g, silu)
        for n in k.nodes:
            node = nodes[n]
            if node.target.startswith("aten.mul") and any(i in after_silu for i in node.inputs) \
                    and any(i not in after_silu for i in node.inputs):
                found.append((k.id, n))
    assert len(found) == 2, f"expected one SiLU*up kernel per layer, found {found}"


def test_a_kernel_fuses_qk_norm_with_the_rotary_products(engine_run):
    g = _graph(engine_run)
    nodes = g.node_map()
    fused = []
    for k in g.kernels:
        mods = {nodes[n].module or "" for n in k.nodes}
        has_norm = {m.rsplit(".", 1)[-1] for m in mods if m.endswith(("q_norm", "k_norm"))
                    for n in k.nodes if nodes[n].module == m and nodes[n].target.startswith("aten.rsqrt")}
        rotary_mul = [n for n in k.nodes
                      if "rotary" in (nodes[n].module or "") and nodes[n].target.startswith("aten.mul")]
        if k.kind == "generated" and has_norm == {"q_norm", "k_norm"} and rotary_mul:
            fused.append(k.id)
    assert len(fused) == 2, f"expected one q/k-norm+RoPE kernel per layer, found {fused}"


def test_every_generated_kernel_call_has_its_real_buffers(engine_run):
    g = _graph(engine_run)
    generated = [k for k in g.kernels if k.kind == "generated"]
    assert set(reference_buffers(engine_run)) == {k.id for k in generated}
    for k in generated:
        rec = reference_buffers(engine_run)[k.id]
        for a in k.args:
            if a.role == "scalar":
                assert rec["scalars"][a.name] == len(engine_run.capture.prompt_tokens)
                continue
            where = rec["in"] if a.role == "in" else rec["out"]
            assert a.name in where, f"{k.id}: no recorded {a.role} buffer {a.name}"
            assert str(where[a.name].dtype) == f"torch.{a.dtype}"


def test_recorded_buffers_come_from_one_real_forward(engine_run):
    """Every load of a buffer sees the bits last stored or loaded under that name (unless an
    opaque extern kernel touched it in between), and the first kernel reads the prompt's token
    ids: the records are one consistent real run, not per-kernel re-executions."""
    g = _graph(engine_run)
    ids = next(name for name, p in g.inputs.items() if p == "input_ids")
    first = reference_buffers(engine_run)[g.kernels[0].id]
    assert first["in"][ids].tolist() == engine_run.capture.prompt_tokens
    seen: dict[str, torch.Tensor] = {}
    checked = 0
    for k in g.kernels:
        if k.kind == "extern":  # opaque: it may rewrite any buffer it is given
            for a in k.args:
                seen.pop(a.name, None)
            continue
        rec = reference_buffers(engine_run)[k.id]
        for name, t in rec["in"].items():
            if name in seen:
                assert torch.equal(seen[name], t), f"{k.id} read {name} differently than it was last seen"
                checked += 1
            seen[name] = t
        seen.update(rec["out"])
    assert checked >= 10


def test_inputs_and_packed_parameters_are_named(engine_run):
    g = _graph(engine_run)
    params = set(g.inputs.values())
    assert "model.layers.0.self_attn.q_norm.weight" in params
    assert "model.layers.1.post_attention_layernorm.weight" in params
    packed = {p.engine: p for p in engine_run.capture.packed}
    qkv = packed["model.layers.0.self_attn.qkv_proj.weight"]
    assert [name for name, _, _ in qkv.parts] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert qkv.parts[0][1:] == (0, 256) and qkv.parts[2][2] == 512  # 4 q heads, 2 kv heads of 64
    gate_up = packed["model.layers.1.mlp.gate_up_proj.weight"]
    assert [p[0] for p in gate_up.parts] == ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]


def test_every_loaded_parameter_is_read_by_the_compiled_graphs(engine_run):
    """Qwen3 on the real engine: nothing flagged as loaded but unread. A linear vLLM CPU packed (its weight emptied,
    a oneDNN handle or `weight_packed_linear` closure in its place) is read through its `module#handle` input, one it
    runs as `F.linear` (oneDNN has no BF16 GEMM below AVX-512: the avx2 kind) through its weight."""
    from vllm.model_executor.layers.linear import LinearBase

    from graphdiff.engines.vllm.capture import _engine_model

    assert engine_run.capture.unread_params == []
    g = _graph(engine_run)
    names = set(g.inputs.values())
    handles = {name.partition("#")[0] for name in names if "#" in name}
    linears = {n: m for n, m in _engine_model(engine_run.llm).named_modules()
               if isinstance(m, LinearBase) and n.startswith("model.layers.")}
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer
    for name, m in linears.items():
        packed = m.weight.numel() == 0  # dispatch_cpu_unquantized_gemm(remove_weight=True) packed it
        assert packed == (cpu_kind() != "avx2"), f"{name}: packed={packed} on {cpu_kind()}"
        assert (name in handles) == packed and (f"{name}.weight" in names) == (not packed), name


def test_nodes_carry_source_and_module(engine_run):
    g = _graph(engine_run)
    rsqrt = [n for n in g.nodes if n.target == "aten.rsqrt.default"]
    assert len(rsqrt) == 2 * 4 + 1  # per layer: input, q, k, post-attention norm; plus the final norm
    assert all(n.source and n.source.line > 0 and "rsqrt" in n.source.code for n in rsqrt)
    assert {n.module for n in rsqrt} >= {"model.layers.0.self_attn.q_norm", "model.norm"}


def test_dump_import_gives_the_same_partition(engine_run):
    live = _graph(engine_run)
    dumped = import_dump(engine_run.debug_dir).graphs
    assert len(dumped) == 1
    d = dumped[0]
    assert [(k.id, k.kind) for k in d.kernels] == [(k.id, k.kind) for k in live.kernels]
    for lk, dk in zip(live.kernels, d.kernels):
        assert set(dk.nodes) == set(lk.nodes), lk.id
        assert [(a.name, a.role, a.dtype) for a in dk.args] == [(a.name, a.role, a.dtype) for a in lk.args]
    assert [(n.name, n.target, n.dtype, n.shape, n.sym, n.inputs, n.call) for n in d.nodes] == \
        [(n.name, n.target, n.dtype, n.shape, n.sym, n.inputs, n.call) for n in live.nodes]
    # The dump names a node's innermost frame only: under a `__torch_function__` pass-through (a linear run as
    # F.linear on vLLM's parameter subclass) it has no source; the live capture names the line that called F.linear.
    passed_on = _printed_under_pass_through(engine_run.debug_dir)
    for n, dn in zip(live.nodes, d.nodes):
        if n.name in passed_on:
            assert dn.source is None and n.source is not None and "functional.linear" in n.source.code, n.name
        else:
            assert (dn.source.line if dn.source else None) == (n.source.line if n.source else None), n.name
    assert bool(passed_on) == (cpu_kind() == "avx2")  # only where vLLM CPU leaves linears unpacked


def _printed_under_pass_through(debug_dir: Path) -> set[str]:
    """The nodes the model graph's dump prints under a `# File: ... in __torch_function__` line."""
    (text,) = [t for d in find_graph_dirs(debug_dir)
               if "/model_executor/" in (t := (d / "fx_graph_transformed.py").read_text())]
    names: set[str] = set()
    under = False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("# File:"):
            under = " in __torch_function__, code:" in s
        elif not s:
            under = False
        elif under and (m := re.match(r"(\w+)\s*[:=]", s)):
            names.add(m.group(1))
    return names


def test_recorded_buffers_survive_later_engine_steps(engine_run):
    """The engine reuses its input buffers every step; the records must be copies, not views."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    g = _graph(engine_run)
    ids = next(name for name, p in g.inputs.items() if p == "input_ids")
    engine_run.llm.generate([TokensPrompt(prompt_token_ids=[5] * 40)], SamplingParams(max_tokens=2), use_tqdm=False)
    first = reference_buffers(engine_run)[g.kernels[0].id]
    assert first["in"][ids].tolist() == engine_run.capture.prompt_tokens


def test_one_engine_start_records_every_shape(engine_run):
    """Prefills of two lengths and a batched decode step with the KV cache, each a real forward of the one
    compiled graph: every generated kernel has its buffers at every shape, at that shape's token count."""
    g = _graph(engine_run)
    shapes = engine_run.capture.shapes
    assert [s.label for s in shapes] == ["prefill-13", "prefill-64", "decode-4x24"]
    assert g.shapes == [s.label for s in shapes]
    ids = next(name for name, p in g.inputs.items() if p == "input_ids")
    generated = [k for k in g.kernels if k.kind == "generated"]
    for s in shapes:
        records = engine_run.buffers[s.label]
        assert set(records) == {k.id for k in generated}, s.label
        first = records[g.kernels[0].id]["in"][ids]
        assert first.numel() == s.tokens, s.label  # a decode step runs one token per sequence
        if s.phase == "prefill":
            assert first.tolist() == s.prompts[0]
    assert len(shapes[2].prompts) == 4 and all(len(p) == 24 for p in shapes[2].prompts)
