"""Patch generation: deterministic output, and every generated region computes exactly its rounding plan.

References are independent of the emitters: the scanner's RoundingInterpreter replays the region's ATen
fragment from train.capture.json with rounding at exactly the plan's nodes (FP32 elsewhere), and a float64
replay without any rounding is the reference for gradients.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphdiff.codegen import generate
from graphdiff.codegen.fragment import decide_outputs, fragment_for, merge, rounds
from graphdiff.codegen.generate import load_scan_dir
from graphdiff.model import Manifest
from graphdiff.replay import RoundingInterpreter, fragment_graph

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
QWEN3 = FIXTURES / "scans" / "tiny-qwen3"
GRAD_RTOL = 2e-2  # BF16 storage of the forward values and (PyTorch path) of the gradients: ~2^-8 each


def load_generated(out: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, out / "graphdiff_patch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def fragments(scan_dir: Path) -> dict:
    scan, train = load_scan_dir(scan_dir)
    graph = train.graphs[0]
    frags = merge([fragment_for(scan, graph, r) for r in scan.regions])
    decide_outputs(graph, frags)
    return {f.key: f for f in frags}, graph.node_map()


def probes(frag, nodes, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn([s if isinstance(s, int) else 8 for s in nodes[i].shape], generator=gen).to(torch.bfloat16)
            for i in frag.inputs]


def replay(frag, nodes, xs: list[torch.Tensor], align: frozenset[str], compute=torch.float32, plan=True):
    """The fragment's outputs under the plan: rounded at computing low-precision nodes that are not sites of
    an aligned region (what the generated code must do), FP32 (or `compute`) everywhere else."""
    rounded = {n.name for n in frag.nodes if rounds(n) and frag.sites.get(n.name) not in align} if plan else set()
    # kwargs travel as {"dict": ...} so that a `dtype=` keyword is not read as a dtype literal
    wrapped = [n.model_copy(update={"call": [n.call[0], {"dict": n.call[1]}]}) for n in frag.nodes]
    gm = fragment_graph(wrapped, frag.inputs, {})
    interp = RoundingInterpreter(gm, {n.name: n.dtype for n in frag.nodes}, "fp32", rounded, compute)
    interp.run(*xs)
    return [interp.values[o] for o in frag.outputs]


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
    assert kinds == {"rope", "qk_norm", "gated_act", "residual_norm", "norm_weight"}
    assert all(r.generated for r in manifest.regions), [r.reason for r in manifest.regions]
    for s in manifest.splices:
        assert s.target == "carry" or s.triton_fn, s.triton_problem
    rope = next(s for s in manifest.splices if s.target == "function")
    assert rope.function.endswith("modeling_qwen3.apply_rotary_pos_emb")
    assert sorted(rope.inputs) == ["arg:cos", "arg:k", "arg:q", "arg:sin"]
    import hashlib
    assert hashlib.sha256((out / manifest.module_file).read_bytes()).hexdigest() == manifest.module_sha256


def test_manifest_matches_its_schema(qwen3_patch) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    out, _ = qwen3_patch
    schema = json.loads((Path(__file__).resolve().parent.parent / "graphdiff/schemas/manifest.schema.json").read_text())
    jsonschema.validate(json.loads((out / "manifest.json").read_text()), schema)


def test_unknown_region_is_refused(tmp_path: Path) -> None:
    from graphdiff.errors import GraphdiffError

    with pytest.raises(GraphdiffError, match="no region nope"):
        generate(QWEN3, tmp_path, ["nope"])


def check_pytorch_path(scan_dir: Path, out: Path, manifest: Manifest, name: str) -> None:
    gen = load_generated(out, name)
    frags, nodes = fragments(scan_dir)
    for splice in manifest.splices:
        if splice.target == "carry" or splice.problems:
            continue
        frag = frags[splice.key]
        xs = probes(frag, nodes)
        for align in (frozenset(), frozenset(splice.regions)):
            ours = getattr(gen, splice.torch_fn)(*xs, align=align)
            ref = replay(frag, nodes, xs, align)
            for o, r in zip(ours, ref):
                assert torch.equal(o.float(), r.float()), (splice.key, sorted(align))


def test_pytorch_path_is_bit_identical_to_the_plan_replay(qwen3_patch) -> None:
    out, manifest = qwen3_patch
    check_pytorch_path(QWEN3, out, manifest, "gd_patch_q3_torch")


def check_triton_path(scan_dir: Path, out: Path, manifest: Manifest, name: str) -> dict[str, float]:
    """Triton (interpreter) vs the PyTorch path with FP64-accumulated reductions: bit-identical, except FP32
    outputs of transcendental ops (exp in SiLU: numpy's exp vs ATen's vectorized exp), within 2 ulp.
    Backward of both paths vs a float64 replay without rounding: relative error below GRAD_RTOL."""
    gen = load_generated(out, name)
    gen.EXACT_REDUCTIONS = True
    frags, nodes = fragments(scan_dir)
    worst: dict[str, float] = {}
    for splice in manifest.splices:
        if not splice.triton_fn:
            continue
        frag = frags[splice.key]
        transcendental = any(n.target.split(".")[1] in ("silu", "exp", "sigmoid") for n in frag.nodes)
        for align in (frozenset(), frozenset(splice.regions)):
            xs = [x.requires_grad_() for x in probes(frag, nodes, seed=1)]
            ref = getattr(gen, splice.torch_fn)(*xs, align=align)
            tri = getattr(gen, splice.triton_fn)(*xs, align=align)
            for r, t in zip(ref, tri):
                assert r.dtype == t.dtype and r.shape == t.shape
                if transcendental and r.dtype == torch.float32:
                    ulp = torch.finfo(torch.float32).eps * r.abs().clamp_min(1e-30)
                    assert ((r - t).abs() <= 2 * ulp).all(), splice.key
                else:
                    assert torch.equal(r, t), (splice.key, sorted(align), (r.float() - t.float()).abs().max())
            x64 = [x.detach().double().requires_grad_() for x in xs]
            exact = replay(frag, nodes, x64, align, compute=torch.float64, plan=False)
            weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
                       for o in exact]
            g64 = torch.autograd.grad(sum((o * w).sum() for o, w in zip(exact, weights)), x64, allow_unused=True)
            for label, outs in (("torch", ref), ("triton", tri)):
                g = torch.autograd.grad(sum((o.double() * w).sum() for o, w in zip(outs, weights)), xs,
                                        allow_unused=True, retain_graph=True)
                for a, b in zip(g, g64):
                    if b is None:
                        continue
                    err = float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12))
                    worst[f"{label} {splice.key}"] = max(worst.get(f"{label} {splice.key}", 0.0), err)
                    assert err < GRAD_RTOL, (label, splice.key, err)
    return worst


def triton_in_interpreter(scan_dir: Path, out: Path) -> dict[str, float]:
    """check_triton_path in a fresh interpreter with TRITON_INTERPRET=1 set before triton is imported (the
    flag is read once; other tests in this process may have imported triton already)."""
    pytest.importorskip("triton")
    code = ("import json, sys; from pathlib import Path; from graphdiff.model import Manifest; "
            "from tests.test_codegen import check_triton_path; "
            "m = Manifest.model_validate_json(Path(sys.argv[2], 'manifest.json').read_text()); "
            "print(json.dumps(check_triton_path(Path(sys.argv[1]), Path(sys.argv[2]), m, 'gd_triton')))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(scan_dir), str(out)], capture_output=True, text=True,
                          env=env, cwd=Path(__file__).resolve().parent.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_path_matches_in_the_interpreter(qwen3_patch) -> None:
    out, _ = qwen3_patch
    worst = triton_in_interpreter(QWEN3, out)
    assert worst and max(worst.values()) < GRAD_RTOL
