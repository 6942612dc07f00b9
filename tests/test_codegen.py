"""Patch generation: deterministic output, and every generated region computes exactly its rounding plan
(graphdiff.codegen.verify: the plan replay and a float64 replay are the references)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from graphdiff.codegen import generate
from graphdiff.codegen.verify import GRAD_RTOL, verify
from graphdiff.records import Manifest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
QWEN3 = FIXTURES / "scans" / "tiny-qwen3"


@pytest.fixture(scope="module")
def qwen3_patch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    out = tmp_path_factory.mktemp("patch-qwen3")
    return out, generate(QWEN3, out)


def test_same_scan_gives_byte_identical_files(tmp_path: Path) -> None:
    generate(QWEN3, tmp_path / "a")
    generate(QWEN3, tmp_path / "b")
    for name in ("graphdiff_patch.py", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_every_qwen3_region_is_generated(qwen3_patch) -> None:
    out, manifest = qwen3_patch
    kinds = {r.kind for r in manifest.regions}
    assert kinds == {"rope", "qk_norm", "attention", "gated_act", "residual_norm", "norm_weight"}
    assert all(r.generated for r in manifest.regions), [r.reason for r in manifest.regions]
    for s in manifest.splices:
        assert s.target in ("carry", "attention") or s.triton_fn, s.triton_problem
    rope = next(s for s in manifest.splices if s.target == "function")
    assert rope.function.endswith("modeling_qwen3.apply_rotary_pos_emb")
    assert sorted(rope.inputs) == ["arg:cos", "arg:k", "arg:q", "arg:sin"]
    assert hashlib.sha256((out / manifest.module_file).read_bytes()).hexdigest() == manifest.module_sha256


def test_the_module_carries_its_helpers_as_written_and_defines_every_name_it_calls(qwen3_patch) -> None:
    """The functions a patch runs besides its emitted regions are real ones, copied in as their source; the module
    defines every name its code uses (pyflakes' checks, as ruff runs them: a helper carried without one it calls
    fails here)."""
    import inspect

    from graphdiff.codegen import attention_splice, carry, prelude

    out, manifest = qwen3_patch
    text = (out / manifest.module_file).read_text()
    for part in (*prelude.PARTS, carry.carry_fp32, *attention_splice.FP32_PARTS):
        assert inspect.getsource(part) in text, part.__name__
    assert "exec(" not in text
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F", "--output-format",
                           "concise", str(out / manifest.module_file)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_generated_code_names_arguments_and_values_by_role(qwen3_patch) -> None:
    """The emitted functions name their arguments as the replaced code does (the norm forward's `hidden_states`
    and its `weight`, apply_rotary_pos_emb's own parameters) and their values after the variables the model's source
    lines assign, never by graph node (`x0`, `v_mul_9`, `arg10_1`)."""
    import ast

    out, manifest = qwen3_patch
    tree = ast.parse((out / manifest.module_file).read_text())
    fns = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    emitted = [f for name, f in fns.items() if name.startswith(("torch_", "triton_", "_triton_", "_k_"))]
    assert len(emitted) > 10
    graph_like = re.compile(r"^(v_\w*|a_v_\w*|arg\d+_\d+|_\w+_\d+)$")  # v_mul_9, arg10_1, _to_copy_1
    for f in emitted:
        args = {a.arg for a in ast.walk(f) if isinstance(a, ast.arg)}
        used = {n.id for n in ast.walk(f) if isinstance(n, ast.Name)} | args
        assert not {n for n in used if graph_like.match(n)}, f.name
        assert not {a for a in args if re.match(r"^x\d+$", a)}, f.name  # positional placeholders x0, x1, ...

    def params(name: str) -> list[str]:
        return [a.arg for a in fns[name].args.args]

    def assigned(name: str) -> set[str]:
        return {t.id for n in ast.walk(fns[name]) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}

    for fn in ("torch_model_norm", "triton_model_norm", "torch_model_layers_N_self_attn_q_norm"):
        assert params(fn) == ["hidden_states", "weight", "align", "lanes"], fn
    assert {"variance", "hidden_states_1"} <= assigned("torch_model_norm")
    rope = next(s for s in manifest.splices if s.target == "function")
    assert params(rope.torch_fn)[:-2] == [i.removeprefix("arg:") for i in rope.inputs]  # the binding's order
    assert params(rope.triton_fn)[:-2] == params(rope.torch_fn)[:-2]
    assert {"q_embed", "k_embed", "q_embed_mul", "x1", "x2"} <= assigned(rope.torch_fn)
    assert params("torch_model_layers_N_mlp_act_fn")[0] == "input"  # SiLUActivation.forward(self, input)


def test_manifest_matches_its_schema(qwen3_patch) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    out, _ = qwen3_patch
    schema = json.loads((Path(__file__).resolve().parent.parent / "graphdiff/schemas/manifest.schema.json").read_text())
    jsonschema.validate(json.loads((out / "manifest.json").read_text()), schema)


def test_unknown_region_is_refused(tmp_path: Path) -> None:
    from graphdiff.errors import GraphdiffError

    with pytest.raises(GraphdiffError, match="no region nope"):
        generate(QWEN3, tmp_path, ["nope"])


def check_pytorch_path(scan_dir: Path, out: Path) -> None:
    checks = verify(scan_dir, out, triton=False)
    assert checks and all(c.path == "torch" for c in checks)
    bad = [c for c in checks if not c.ok]
    assert not bad, bad


def test_pytorch_path_is_bit_identical_to_the_plan_replay(qwen3_patch) -> None:
    out, _ = qwen3_patch
    check_pytorch_path(QWEN3, out)


def test_verify_catches_a_rounding_point_moved(qwen3_patch, tmp_path: Path) -> None:
    """The check can fail: a generated module that rounds SiLU's output where the engine does not is caught."""
    out, _ = qwen3_patch
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    code = (bad / "graphdiff_patch.py").read_text()
    lines = code.splitlines()
    i = next(k for k, line in enumerate(lines) if line.lstrip().startswith("def torch_") and "act_fn" in line)
    ret = next(k for k in range(i, len(lines)) if lines[k].lstrip().startswith("return ("))
    indent = lines[ret][: len(lines[ret]) - len(lines[ret].lstrip())]
    var = lines[ret].split("(", 1)[1].split(" ", 1)[0].rstrip(",)")
    lines.insert(ret, f"{indent}{var} = _round({var}, torch.bfloat16)")
    (bad / "graphdiff_patch.py").write_text("\n".join(lines) + "\n")
    m = json.loads((bad / "manifest.json").read_text())
    m["module_sha256"] = hashlib.sha256((bad / "graphdiff_patch.py").read_bytes()).hexdigest()
    (bad / "manifest.json").write_text(json.dumps(m))
    checks = verify(QWEN3, bad, triton=False)
    failed = {c.splice for c in checks if not c.ok}
    assert any("act_fn" in k for k in failed), checks
    assert all("act_fn" in k for k in failed)


def test_codegen_rounds_where_the_plan_says_not_where_an_op_list_would(tmp_path: Path) -> None:
    """The trainer's rounding points come from scan.json's plan: a decision that HF does not round SiLU's result
    (edited here) removes that rounding from the generated code; nothing in codegen re-derives it."""
    edited = tmp_path / "scan"
    shutil.copytree(QWEN3, edited)
    data = json.loads((edited / "scan.json").read_text())
    silu = [d for d in data["plan"] if d["op"] == "aten.silu.default"]
    assert silu and all(d["train"]["rounds"] for d in silu)
    generate(edited, tmp_path / "before")
    for d in silu:
        d["train"]["rounds"] = False
    (edited / "scan.json").write_text(json.dumps(data))
    generate(edited, tmp_path / "after")
    before, after = ((tmp_path / x / "graphdiff_patch.py").read_text() for x in ("before", "after"))
    # the SiLU node's variable, as the PyTorch function (first) and the Triton kernels name it
    var = re.search(r"^    (\w+) = F\.silu\(.*  # aten\.silu\.default: ", before, re.M).group(1)
    assert f"{var} = _round({var}" in before and f"{var} = _round({var}" not in after
    assert f"{var} = _rne({var})" in before and f"{var} = _rne({var})" not in after  # Triton too


def triton_in_interpreter(scan_dir: Path, out: Path) -> list[dict]:
    """verify() of both paths in a fresh interpreter with TRITON_INTERPRET=1 set before triton is imported
    (the flag is read once; other tests in this process may have imported triton already)."""
    pytest.importorskip("triton")
    code = ("import json, sys; from pathlib import Path; from graphdiff.codegen.verify import verify; "
            "print(json.dumps([c.as_dict() for c in verify(Path(sys.argv[1]), Path(sys.argv[2]))]))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(scan_dir), str(out)], capture_output=True, text=True,
                          env=env, cwd=Path(__file__).resolve().parent.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any(c["path"] == "triton" for c in checks)
    bad = [c for c in checks if not c["ok"]]
    assert not bad, bad
    return checks


def test_triton_path_matches_in_the_interpreter(qwen3_patch) -> None:
    """The kernels with Inductor's calls (libdevice.rsqrt, libdevice.exp, FP32 persistent sums) run in the
    interpreter and match the PyTorch path: bit for bit, except SiLU's FP32 output (numpy's exp, named)."""
    out, _ = qwen3_patch
    src = (out / "graphdiff_patch.py").read_text()
    assert "libdevice.rsqrt(" in src and "libdevice.exp(" in src and "tl.float64" not in src
    checks = triton_in_interpreter(QWEN3, out)
    assert max(c["grad_rel_err"] for c in checks) < GRAD_RTOL
    triton = [c for c in checks if c["path"] == "triton"]
    assert all(c["identical"] for c in triton if "act_fn" not in c["splice"]), triton
    assert all(c["ulp_limit"] == 0 and not c["cause"] for c in triton if "act_fn" not in c["splice"])
    assert all("exp" in c["cause"] for c in triton if "act_fn" in c["splice"])


BLOCKWISE = """
import sys, torch
from pathlib import Path
from graphdiff.runtime import load_generated, load_manifest
from graphdiff.codegen.verify import fragments, probes
out = Path(sys.argv[1])
manifest = load_manifest(out)
gen = load_generated(manifest, out / "manifest.json")
frags, nodes = fragments(Path(sys.argv[2]))
splice = next(s for s in manifest.splices if s.key == "model.layers.*.self_attn.q_norm")
xs = [x.requires_grad_() for x in probes(frags[splice.key], nodes, seed=1)]
rows = xs[0].numel() // xs[0].shape[-1]
sizes = []

class Sizes(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.empty.memory_format:
            sizes.append((list(out.shape), str(out.dtype)))
        return out

def grads(programs):
    gen.GRAD_PROGRAMS = programs
    y = getattr(gen, splice.triton_fn)(*xs, align=frozenset(splice.regions))[0]
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    with Sizes():
        g = torch.autograd.grad((y.float() * w).sum(), xs)
    return g, list(sizes)

(gx1, gw1), _ = grads(1024)
sizes.clear()
(gx3, gw3), seen = grads(3)
ref = torch.autograd.grad((getattr(gen, splice.torch_fn)(*xs, align=frozenset(splice.regions))[0].float()
                           * torch.randn(gx1.shape, generator=torch.Generator().manual_seed(2))).sum(), xs)
assert rows > 3 and rows % 3, rows
d = xs[1].shape[-1]
assert ([3, d], "torch.float32") in seen and ([rows, d], "torch.float32") not in seen, seen  # 3 partial rows
assert ([rows, d], "torch.bfloat16") in seen  # the input's gradient: stored in its dtype, no FP32 copy
assert torch.equal(gx1, gx3)  # the input's gradient does not depend on the blocking
assert gw1.dtype == gw3.dtype == xs[1].dtype
err = lambda a, b: float((a.double() - b.double()).abs().max() / b.double().abs().max())
assert err(gw3, ref[1]) < 2e-2 and err(gw1, ref[1]) < 2e-2, (err(gw3, ref[1]), err(gw1, ref[1]))
assert err(gx3, ref[0]) < 2e-2, err(gx3, ref[0])
print("ok", rows, seen)
"""


def test_weight_gradient_is_summed_blockwise_in_the_interpreter(qwen3_patch) -> None:
    """A norm weight's gradient is reduced in the backward kernel, a block of rows per program: the buffer is
    programs x D (here 3 programs over rows not divisible by 3), not rows x D; same gradients."""
    pytest.importorskip("triton")
    out, _ = qwen3_patch
    proc = subprocess.run([sys.executable, "-c", BLOCKWISE, str(out), str(QWEN3)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).resolve().parent.parent,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


def test_an_attention_that_calls_sdpa_itself_swaps_that_call(tmp_path: Path) -> None:
    """The attention region swaps the function transformers' attention interface calls; where the trainer's sdpa
    node comes from the model's own file (FalconAttention calls sdpa itself), the splice swaps torch's sdpa while the
    module runs (`runtime.TORCH_SDPA`, adapted by the generated `sdpa_call`)."""
    from graphdiff.runtime import TORCH_SDPA

    edited = tmp_path / "scan"
    shutil.copytree(QWEN3, edited)
    train = json.loads((edited / "train.capture.json").read_text())
    sdpa = [n for g in train["graphs"] for n in g["nodes"]
            if n.get("source") and n["source"]["file"].endswith("sdpa_attention.py")]
    assert sdpa
    for n in sdpa:
        n["source"]["file"] = n["source"]["file"].replace("integrations/sdpa_attention.py",
                                                          "models/falcon/modeling_falcon.py")
    (edited / "train.capture.json").write_text(json.dumps(train))
    made = generate(edited, tmp_path / "patch")
    attention = [r for r in made.regions if r.kind == "attention"]
    assert attention and all(r.generated for r in attention)
    splice = next(s for s in made.splices if s.target == "attention")
    assert splice.function == TORCH_SDPA and not splice.problems
    source = (tmp_path / "patch" / "graphdiff_patch.py").read_text()
    assert "def sdpa_call(" in source and "def attention_fp32_inputs(" in source
    plain = generate(QWEN3, tmp_path / "plain")
    assert next(s for s in plain.splices if s.target == "attention").function != TORCH_SDPA
    assert "def sdpa_call(" not in (tmp_path / "plain" / "graphdiff_patch.py").read_text()


ROPE = "model.rotary_emb#rope"


def _scan_with_rotary_region(tmp_path: Path) -> Path:
    """The Qwen3 scan with a region on its rotary embedding, whose forward returns (cos, sin): HF rounds both to
    BF16, the engine keeps them FP32 (as GPT-NeoX's engine computes them inside its RoPE kernel); the attention ran
    vLLM CPU's op, so `--attention engine` splices it."""
    edited = tmp_path / "scan"
    shutil.copytree(QWEN3, edited)
    data = json.loads((edited / "scan.json").read_text())
    data["engine_attention"] = {"backend": "CPU_ATTN"}
    casts = [d for d in data["plan"] if d["module"] == "model.rotary_emb" and d["train"]["rounds"]]
    nodes = {n["name"]: n for n in json.loads((edited / "train.capture.json").read_text())["graphs"][0]["nodes"]}
    template = data["sites"][0]
    assert len(casts) == 2
    for d in casts:
        d.update(site=True, region=ROPE, kind="rope", engine={**d["train"], "dtype": "float32", "rounds": False})
        n = nodes[d["node"]]
        data["sites"].append({**template, "id": d["id"], "region": ROPE, "kind": "rope", "layer": None,
                              "train": {**template["train"], "node": n["name"], "op": n["target"],
                                        "module": n["module"], "source": n["source"]}})
    region = next(r for r in data["regions"] if r["kind"] == "qk_norm")
    data["regions"].append({**region, "name": ROPE, "kind": "rope", "module": "model.rotary_emb", "layers": [None],
                            "sites": [d["id"] for d in casts], "differing_layers": [], "reduction_lanes": {}})
    (edited / "scan.json").write_text(json.dumps(data))
    return edited


def test_a_module_forward_returning_cos_and_sin_is_re_emitted(tmp_path: Path) -> None:
    """A rotary embedding's forward(x, position_ids) returns (cos, sin): the splice reads `position_ids` (x only for
    its dtype), returns both in the forward's order, and the runtime's forward returns that tuple. Unaligned, HF's
    values bit for bit (at another length than the captured 16); aligned, FP32 only while the region of the code
    reading them in every layer (the RoPE function's splice) is aligned too, whatever the attention region does (the
    RoPE splice hands sdpa its BF16 store)."""
    import torch
    import transformers

    from graphdiff.runtime import load_generated
    from graphdiff.runtime.dispatch import chooser, module_forward

    edited = _scan_with_rotary_region(tmp_path)
    manifest = generate(edited, tmp_path / "patch", attention="engine")
    rope = next(r for r in manifest.regions if r.name == ROPE)
    assert rope.generated, rope.reason
    splice = next(s for s in manifest.splices if s.key == "model.rotary_emb")
    assert (splice.target, splice.inputs, splice.outputs) == ("module", ["arg:position_ids", "param:inv_freq"], [0, 1])
    attention = next(r.name for r in manifest.regions if r.kind == "attention")
    rope_fn = next(r.name for r in manifest.regions if r.kind == "rope" and r.name != ROPE)
    gen = load_generated(manifest, tmp_path / "patch" / "manifest.json")

    config = transformers.Qwen3Config(**json.loads((edited / "scan.json").read_text())["config"])
    mod = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(config)
    x, positions = torch.zeros(1, dtype=torch.bfloat16), torch.arange(21)[None]
    with torch.no_grad():
        hf = mod(x, positions)
        freqs = positions[..., None].float() * mod.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        fp32 = (emb.cos() * mod.attention_scaling, emb.sin() * mod.attention_scaling)
        for align, want in ((frozenset(), hf), (frozenset({ROPE}), hf), (frozenset({ROPE, attention}), hf),
                            (frozenset({ROPE, rope_fn}), fp32)):
            forward = module_forward(mod, splice, chooser(gen, splice), align)
            for got in (forward(x, positions), forward(x, position_ids=positions)):
                assert isinstance(got, tuple) and len(got) == 2
                assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want)), sorted(align)


def test_a_feature_size_equal_to_the_token_count_is_not_taken_for_a_baked_in_count() -> None:
    """GPT-NeoX's tiny rotary dimension is 16, as is the captured prompt: at 21 tokens cos is [1, 21, 16]."""
    from graphdiff.codegen.probes import _follows

    assert _follows([1, 21, 16], [1, 16, 16], 16, 21) and _follows([1, 21, 21], [1, 16, 16], 16, 21)
    assert not _follows([1, 16, 16], [1, 16, 16], 16, 21)  # the count baked in: nothing follows it
    assert not _follows([1, 21, 8], [1, 16, 16], 16, 21) and _follows([4, 8], [4, 8], 16, 21)


def test_a_buffer_whose_size_equals_the_token_count_keeps_it_at_another_count() -> None:
    """Phi's tiny rotary embedding: inv_freq has 16 entries, as the captured prompt has tokens. The emitted code
    run at 21 tokens reads a 16-entry inv_freq (a buffer has no token count) and gives cos [1, 21, 32]."""
    import torch

    from graphdiff.codegen.fragment import Fragment
    from graphdiff.codegen.probes import other_length_problem
    from graphdiff.records import Node

    def rotary(position_ids: torch.Tensor, inv_freq: torch.Tensor, align: frozenset[str]) -> tuple[torch.Tensor]:
        freqs = position_ids[..., None].float() * inv_freq
        return (torch.cat((freqs, freqs), dim=-1).cos(),)

    nodes = {"pos": Node(name="pos", op="placeholder", target="pos", dtype="int64", shape=[1, 16]),
             "inv_freq": Node(name="inv_freq", op="placeholder", target="inv_freq", dtype="float32", shape=[16],
                              param="model.rotary_emb.inv_freq"),
             "cos": Node(name="cos", op="call_function", target="aten.cos.default", dtype="float32", shape=[1, 16, 32])}
    frag = Fragment(key="model.rotary_emb", target="module", module="model.rotary_emb", module_class="Rotary",
                    inputs=["pos", "inv_freq"], params={"inv_freq": "inv_freq"}, outputs=["cos"], compiled=rotary)
    assert other_length_problem(frag, nodes, 16) == ""


def test_token_ids_probe_as_valid_indices() -> None:
    """Gemma's scaled embedding is a region wherever sqrt(hidden) is no BF16 value (hidden 384): its code looks up
    the token ids. The probes at another token count, and verify's, draw ids a table can index."""
    import torch

    from graphdiff.codegen.fragment import Fragment
    from graphdiff.codegen.probes import other_length_problem
    from graphdiff.codegen.verify import probes
    from graphdiff.records import Node

    def scaled_embedding(input_ids: torch.Tensor, weight: torch.Tensor, align: frozenset[str]) -> tuple[torch.Tensor]:
        return (torch.nn.functional.embedding(input_ids, weight).float() * 19.595917942265423,)

    nodes = {"ids": Node(name="ids", op="placeholder", target="ids", dtype="int64", shape=[1, 16]),
             "weight": Node(name="weight", op="placeholder", target="weight", dtype="bfloat16", shape=[512, 384],
                            param="model.embed_tokens.weight"),
             "out": Node(name="out", op="call_function", target="aten.mul.Tensor", dtype="float32",
                         shape=[1, 16, 384])}
    frag = Fragment(key="model.embed_tokens", target="module", module="model.embed_tokens",
                    module_class="Gemma3TextScaledWordEmbedding", inputs=["ids", "weight"],
                    params={"weight": "weight"}, outputs=["out"], compiled=scaled_embedding)
    assert other_length_problem(frag, nodes, 16) == ""
    ids, weight = probes(frag, nodes, seed=0)
    assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 2
    assert weight.dtype == torch.bfloat16 and scaled_embedding(ids, weight, frozenset())[0].shape == (1, 16, 384)


def test_a_post_norm_output_summed_by_a_carried_residual_add_leaves_in_fp32():
    """`residual + post_attention_layernorm(h)` (Gemma 2, GLM-4, OLMo 2): the engine's fused add reads the norm's
    unrounded output; with the carry's regions aligned the trainer's add sums it in FP32 too, so the norm splice
    returns it unrounded, and only then."""
    from graphdiff.codegen.fragment import Fragment
    from graphdiff.codegen.outputs import decide_outputs
    from graphdiff.records import Graph, Node

    def node(name: str, target: str, module: str, *inputs: str) -> Node:
        return Node(name=name, op="call_function", target=target, inputs=list(inputs), module=module,
                    dtype="bfloat16")

    layer, norm = "model.layers.0", "model.layers.0.post_attention_layernorm"
    nodes = [Node(name="residual", op="placeholder", target="residual", module=layer),
             node("norm_out", "aten.mul.Tensor", norm, "residual"),
             node("add", "aten.add.Tensor", layer, "residual", "norm_out"),
             node("next", "aten.pow.Tensor_Scalar", "model.layers.1.input_layernorm", "add")]
    graph = Graph(name="g", nodes=nodes)
    frag = Fragment(key="model.layers.*.post_attention_layernorm", target="module",
                    module="model.layers.*.post_attention_layernorm", module_class="RMSNorm", nodes=[nodes[1]],
                    outputs=["norm_out"])
    carry = Fragment(key="model.layers.*", target="carry", module="model.layers.*", module_class="Layer",
                     nodes=[nodes[2]], regions=["model.layers.*#residual_norm"])
    decide_outputs(graph, [frag, carry])
    assert frag.keep_fp32["norm_out"] and frag.fp32_with["norm_out"] == ["model.layers.*#residual_norm"]
    decide_outputs(graph, [frag])  # no carry: the add sums in BF16, the output is rounded at the boundary
    assert not frag.keep_fp32["norm_out"]


def test_a_table_made_from_positions_is_read_in_its_recorded_dtype() -> None:
    """Gemma's scaled embedding is carried FP32 where sqrt(hidden) is no BF16 value; HF's rotary embedding makes its
    cos/sin in its input's dtype, so they came FP32 while the engine reads its BF16 table (Gemma 3 at hidden 384: 0%
    of log-probs at the engine). Inputs made from no activation are found (`fixed_inputs`), and the runtime casts
    them back to the recorded dtype; an activation input (q) is not."""
    import torch

    from graphdiff.codegen.cut import _keep_spliced_inputs, fixed_inputs
    from graphdiff.codegen.fragment import Fragment
    from graphdiff.records import FunctionSplice, Graph, Node
    from graphdiff.runtime.dispatch import chooser

    def n(name: str, target: str, inputs: list[str], dtype: str, op: str = "call_function", **kw) -> Node:
        return Node(name=name, op=op, target=target, inputs=inputs, dtype=dtype, **kw)

    graph = Graph(name="g", nodes=[
        n("ids", "ids", [], "int64", "placeholder"), n("pos", "pos", [], "int64", "placeholder"),
        n("inv_freq", "inv_freq", [], "float32", "placeholder", param="model.rotary_emb.inv_freq"),
        n("table", "table", [], "bfloat16", "placeholder", param="model.embed_tokens.weight"),
        n("emb", "aten.embedding.default", ["table", "ids"], "bfloat16"),
        n("q", "aten.mul.Tensor", ["emb"], "bfloat16"),
        n("freqs", "aten.mul.Tensor", ["inv_freq", "pos"], "float32"),
        n("cos32", "aten.cos.default", ["freqs"], "float32"),
        n("cos", "aten._to_copy.default", ["cos32"], "bfloat16"),
        n("hidden", "hidden", [], "bfloat16", "placeholder")])
    assert fixed_inputs(graph, ["cos", "q", "hidden", "table", "cos32"], set()) == {"cos": "bfloat16"}
    assert fixed_inputs(graph, ["cos"], {"cos"}) == {}  # a table input the engine rounds when aligned instead
    # a rotary module that is a region of its own hands its cos on in FP32 on purpose: not cast back
    nodes = graph.node_map()
    rotary = Fragment(key="model.rotary_emb", target="module", module="model.rotary_emb", module_class="Rotary",
                      nodes=[nodes[n] for n in ("freqs", "cos32", "cos")], inputs=["inv_freq", "pos"],
                      outputs=["cos"])
    for made_by in ([], [rotary]):
        rope = Fragment(key="rope", target="function", module="model.layers.*.self_attn", module_class="Attention",
                        inputs=["cos", "q"], fixed_inputs={"cos": "bfloat16"})
        _keep_spliced_inputs(graph, [*made_by, rope])
        assert rope.fixed_inputs == ({} if made_by else {"cos": "bfloat16"})

    seen: list[torch.dtype] = []

    class Gen:
        @staticmethod
        def torch_rope(cos, q, align, lanes=0):
            seen.extend([cos.dtype, q.dtype])
            return (q * cos,)

    splice = FunctionSplice(key="rope", module="model.layers.*.self_attn", function="apply_rotary_pos_emb",
                            regions=["model.layers.*.self_attn#rope"], torch_fn="torch_rope",
                            fixed_inputs={0: "bfloat16"})
    run = chooser(Gen, splice)  # type: ignore[arg-type]  # a stand-in for the generated module
    run([torch.rand(4, dtype=torch.float32), torch.rand(4, dtype=torch.float32)], frozenset())
    assert seen == [torch.bfloat16, torch.float32]
