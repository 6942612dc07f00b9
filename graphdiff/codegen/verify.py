"""Check a generated patch against its own scan, on the hardware it will run on.

References are independent of the emitters: the scanner's RoundingInterpreter replays each splice's ATen
fragment from train.capture.json, rounding at exactly the plan's nodes (FP32 elsewhere); a float64 replay
without any rounding is the reference for gradients. Per splice and per `align` (no region aligned, its own
regions aligned):
- PyTorch path: bit-identical to the plan replay on the same device;
- Triton path: bit-identical to the plan replay with FP64-accumulated row reductions (what the kernels
  accumulate), except FP32 outputs of transcendental ops (exp in SiLU; on CUDA also rsqrt), in ulp;
- both paths: gradients within a relative error of the float64 replay's.

`graphdiff patch SCAN --out DIR --verify [--device cuda]` runs it after generating; the tests run it on the
CPU and (TRITON_INTERPRET=1) in Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from graphdiff.codegen.fragment import Fragment, cut_fragments, rounding_points
from graphdiff.codegen.generate import load_scan_dir
from graphdiff.model import Manifest, Node
from graphdiff.replay import RoundingInterpreter, fragment_graph
from graphdiff.runtime import load_generated, load_manifest

GRAD_RTOL = 2e-2  # BF16 storage of the forward values and (PyTorch path) of the gradients: ~2^-8 each
TRANSCENDENTAL_ULP = 2  # FP32 exp differs between implementations (ATen vectorized, numpy)
# On CUDA torch's rsqrt and exp are CUDA's rsqrtf/expf (each up to 2 ulp from exact, CUDA math docs) while the
# kernels use a correctly rounded 1/sqrt and Triton's exp: FP32 outputs may differ by their sum (2.55 ulp measured
# on an H200, benchmarks/results/h200/gpu_checks.json).
CUDA_ULP = 4
_TRANSCENDENTAL = ("silu", "exp", "sigmoid")
_CUDA_INEXACT = (*_TRANSCENDENTAL, "rsqrt")


@dataclass
class Check:
    """One splice, one path, one alignment: how its outputs and gradients compare with the references."""

    splice: str
    path: str  # torch | triton
    aligned: bool
    identical: bool  # every output bit-identical to its reference
    max_ulp: float  # largest FP32 output difference in ulp (0 where identical; BF16 outputs count as FP32)
    grad_rel_err: float  # max |g - g64| / max |g64| over inputs
    ok: bool

    def as_dict(self) -> dict:
        return asdict(self)


def fragments(scan_dir: Path, manifest: Manifest) -> tuple[dict[str, Fragment], dict[str, Node]]:
    """The splice points exactly as `generate` cut them for this manifest (same regions, same boundaries)."""
    scan, train = load_scan_dir(scan_dir)
    graph = train.graphs[0]
    frags = cut_fragments(scan, graph, [r.name for r in manifest.regions])
    return {f.key: f for f in frags}, graph.node_map()


def probes(frag: Fragment, nodes: dict[str, Node], seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    """BF16 random inputs of the fragment's shapes (symbolic sizes as 8), drawn on the CPU for every device."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn([s if isinstance(s, int) else 8 for s in nodes[i].shape], generator=gen)
            .to(torch.bfloat16).to(device) for i in frag.inputs]


def replay(frag: Fragment, nodes: dict[str, Node], xs: list[torch.Tensor], align: frozenset[str],
           compute: torch.dtype = torch.float32, plan: bool = True,
           reduce: torch.dtype | None = None) -> list[torch.Tensor]:
    """The fragment's outputs under the plan (fragment.rounding_points: what the generated code must do), FP32
    (or `compute`) everywhere else; `reduce`: row reductions accumulate in that dtype."""
    rounded = rounding_points(frag, align) if plan else set()
    gm = fragment_graph(frag.nodes, frag.inputs, {})
    # an engine-only rounding of an FP32 trainer value rounds to BF16 (the engine's store)
    declared = {n.name: n.dtype if n.name not in frag.engine_sites else "bfloat16" for n in frag.nodes}
    interp = RoundingInterpreter(gm, declared, "fp32", rounded, compute, reduce)
    interp.run(*xs)
    return [interp.values[o] for o in frag.outputs]


