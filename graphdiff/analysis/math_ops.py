"""Trainer ops that part from the engine by their math library alone, with no rounding site.

Inductor lowers GELU to `0.5 * x * (1 + erf(x / sqrt(2)))` and computes erf, tanh, exp, cos, ... with its own
vectorized math (`replay.inductor_math`); eager runs ATen's kernels. Both sides read the same input and round the
result once, in the same place, so the scan finds no site, yet a last-bit difference in FP32 flips some BF16 outputs
(GPT-NeoX's MLP GELU: 0.28% of elements) and everything downstream departs from there. Each matched trainer op of
`MATH_OPS` whose engine value an Inductor-generated kernel computes is evaluated on the engine's own value of its
input, eagerly and as Inductor's one-op function: where eager differs from the engine's value and Inductor's form
equals it on every element, the op is recorded (`ScanResult.inductor_math`; `codegen.math_order` makes a region
of it).
"""

from __future__ import annotations

import torch

from graphdiff.analysis.match import Match
from graphdiff.ops import op_name
from graphdiff.records import Graph, KernelEvidence, KernelRecord, Node
from graphdiff.replay.inductor_math import GELU_FORMS, inductor_math, math_form
from graphdiff.replay.kernel_fragment import value_base

LAYOUT_GUESS = 0.5  # more differing elements than this: the two values are not laid out alike


def math_differences(tgraph: Graph, matched: dict[str, tuple[list[Match], list[str]]], engine_graphs: list[Graph],
                     engine_values: dict[str, dict], records: dict[str, KernelRecord],
                     replay: list[KernelEvidence], every_shape: list[KernelEvidence] | None = None
                     ) -> dict[str, list[str]]:
    """HF module -> its trainer nodes (`MATH_OPS`) whose engine value, computed in an Inductor-generated kernel,
    equals Inductor's form of the op on the engine's input and not ATen's eager op. `matched` and `engine_values` are
    per engine graph; `records`, the kernels' recorded calls (kernel id -> buffers) at the shape `replay` (their
    evidence: which node each stored buffer holds) replayed, give the engine's values as it stored them (not as the
    replay predicts them, which computes with Inductor's math itself). A value the kernel holds in FP32 and does not
    store (a rotary embedding's cos) is judged by its kernel's replays (`every_shape`, default `replay`): bit-exact as
    predicted and not with ATen's math (`KernelEvidence.aten_math_bitexact`) at some shape (OLMo 2's cos departs
    from ATen's only at positions past the first few)."""
    nodes = tgraph.node_map()
    evidence: dict[str, list[KernelEvidence]] = {}
    for r in every_shape if every_shape is not None else replay:
        evidence.setdefault(r.kernel, []).append(r)
    found: dict[str, list[str]] = {}
    for g in engine_graphs:
        kinds = {k.id: k.kind for k in g.kernels}
        kernel_of = {n.name: n.kernel for n in g.nodes if n.kernel and kinds.get(n.kernel) == "generated"}
        engine_of = {m.train: m.engine for m in matched.get(g.name, ([], []))[0]}
        values = engine_values.get(g.name, {})
        stored = _stored(g, records, {r.kernel: r.outputs for r in replay})
        for n in tgraph.nodes:
            form = math_form(op_name(n.target), n.call[1] if n.call else {}) if n.op == "call_function" else None
            twin = engine_of.get(n.name, "")
            if form is None or twin not in kernel_of or not n.module or not n.inputs:
                continue
            if twin in stored:
                x = _engine_input(nodes, n.inputs[0], engine_of, values)
                hit = x is not None and _inductor_only(n, nodes[n.inputs[0]], form, x, stored[twin])
            else:
                hit = any(_replayed_with_inductor_math(e) for e in evidence.get(kernel_of[twin], []))
            if hit and n.name not in found.setdefault(n.module, []):
                found[n.module].append(n.name)
    return {m: v for m, v in sorted(found.items()) if v}


def _replayed_with_inductor_math(e: KernelEvidence) -> bool:
    """Does the kernel's replay reproduce its stores with Inductor's math and not with ATen's?"""
    return e.predicted_bitexact == 1.0 and e.aten_math_bitexact is not None \
        and e.aten_math_bitexact < 1.0


def _stored(graph: Graph, records: dict[str, KernelRecord], outputs: dict[str, dict[str, str]]
            ) -> dict[str, torch.Tensor]:
    """Engine node -> the value a generated kernel of `graph` stored for it, as recorded: the node its replay found
    in the buffer (`outputs`: kernel -> buffer -> node), else the one the capture names."""
    out = {}
    for k in graph.kernels:
        record = records.get(k.id) if k.kind == "generated" else None
        written: dict = dict(record.get("out", {})) if record else {}
        held = {**{a.name: a.node for a in k.args if a.role in ("out", "inout") and a.node}, **outputs.get(k.id, {})}
        out.update({node: written[buf] for buf, node in held.items() if isinstance(written.get(buf), torch.Tensor)})
    return out


def _engine_input(nodes: dict[str, Node], name: str, engine_of: dict[str, str],
                  values: dict) -> torch.Tensor | None:
    """The engine's value of trainer value `name`: its own match, or that of the node it views or casts."""
    base = value_base(nodes, name)
    for candidate in (name, base.name if base is not None else ""):
        v = values.get(engine_of.get(candidate, ""))
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    return None


def _inductor_only(n: Node, src: Node, form: str, x: torch.Tensor, e: object) -> bool:
    """On the engine's input `x`: does Inductor's form of `n` give the engine's value `e` on every element while
    ATen's eager op, in the trainer's dtypes, differs on some?"""
    if not isinstance(e, torch.Tensor) or not e.is_floating_point() or e.numel() != x.numel() or not src.dtype \
            or not n.dtype:
        return False
    low_in, out = getattr(torch, src.dtype), getattr(torch, n.dtype)
    with torch.no_grad():
        xin = x.detach().reshape(-1).to(low_in)
        eager = (torch.nn.functional.gelu(xin, approximate=GELU_FORMS[form]) if form in GELU_FORMS
                 else getattr(torch, form)(xin)).to(out)
        ours = inductor_math(form, xin.float()).to(out)
        theirs = e.detach().reshape(-1).to(out)
        differs = float((eager != theirs).float().mean())
    return 0 < differs < LAYOUT_GUESS and torch.equal(ours, theirs)
