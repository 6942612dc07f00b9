"""Falcon with --exact (issue 35), from the recorded 3-layer tiny Falcon scan (fixtures/scans/tiny-falcon-3, recorded
from a real run: fixtures/scans/README.md).

What kept every region of it from being generated, each removed by a general rule: its attention calls torch's sdpa
in its own code (the runtime swaps that call while the attention module runs); its down projection `input @
self.weight.T` flattens the tokens and splits them back (a view written against the input's sizes, and an output
that is a view of a site leaves FP32 as the site does); its residual add `dropout_add(x, residual, prob, training)`
takes settings after its tensors (bound with the values the graph was traced under); its parallel block sums the
MLP's and the attention's outputs in place (`+=`, an add as any other).

And what then kept the patched trainer from the engine, in the order the fixes removed them: the trainer's recorded
value of the down projection was the sum an in-place add later wrote into it (matched to the engine's sum: a
spurious site); its keys, broadcast to every query head, matched no engine value (half of RoPE left unaligned); its
GELU is ATen's, the engine's Inductor's erf form; the engine's layer-1 output kernel normalizes its stored sum twice,
the second norm from the stored copy only."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.analysis.match import repeated_part
from graphdiff.analysis.rounding import eager_values
from graphdiff.analysis.scan import norm_reads_stored, norm_rereads
from graphdiff.capture.hf import load_hf_model
from graphdiff.codegen import generate
from graphdiff.models.tiny import make_tiny
from graphdiff.records import Capture, ScanResult
from tests.conftest import FIXTURES

FALCON = FIXTURES / "scans" / "tiny-falcon-3"
ATTENTION = "transformer.h.*.self_attention#attention"
DOWN = "transformer.h.*.mlp.dense_4h_to_h#other"
BLOCK_SUM = "transformer.h.*#other"
binding = importlib.import_module("graphdiff.codegen.binding")


@pytest.fixture(scope="module")
def patches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("falcon")
    generate(FALCON, root / "fp32")
    generate(FALCON, root / "exact", exact=True)
    return {"fp32": root / "fp32", "exact": root / "exact"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return load_hf_model(make_tiny("falcon", tmp_path_factory.mktemp("falcon") / "model", layers=3))


def _manifest(patch: Path) -> dict:
    return json.loads((patch / "manifest.json").read_text())


def test_every_region_is_generated_with_exact(patches: dict[str, Path]) -> None:
    manifest = _manifest(patches["exact"])
    assert {r["name"]: r["reason"] for r in manifest["regions"] if not r["generated"]} == {}
    attention = next(s for s in manifest["splices"] if s["target"] == "attention")
    assert attention["function"] == runtime.TORCH_SDPA and attention["torch_fn"] == "attention_engine_op"
    assert "def sdpa_call(" in (patches["exact"] / "graphdiff_patch.py").read_text()
    adds = [s for s in manifest["splices"] if s.get("function", "").endswith(".dropout_add")]
    # `out = residual + out`: the add's first operand is `residual`, which binds the commutative add's inputs
    assert adds and all(s["inputs"] == ["arg:residual", "arg:x"] and not s["problems"] for s in adds)
    source = (patches["exact"] / "graphdiff_patch.py").read_text()
    last = source[source.index("def torch_dropout_add_layers_2("):]
    last = last[:last.index("return")]
    # the engine's last kernel reads layer 1's stored output, the block's sum (mm + attention) in FP32
    assert "residual_stored = _round(residual" in last and "x_stored" not in last
    carries = [s for s in manifest["splices"] if BLOCK_SUM in s["regions"]]
    assert carries and all(s["fp32_outputs"] == ["mlp", "self_attention"] for s in carries)


def test_settings_after_the_tensors_take_the_traced_values() -> None:
    from transformers.models.falcon import modeling_falcon

    params = list(inspect.signature(modeling_falcon.dropout_add).parameters.values())
    assert binding._settings(params[2:]) == {"prob": 0.0, "training": False}
    assert binding._settings(list(inspect.signature(lambda x, table: x).parameters.values())[1:]) == (
        "its parameter table")


def test_the_down_projection_follows_the_tokens_and_leaves_fp32() -> None:
    """`input @ self.weight.T` flattens the tokens ([1, 16, 1024] -> [16, 1024]) and splits them back ([16, 256] ->
    [1, 16, 256]): both views are written against the input's sizes; the split view, an output, is its matmul's site."""
    from graphdiff.codegen.cut import _viewed_sites
    from graphdiff.codegen.emit_torch import reshaped
    from graphdiff.codegen.fragment import Fragment

    graph = Capture.model_validate_json((FALCON / "train.capture.json").read_text()).graphs[0]
    nodes = graph.node_map()
    out = next(n for n in graph.nodes if n.module == "transformer.h.0.mlp.dense_4h_to_h" and n.target.endswith(
        "_unsafe_view.default"))
    mm = nodes[out.inputs[0]]
    flat = nodes[mm.inputs[0]]
    names = {flat.inputs[0]: "input", flat.name: "flat", mm.name: "product"}
    assert reshaped(flat, nodes, names) == "input.reshape(-1, 1024)"
    assert reshaped(out, nodes, names) == "product.reshape(*input.shape[:2], 256)"
    frag = Fragment(key="k", target="module", module="m", module_class="FalconLinear", nodes=[flat, mm, out],
                    inputs=[flat.inputs[0]], outputs=[out.name], sites={mm.name: DOWN})
    assert _viewed_sites(frag, nodes) == {out.name: DOWN}


def test_the_attention_modules_own_sdpa_call_runs_the_patch(patches: dict[str, Path], model: torch.nn.Module,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """While a patched FalconAttention runs, its `torch.nn.functional.scaled_dot_product_attention` call goes to the
    generated attention function (which calls torch's own sdpa again, on FP32 inputs); elsewhere, and after remove,
    torch's sdpa is itself."""
    manifest = runtime.load_manifest(patches["fp32"])
    gen = runtime.load_generated(manifest, patches["fp32"] / "manifest.json")
    original, seen = gen.attention_fp32_inputs, []

    def spy(module, query, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append((type(module).__name__, query.dtype))
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(gen, "attention_fp32_inputs", spy)
    builtin = torch.nn.functional.scaled_dot_product_attention
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        runtime.apply(model, patches["fp32"], regions=[ATTENTION])
        try:
            assert torch.nn.functional.scaled_dot_product_attention is not builtin
            q = torch.randn(1, 2, 4, 8)
            assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, q, q), builtin(q, q, q))
            patched = model(ids).logits
        finally:
            runtime.remove(model)
        again = model(ids).logits
    assert seen == [("FalconAttention", torch.bfloat16)] * 3
    assert torch.nn.functional.scaled_dot_product_attention is builtin
    assert not torch.equal(patched, plain) and torch.equal(again, plain)