def _ulp(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    ulp = torch.finfo(torch.float32).eps * torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
    return float(((a - b).abs() / ulp).max()) if a.numel() else 0.0


def _grad_error(outs: list[torch.Tensor], xs: list[torch.Tensor], g64: tuple, weights: list[torch.Tensor]) -> float:
    g = torch.autograd.grad(sum((o.double() * w).sum() for o, w in zip(outs, weights)), xs, allow_unused=True,
                            retain_graph=True)
    errs = [float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12))
            for a, b in zip(g, g64) if b is not None and a is not None]
    return max(errs, default=0.0)


def verify(scan_dir: Path, out_dir: Path, *, device: str = "cpu", triton: bool = True) -> list[Check]:
    """Every generated splice of the patch in `out_dir` (made from `scan_dir`) against the references."""
    manifest = load_manifest(out_dir)
    gen = load_generated(manifest, out_dir / "manifest.json")  # the module the runtime loads, sha256-checked
    frags, nodes = fragments(scan_dir, manifest)
    checks: list[Check] = []
    for splice in manifest.splices:
        if splice.target in ("carry", "attention") or splice.problems:
            continue
        frag = frags[splice.key]
        inexact = _CUDA_INEXACT if device.startswith("cuda") else _TRANSCENDENTAL
        transcendental = any(n.target.split(".")[1] in inexact for n in frag.nodes)
        ulp_limit = CUDA_ULP if device.startswith("cuda") else TRANSCENDENTAL_ULP
        for align in (frozenset(), frozenset(splice.regions)):
            xs = [x.requires_grad_() for x in probes(frag, nodes, seed=1, device=device)]
            x64 = [x.detach().double().requires_grad_() for x in xs]
            exact = replay(frag, nodes, x64, align, compute=torch.float64, plan=False)
            weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
                       .to(device) for o in exact]
            g64 = torch.autograd.grad(sum((o * w).sum() for o, w in zip(exact, weights)), x64, allow_unused=True)

            with torch.no_grad():  # the plan replay reduces as ATen does, as the PyTorch path does by default
                ref = replay(frag, nodes, [x.detach() for x in xs], align)
            ours = getattr(gen, splice.torch_fn)(*xs, align=align)
            same = all(torch.equal(o.float(), r.float()) for o, r in zip(ours, ref))
            err = _grad_error(list(ours), xs, g64, weights)
            checks.append(Check(splice.key, "torch", bool(align), same,
                                max(_ulp(o, r) for o, r in zip(ours, ref)), err, same and err < GRAD_RTOL))
            if not (triton and splice.triton_fn):
                continue
            with torch.no_grad():  # the kernels reduce rows in FP64: order-independent; outputs as the PyTorch path's
                ref = [r.to(o.dtype) for r, o in zip(replay(frag, nodes, [x.detach() for x in xs], align,
                                                            reduce=torch.float64), ours)]
            tri = getattr(gen, splice.triton_fn)(*xs, align=align)
            same = all(r.dtype == t.dtype and r.shape == t.shape and torch.equal(r, t) for r, t in zip(ref, tri))
            ulp = max(_ulp(r, t) for r, t in zip(ref, tri))
            # a transcendental's FP32 output may differ by a few ulp; a BF16 store of it must still match
            close = all(torch.equal(r, t) or (transcendental and r.dtype == torch.float32) for r, t in zip(ref, tri))
            err = _grad_error(list(tri), xs, g64, weights)
            checks.append(Check(splice.key, "triton", bool(align), same, ulp, err,
                                close and ulp <= (ulp_limit if transcendental else 0) and err < GRAD_RTOL))
    return checks
