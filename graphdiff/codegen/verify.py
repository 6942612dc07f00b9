"""Check a generated patch against its own scan, on the hardware it will run on.

References are independent of the emitters: the scanner's RoundingInterpreter replays each splice's ATen
fragment from train.capture.json, rounding at exactly the plan's nodes (FP32 elsewhere); a float64 replay
without any rounding is the reference for gradients. Per splice and per `align` (no region aligned, its own
regions aligned):
- PyTorch path: bit-identical to the plan replay on the same device;
- Triton path: bit-identical to the PyTorch path, except FP32 outputs that depend on a function the two compute
  differently (`tolerance`: each non-zero allowance names its cause). Its probes lie on a fixed-point grid on
  which every row sum is exact in FP32 in any order, so the check compares the functions, not the summation
  order (the kernels sum as Inductor's persistent reduction does, a tree; ATen sums its own way);
- both paths: gradients within a relative error of the float64 replay's.

`graphdiff patch SCAN --out DIR --verify [--device cuda]` runs it after generating; the tests run it on the
CPU and (TRITON_INTERPRET=1) in Triton's interpreter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from graphdiff.codegen import emit_triton, math_order, norm_order
from graphdiff.codegen.cut import cut_fragments
from graphdiff.codegen.emit_torch import Unsupported
from graphdiff.codegen.fragment import Fragment, ordered_points, rounding_points
from graphdiff.codegen.generate import load_scan_dir
from graphdiff.records import CalledSplice, LinearSplice, Manifest, Node
from graphdiff.replay.interpreter import RoundingInterpreter, fragment_graph
from graphdiff.runtime import load_generated, load_manifest

GRAD_RTOL = 2e-2  # BF16 storage of the forward values and (PyTorch path) of the gradients: ~2^-8 each

# FP32 output allowances, Triton path vs PyTorch path, by the Inductor ops a kernel runs (0 ulp otherwise: same
# functions). Each names its cause.
# In the interpreter (CPU): libdevice.exp is numpy's exp, the PyTorch path's torch.exp/F.silu ATen's vectorized
# expf; they differ in the last bits (2 ulp bound over the probes).
INTERPRETER_ULP = {"exp": (2, "exp: numpy's (the interpreter's libdevice.exp) vs ATen's vectorized expf")}
# On CUDA both call libdevice's rsqrtf/expf (0 ulp). Triton's `/`
# is div.full.f32 (approximate, within 2 ulp by the PTX ISA) where torch's kernels divide correctly rounded; an
# exact quotient (a power-of-two divisor, mean over 2^k) is the same in both. tl.sigmoid evaluates exp with
# ex2.approx; torch's sigmoid calls expf.
CUDA_ULP = {"truediv": (2, "division: Triton's `/` is div.full.f32 (approximate), torch's is correctly rounded"),
            "sigmoid": (4, "sigmoid: Triton's tl.sigmoid (ex2.approx) vs torch's (expf)")}
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
    ulp_limit: int = 0  # the FP32 allowance of this check
    cause: str = ""  # why it is not 0 (the functions the two paths compute differently)
    lanes: int = 0  # the row-sum order checked (a module's engine kernel's lanes; 0: ATen's)

    def as_dict(self) -> dict:
        return asdict(self)


def fragments(scan_dir: Path, manifest: Manifest | None = None) -> tuple[dict[str, Fragment], dict[str, Node]]:
    """The splice points exactly as `generate` cut them for this manifest (same regions, same boundaries; no
    manifest: every region of the scan)."""
    scan, train = load_scan_dir(scan_dir)
    graph = train.graphs[0]
    names = [r.name for r in manifest.regions] if manifest is not None else None
    frags = cut_fragments(math_order.with_math_regions(norm_order.with_order_regions(scan, graph), graph), graph,
                          names)
    return {f.key: f for f in frags}, graph.node_map()


def probes(frag: Fragment, nodes: dict[str, Node], seed: int = 0, device: str = "cpu",
           exact_sums: bool = False) -> list[torch.Tensor]:
    """BF16 random inputs of the fragment's shapes (symbolic sizes as 8), drawn on the CPU for every device.
    `exact_sums`: values k/32 with |k| < 2^p, p such that a row sum of squares of sums of two of them is exact
    in FP32 (at most 24 significant bits) whatever the order: the fragment's reductions then do not depend on
    how they are ordered."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [[s if isinstance(s, int) else 8 for s in nodes[i].shape or []] for i in frag.inputs]
    d = max([s[-1] for s in shapes if s] + [1])
    p = max(1, min(8, (24 - 2 - math.ceil(math.log2(d))) // 2))

    def draw(name: str, shape: list[int]) -> torch.Tensor:
        if nodes[name].dtype in INTEGERS:  # token ids, positions: 0 or 1, valid indices of any table
            return torch.randint(0, 2, shape, generator=gen, dtype=getattr(torch, str(nodes[name].dtype)))
        if not exact_sums:
            return torch.randn(shape, generator=gen).to(torch.bfloat16)
        return (torch.randint(1 - 2 ** p, 2 ** p, shape, generator=gen) / 32).to(torch.bfloat16)

    return [draw(i, s).to(device) for i, s in zip(frag.inputs, shapes)]


INTEGERS = frozenset({"int64", "int32", "int16", "int8", "uint8"})


def tolerance(frag: Fragment, nodes: dict[str, Node], device: str) -> tuple[int, str]:
    """The FP32 output allowance (ulp) of the Triton path against the PyTorch path, and its cause ("" for 0)."""
    table = CUDA_ULP if device.startswith("cuda") else INTERPRETER_ULP
    _, core = emit_triton.split(frag)
    worst, causes = 0, []
    for n in core:
        try:
            steps = emit_triton.forward_steps(n, nodes, len(nodes[n.name].shape or [1]) - 1)
        except Unsupported:
            continue
        consts = {s.var: s.value for s in steps if s.op == "constant" and s.value is not None}
        for s in steps:
            if s.op == "truediv" and s.args[1] in consts and math.frexp(consts[s.args[1]])[0] == 0.5:
                continue  # a power-of-two divisor: the quotient is exact in both
            if s.op in table:
                worst = max(worst, table[s.op][0])
                causes.append(table[s.op][1])
    return worst, "; ".join(sorted(set(causes)))


def replay(frag: Fragment, nodes: dict[str, Node], xs: list[torch.Tensor], align: frozenset[str],
           compute: torch.dtype = torch.float32, plan: bool = True, lanes: int = 0) -> list[torch.Tensor]:
    """The fragment's outputs under the plan (fragment.rounding_points and, in a module whose engine kernel sums
    in `lanes` lanes, ordered_points: what the generated code must do), FP32 (or `compute`) everywhere else."""
    rounded = rounding_points(frag, align) if plan else set()
    gm = fragment_graph(frag.nodes, frag.inputs, {})
    # an engine-only rounding of an FP32 trainer value rounds to BF16 (the engine's store)
    declared = {n.name: n.dtype if n.name not in frag.engine_sites else "bfloat16" for n in frag.nodes}
    interp = RoundingInterpreter(gm, declared, "fp32", rounded, compute,
                                 ordered=ordered_points(frag, align, lanes) if plan else None)
    interp.run(*xs)
    return [interp.values[o] for o in frag.outputs]


def _ulp(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    ulp = torch.finfo(torch.float32).eps * torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
    return float(((a - b).abs() / ulp).max()) if a.numel() else 0.0


def _float_leaf(x: torch.Tensor) -> torch.Tensor:
    """`x` as a leaf that collects a gradient; integer inputs (token ids) pass through as they are."""
    return x.requires_grad_() if x.is_floating_point() else x


def _differentiable(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x for x in xs if x.requires_grad]


def _grad_error(outs: list[torch.Tensor], xs: list[torch.Tensor], g64: tuple, weights: list[torch.Tensor]) -> float:
    g = torch.autograd.grad(torch.stack([(o.double() * w).sum() for o, w in zip(outs, weights)]).sum(),
                            _differentiable(xs), allow_unused=True, retain_graph=True)
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
        if isinstance(splice, LinearSplice) and not splice.problems:  # tensor parallelism: vs the recorded all-reduces

            checks += split_k_checks(scan_dir, gen, splice, device)
            continue
        if not isinstance(splice, CalledSplice) or splice.problems:  # a hook or an op of its own: nothing to replay
            continue
        frag = frags[splice.key]
        ulp_limit, cause = tolerance(frag, nodes, device)
        # no region aligned; its regions aligned, in each row-sum order its modules' engine kernels use
        runs: list[tuple[frozenset[str], int]] = [(frozenset(), 0)] + [
            (frozenset(splice.regions), n) for n in sorted({0, *splice.reduction_lanes.values()})]
        for align, lanes in runs:
            xs = [_float_leaf(x) for x in probes(frag, nodes, seed=1, device=device)]
            x64 = [_float_leaf(x.detach().double()) if x.is_floating_point() else x for x in xs]
            exact = replay(frag, nodes, x64, align, compute=torch.float64, plan=False)
            weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
                       .to(device) for o in exact]
            g64 = torch.autograd.grad(torch.stack([(o * w).sum() for o, w in zip(exact, weights)]).sum(),
                                      _differentiable(x64), allow_unused=True)

            with torch.no_grad():  # the plan replay reduces as the PyTorch path does: ATen's order, or `lanes`
                ref = replay(frag, nodes, [x.detach() for x in xs], align, lanes=lanes)
            ours = getattr(gen, splice.torch_fn)(*xs, align=align, lanes=lanes)
            same = all(torch.equal(o.float(), r.float()) for o, r in zip(ours, ref))
            err = _grad_error(list(ours), xs, g64, weights)
            checks.append(Check(splice.key, "torch", bool(align), same,
                                max(_ulp(o, r) for o, r in zip(ours, ref)), err, same and err < GRAD_RTOL,
                                lanes=lanes))
            if not (triton and splice.triton_fn) or lanes:  # on exact-sum probes every order sums alike
                continue
            xt = probes(frag, nodes, seed=3, device=device, exact_sums=True)
            with torch.no_grad():
                ref = getattr(gen, splice.torch_fn)(*xt, align=align)
                tri = getattr(gen, splice.triton_fn)(*xt, align=align)
            same = all(r.dtype == t.dtype and r.shape == t.shape and torch.equal(r, t) for r, t in zip(ref, tri))
            ulp = max(_ulp(r, t) for r, t in zip(ref, tri))
            # an FP32 output may differ within its allowance; a BF16 store must match
            close = all(torch.equal(r, t) or r.dtype == torch.float32 for r, t in zip(ref, tri))
            err = _grad_error(list(getattr(gen, splice.triton_fn)(*xs, align=align)), xs, g64, weights)
            checks.append(Check(splice.key, "triton", bool(align), same, ulp, err,
                                close and ulp <= ulp_limit and err < GRAD_RTOL, ulp_limit, cause))
    return checks


def split_k_checks(scan_dir: Path, gen: Any, splice: LinearSplice, device: str = "cpu") -> list[Check]:
    """The generated split-K linear against the engine's own all-reduce outputs recorded by the scan (every rank's
    matmul input concatenated along K is the trainer's input; the weight from the checkpoint): bit for bit."""
    from graphdiff.analysis.tensor_parallel import rank_of
    from graphdiff.artifacts import ScanDir
    from graphdiff.capture.collectives import allreduces
    from graphdiff.engines.store import checkpoint_tensor
    from graphdiff.runtime import module_regex

    d = ScanDir(scan_dir)
    if not d.engine_capture.is_file():
        return []
    # the checkpoint the trainer side read here (an engine capture made elsewhere names that machine's path)
    model = Path(d.load_train().model) if d.train_capture.is_file() else None
    cap, buffers = d.load_engine(model if model is not None and model.is_dir() else None)
    model = model if model is not None and model.is_dir() else Path(cap.model)
    records = buffers.get(cap.shapes[0].label if cap.shapes else next(iter(buffers), ""), {})
    ranks: dict[int, list] = {}
    for g in cap.graphs:
        ranks.setdefault(rank_of(g), []).extend(allreduces(g))
    nodes = {g.name: g.node_map() for g in cap.graphs}
    pattern, fn = module_regex(splice.module), getattr(gen, splice.torch_fn)
    checks = []
    for group in zip(*(ranks[r] for r in sorted(ranks))):
        module = nodes[group[0].graph][group[0].buffer].module or ""
        recs = [ext for a in group if (rec := records.get(a.kernel)) and (ext := rec.get("extern"))]
        inputs = [m for r in recs if (m := r.get("matmul_input")) is not None]
        if not group[0].matmul or not pattern.match(module) or len(inputs) != len(group):
            continue
        weight = checkpoint_tensor(model, f"{module}.weight")
        if weight is None or len(recs) != splice.shards:
            continue
        x = torch.cat(inputs, dim=-1).to(device)
        ours = fn(SimpleNamespace(weight=weight.to(device), bias=None), x, splice.shards).cpu()
        same = torch.equal(ours, recs[0]["reduced"])
        diff = (ours.float() - recs[0]["reduced"].float()).abs().max()
        checks.append(Check(f"{splice.key} ({module}, recorded all-reduce)", "torch", True, same,
                            float(diff / torch.finfo(torch.bfloat16).eps), 0.0, same))
    return checks