def test_a_value_written_over_in_place_keeps_what_it_computed() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = x @ y
        z += x
        return z

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.ones(2, 2), torch.eye(2))
    x = torch.randn(2, 2, generator=torch.Generator().manual_seed(0))
    values = eager_values(gm, [x, torch.eye(2)])
    mm = next(n.name for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert torch.equal(values[mm], x) and not torch.equal(values[mm], 2 * x)


def test_keys_broadcast_to_every_query_head_are_their_values_once() -> None:
    key = torch.randn(1, 2, 1, 16, 8, generator=torch.Generator().manual_seed(0))
    heads = key.expand(1, 2, 2, 16, 8).flatten(1, 2)  # [k0, k0, k1, k1], as Falcon's broadcast_to + flatten
    dim, times, once = repeated_part(heads)
    assert (dim, times) == (1, 2) and torch.equal(once, key[:, :, 0])
    assert repeated_part(torch.randn(1, 4, 16, 8, generator=torch.Generator().manual_seed(1))) is None
    # four query heads per K/V head (hidden 512 in heads of 64 or 128): [k0 x4, k1 x4] repeats its pairs twice too,
    # but the value once is one head per K/V head, which is what the engine holds
    four = key.expand(1, 2, 4, 16, 8).flatten(1, 2)
    dim, times, once = repeated_part(four)
    assert (dim, times) == (1, 4) and torch.equal(once, key[:, :, 0])
    dim, times, once = repeated_part(key[:, :1].expand(1, 1, 4, 16, 8).flatten(1, 2))  # one K/V head
    assert (dim, times) == (1, 4) and torch.equal(once, key[:, :1, 0])


def test_the_recorded_scan_aligns_rope_and_the_gelu_and_reads_the_norms_as_the_kernel_does() -> None:
    scan = ScanResult.model_validate_json((FALCON / "scan.json").read_text())
    rope = next(r for r in scan.regions if r.kind == "rope")
    assert any(":96/" in s for s in rope.sites)  # the keys' RoPE products (line 96), not only the queries'
    assert not any(r.module.endswith("dense_4h_to_h") for r in scan.regions)
    train = Capture.model_validate_json((FALCON / "train.capture.json").read_text()).graphs[0]
    engine = Capture.model_validate_json((FALCON / "engine" / "capture.json").read_text()).graphs
    assert norm_rereads(train, engine) == ["transformer.h.2.ln_attn"]
    assert norm_reads_stored(train, engine) == ["transformer.h.2.ln_mlp"]


def test_the_gelu_is_computed_as_the_engines_inductor_kernel_does(patches: dict[str, Path]) -> None:
    from graphdiff.replay.inductor_math import inductor_math

    manifest = runtime.load_manifest(patches["exact"])
    region = next(r.name for r in manifest.regions if r.name.endswith("#math"))
    assert region == "transformer.h.*.mlp.act#math"
    gen = runtime.load_generated(manifest, patches["exact"] / "manifest.json")
    fn = getattr(gen, next(s for s in manifest.splices if s.regions == [region]).torch_fn)
    x = (torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)) * 2).bfloat16()
    xf = x.float()
    engine = ((xf * 0.5) * (inductor_math("erf", xf * 0.7071067811865476) + 1.0)).bfloat16()
    (aligned,), (plain,) = fn(x, align=frozenset({region})), fn(x, align=frozenset())
    # they differ where this CPU's ATen GELU does (AVX-512's; an AVX2 CPU's ATen computes Inductor's values)
    assert torch.equal(aligned, engine) and torch.equal(plain, torch.nn.functional.gelu(x))
