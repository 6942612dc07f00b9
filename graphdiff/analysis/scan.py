"""Both sides captured -> rounding (replay-verified) -> match -> plan -> sites: the scan result.

Plain functions over the data model. `analyze` is the part after both sides have run (what the
analysis-time benchmark measures); `graphdiff.pipeline.scan` adds resolving the model and running both sides.

Shapes: the trainer is traced on the first recorded shape's prompt, where values are matched across the
two graphs. The engine's graph is one program for every shape (a dynamic token count), so those matches
hold at every shape; at each further shape every kernel is replayed on that shape's real buffers and
every decision re-made from the engine's rounding there. A decision that differs at some shape is kept
per shape (`Decision.shapes`), and a site says at which shapes it exists.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphdiff.analysis import tensor_parallel as tp
from graphdiff.analysis.departure import first_departure
from graphdiff.analysis.kinds import classify
from graphdiff.analysis.match import Match, align_module_roots
from graphdiff.analysis.math_ops import math_differences
from graphdiff.analysis.moe import (
    addmm_biases,
    addmm_folds,
    engine_experts_op,
    experts_decisions,
    experts_nodes,
    routing_agreement,
)
from graphdiff.analysis.opaque import attention_decisions, engine_device, engine_rule, unregistered_why
from graphdiff.analysis.plan import decide, merge_decisions, stable_ids
from graphdiff.analysis.reads import mark_reads
from graphdiff.analysis.regions import group_regions
from graphdiff.analysis.rounding import EngineRounding, eager_values, engine_rounding, train_rounding
from graphdiff.analysis.sites import sites_of
from graphdiff.analysis.uniformity import site_nonuniformity
from graphdiff.capture.routing import engine_routing
from graphdiff.ops import is_attention, is_low, op_name
from graphdiff.records import (
    Buffers,
    Capture,
    Decision,
    Graph,
    KernelEvidence,
    Node,
    RegionKind,
    RoutingAgreement,
    ScanResult,
    Site,
)
from graphdiff.replay.kernel_fragment import value_base
from graphdiff.replay.reload import stored_alone
from graphdiff.replay.sum_order import cpp_rereads_store, cpp_sum_lanes_each, is_row_norm, is_row_reduction
from graphdiff.runtime import module_regex

PROVEN = 0.999  # a kernel whose predicted replay is below this is unexplained: its sites are unproven


def prompt_tokens(config: dict, n: int, seed: int = 0) -> list[int]:
    """A seeded test prompt within the model's vocabulary."""
    vocab = int(config.get("vocab_size", 1000))
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, min(vocab, 32000), (n,), generator=gen).tolist()


def config_sha256(config: dict) -> str:
    keep = {k: v for k, v in config.items() if k not in ("transformers_version", "_name_or_path")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


@dataclass
class TrainSide:
    capture: Capture
    values: dict[str, Any]
    changed: dict[str, float]  # computing low-precision node -> fraction of elements eager's store changes
    gm: Any = None  # the executable eager graph (re-runs ops in FP32 for the statistics)
    fp32: dict[str, Any] | None = None  # each rounding node's FP32 result before it was rounded


def run_train_side(model_dir: Path, prompt: list[int], manifest: Path | None = None,
                   allow_version_mismatch: bool = False) -> TrainSide:
    from graphdiff.capture.hf import capture_hf

    cap, live = capture_hf(model_dir, input_ids=prompt, manifest=manifest,
                           allow_version_mismatch=allow_version_mismatch)
    values = eager_values(live.graph_module, live.inputs)
    fp32: dict[str, Any] = {}
    changed = train_rounding(live.graph_module, values, fp32)
    return TrainSide(cap, values, changed, live.graph_module, fp32)


def scanned_config_of(config: dict) -> dict:
    """What the patch's runtime compares a trainer's config with (transformers-normalized, run settings out)."""
    from transformers import AutoConfig

    from graphdiff.runtime import scanned_config

    rest = dict(config)
    return scanned_config(AutoConfig.for_model(rest.pop("model_type"), **rest))


# --- analysis ------------------------------------------------------------------------------------------------

def _evidence(er: EngineRounding, shape: str) -> list[KernelEvidence]:
    """Each kernel's replay at `shape`, its fractions rounded to 6 digits as scan.json keeps them."""
    return [r.model_copy(update=dict(
        shape=shape, predicted_bitexact=round(r.predicted_bitexact, 6), naive_bitexact=round(r.naive_bitexact, 6),
        per_output={b: (round(p, 6), round(n, 6)) for b, (p, n) in r.per_output.items()},
        aten_order_bitexact=round(r.aten_order_bitexact, 6) if r.aten_order_bitexact is not None else None))
        for r in er.replays]


def _signature(d: Decision) -> tuple:
    e = d.engine
    return d.rule, d.site, d.train.rounds, d.train.on_grid, e.rounds if e else None, e.on_grid if e else None


def _merge_shapes(reference: list[Decision], others: dict[str, list[Decision]], ref_label: str) -> list[Decision]:
    """One entry per trainer value with the shapes it holds at; a value decided otherwise at some shape gets
    an entry of its own for those shapes (its site flag, states and evidence there)."""
    out: list[Decision] = []
    by_node = {label: {d.node: d for d in ds} for label, ds in others.items()}
    for d in reference:
        variants: list[tuple[Decision, list[str]]] = [(d, [ref_label])]
        for label, decided in by_node.items():
            other = decided.get(d.node)
            if other is None:
                continue
            same = next((v for v in variants if _signature(v[0]) == _signature(other)), None)
            if same is not None:
                same[1].append(label)
            else:
                variants.append((other, [label]))
        for v, labels in variants:
            v.shapes = labels
            out.append(v)
    return out


def _site_shapes(plan: list[Decision]) -> dict[str, list[str]]:
    shapes: dict[str, list[str]] = {}
    for d in plan:
        if d.site:
            shapes.setdefault(d.id, []).extend(d.shapes)
    return shapes


def _site_plan(plan: list[Decision]) -> list[Decision]:
    """One decision per site id (the first where it is a site), for the site list."""
    seen: set[str] = set()
    out = []
    for d in plan:
        if d.site and d.id not in seen:
            seen.add(d.id)
            out.append(d)
    return out


def _proof(sites: list[Site], plan: list[Decision], replay: list[KernelEvidence],
           graphs: list[Graph], engine: dict[str, str] | None = None) -> tuple[list[str], list[str], list[str]]:
    """Mark unproven sites; returns (kernels not replayed, kernels replaying below PROVEN, unregistered externs).
    Externs are looked up by the engine's facts (`engine`: Capture.attention; device, ops build, flags)."""
    engine = engine or {}
    not_replayed = [f"{r.kernel} @ {r.shape}: {r.error}" for r in replay if r.error]
    bad = {r.kernel for r in replay if r.error or r.predicted_bitexact < PROVEN}
    unexplained = sorted({f"{r.kernel} ({min(x.predicted_bitexact for x in replay if x.kernel == r.kernel):.2%})"
                          for r in replay if not r.error and r.predicted_bitexact < PROVEN})
    externs = {k.id: k for g in graphs for k in g.kernels if k.kind == "extern"}
    unregistered = sorted({k.name for k in externs.values() if engine_rule(k.name, engine) is None})
    kernel_of = {d.id: d.evidence.kernel for d in plan if d.site}
    for s in sites:
        k = kernel_of.get(s.id, "")
        if k in bad:
            s.proven, s.unproven = False, f"its engine side is computed in {k.split(':')[0]}, which does not replay " \
                                          "bit-exactly under the rounding model"
        elif k in externs and engine_rule(externs[k].name, engine) is None:
            s.proven, s.unproven = False, f"its engine side comes from {externs[k].name}, an opaque op no registry " \
                                          f"entry describes: {unregistered_why(externs[k].name, engine)}"
    return not_replayed, unexplained, unregistered


def _site_engine_values(sites: list[Site], graphs: list[Graph], values: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Each engine-side site's engine value, taken from the graph whose kernel computes it (node names repeat
    across a piecewise engine's graphs)."""
    graph_of = {k.id: g.name for g in graphs for k in g.kernels}
    out = {}
    for s in sites:
        if s.rounded_on == "engine" and s.engine and s.engine.node:
            where = graph_of.get(s.engine.kernel or "")
            v = values.get(where, {}).get(s.engine.node) if where else next(
                (vs[s.engine.node] for vs in values.values() if s.engine.node in vs), None)
            if v is not None:
                out[s.engine.node] = v
    return out


def _reference_decisions(engine_cap: Capture, buffers: Buffers, train: TrainSide, ref: str,
                         timings: dict[str, float]) -> tuple[list[list[Decision]], dict[str, tuple], list, dict]:
    """Full analysis at the reference shape: replay, match, decide, per engine graph."""
    tgraph = train.capture.graphs[0]
    per_graph, matched, replay, engine_values = [], {}, [], {}
    for egraph in (g for g in engine_cap.graphs if ref in g.shapes or not g.shapes):
        t = time.perf_counter()
        er = engine_rounding(egraph, buffers.get(ref, {}))
        timings["replay_s"] = timings.get("replay_s", 0.0) + time.perf_counter() - t
        replay += _evidence(er, ref)
        t = time.perf_counter()
        matches, unmatched = tp.match_values(tgraph, train.values, egraph, er.values, tp.tp_size(engine_cap))
        timings["match_s"] = timings.get("match_s", 0.0) + time.perf_counter() - t
        matched[egraph.name] = (matches, unmatched)
        per_graph.append(decide(tgraph, train.values, train.changed, egraph, er, matches, unmatched,
                                device=engine_device(engine_cap.attention)))
        engine_values[egraph.name] = er.values  # node names repeat across a piecewise engine's graphs
    return per_graph, matched, replay, engine_values


def _shape_decisions(engine_cap: Capture, buffers: Buffers, train: TrainSide, label: str,
                     matched: dict[str, tuple[list[Match], list[str]]]) -> tuple[list[list[Decision]], list]:
    """At a further shape: every kernel replayed on that shape's buffers, decisions re-made with the reference
    matches (same graph, same nodes)."""
    tgraph = train.capture.graphs[0]
    per_graph, replay = [], []
    for egraph in (g for g in engine_cap.graphs if label in g.shapes):
        er = engine_rounding(egraph, buffers.get(label, {}))
        replay += _evidence(er, label)
        matches, unmatched = matched.get(egraph.name, ([], []))
        per_graph.append(decide(tgraph, train.values, train.changed, egraph, er, matches, unmatched,
                                device=engine_device(engine_cap.attention)))
    return per_graph, replay


def _sites_and_regions(plan: list[Decision], tgraph: Graph, engine_cap: Capture,
                       labels: list[str]) -> tuple[list[Site], list]:
    """The plan's sites (with the shapes they exist at) grouped into regions; each site decision gets its region."""
    site_decisions = _site_plan(plan)
    sites = sites_of(site_decisions, tgraph, engine_cap.graphs)
    where = _site_shapes(plan)
    for s in sites:
        s.shapes = [label for label in labels if label in where.get(s.id, [])]
    experts = experts_nodes(tgraph)
    attention: tuple[RegionKind, str] = ("attention", "inside the engine's opaque attention op (registry)")
    kinds = {d.id: tp.region_kind(d) or (attention if is_attention(d.op) else classify(tgraph, d.node, experts))
             for d in site_decisions}
    owner = {d.id: d.evidence.stretch[0] for d in site_decisions if d.rule == "opaque-registry" and d.node in experts}
    regions = group_regions(sites, kinds, owner)
    by_id = {s.id: s for s in sites}
    for d in plan:  # codegen reads a site's region from the plan
        if d.site and d.id in by_id:
            d.region, d.kind = by_id[d.id].region, by_id[d.id].kind
    return sites, regions


def _mark_regions(regions: list, sites: list[Site], labels: list[str], replay: list[KernelEvidence], tgraph: Graph,
                  engine_graphs: list[Graph], matched: dict[str, tuple[list[Match], list[str]]]) -> dict[str, int]:
    """Each region's shapes and proof, and the lanes its modules' engine kernels sum rows in: its sites' kernels',
    and for the other layers its splice serves, the order the engine sums those modules' rows in (by value
    matches, `ordered_sums`, else by module name). Returns them (ScanResult.ordered_sums): a module no value match
    pairs (the final norm, reading the engine's FP32 residual) is ordered by name too."""
    by_id = {s.id: s for s in sites}
    lanes = kernel_lanes(replay)
    ordered = {**lanes_by_module_name(tgraph, engine_graphs, lanes),
               **ordered_sums(tgraph, matched, engine_graphs, lanes)}
    for r in regions:
        members = [by_id[i] for i in r.sites]
        r.shapes = [label for label in labels if any(label in s.shapes for s in members)]
        r.shape_dependent = any(s.shapes != labels for s in members)
        r.proven = all(s.proven for s in members)
        served = module_regex(r.module) if r.module else None
        r.reduction_lanes = {**{m: n for m, n in ordered.items() if served and served.match(m)},
                             **module_lanes(members, lanes)}
    return ordered


def kernel_lanes(replay: list[KernelEvidence]) -> dict[str, int]:
    """Kernel -> the lanes its rows are summed in, where every shape's replay read the same order from its code
    and no replay did better in ATen's order."""
    seen: dict[str, set[int]] = {}
    for e in replay:
        seen.setdefault(e.kernel, set()).add(e.reduction_lanes)
    return {k: next(iter(v)) for k, v in seen.items() if len(v) == 1 and next(iter(v)) > 0}


def ordered_sums(tgraph: Graph, matched: dict[str, tuple[list[Match], list[str]]], engine_graphs: list[Graph],
                 lanes: dict[str, int]) -> dict[str, int]:
    """HF module -> the lanes its engine kernels sum its row reductions in, for modules whose matched row
    reductions (`replay.sum_order.is_row_reduction`) all sit in kernels of one lane order (`kernel_lanes`)."""
    nodes = tgraph.node_map()
    kernel_of = {(g.name, n.name): n.kernel or "" for g in engine_graphs for n in g.nodes}
    each = _reduction_lanes(engine_graphs)
    own = _kernel_reduction(engine_graphs)
    found: dict[str, set[int]] = {}
    for g, (ms, _) in matched.items():
        for m in ms:
            n = nodes.get(m.train)
            if n is not None and n.module and is_row_reduction(n, nodes):
                kernel = kernel_of.get((g, m.engine), "")
                engine = m.engine if (g, m.engine) in each else own.get((g, m.engine), m.engine)
                found.setdefault(n.module, set()).add(lanes.get(kernel) or each.get((g, engine), 0))
    for module, count in _layer_norm_lanes(tgraph, engine_graphs, lanes).items():
        found.setdefault(module, set()).add(count)
    return {m: next(iter(v)) for m, v in sorted(found.items()) if len(v) == 1 and next(iter(v)) > 0}


def lanes_by_module_name(tgraph: Graph, engine_graphs: list[Graph], lanes: dict[str, int]) -> dict[str, int]:
    """HF module -> the lanes the engine sums the rows of its module of the same name in (vLLM names its norms as HF
    does), for modules with row reductions on both sides. It stands where no value match pairs the two: the
    engine's FP32 residual makes the unpatched trainer's sums other values, so a norm after the first layer goes
    unmatched while its region's splice serves it too."""
    tnodes, each = tgraph.node_map(), _reduction_lanes(engine_graphs)
    with_rows = {n.module for n in tgraph.nodes if n.module and is_row_reduction(n, tnodes)}
    found: dict[str, set[int]] = {}
    for g in engine_graphs:
        for n in g.nodes:
            if n.module in with_rows and n.kernel and n.target.endswith((".mean.dim", ".sum.dim_IntList")):
                found.setdefault(n.module, set()).add(each.get((g.name, n.name)) or lanes.get(n.kernel, 0))
    return {m: next(iter(v)) for m, v in found.items() if len(v) == 1 and next(iter(v)) > 0}


def rope_table_dtype(engine_graphs: list[Graph]) -> str:
    """The dtype of a low-precision parameter the engine's rotary embedding gathers rows of by position (vLLM's
    `cos_sin_cache`, stored in the model's dtype), or "". A trainer whose rotary module returns cos/sin in FP32
    (HF's ERNIE 4.5: "full precision") then differs by that rounding, which no trainer op marks."""
    for g in engine_graphs:
        nodes = g.node_map()
        for n in g.nodes:
            table = nodes.get(n.inputs[0]) if n.inputs else None
            if (op_name(n.target) in ("index_select", "index") and "rotary" in (n.module or "") and table is not None
                    and table.op == "placeholder" and table.param and is_low(table.dtype)):
                return table.dtype or ""
    return ""


def _kernel_reduction(engine_graphs: list[Graph]) -> dict[tuple[str, str], str]:
    """(engine graph, node) -> the one row mean/sum its kernel computes for the node's module. A trainer mean may be
    matched to the value beside the engine's (`mean + eps`: the same values within the matcher's tolerance); its
    lanes are that reduction's."""
    found: dict[tuple[str, str], str] = {}
    for g in engine_graphs:
        reductions: dict[tuple[str, str], list[str]] = {}
        for n in g.nodes:
            if n.kernel and n.target.endswith((".mean.dim", ".sum.dim_IntList")):
                reductions.setdefault((n.kernel, n.module or ""), []).append(n.name)
        for n in g.nodes:
            same = reductions.get((n.kernel or "", n.module or ""), [])
            if n.kernel and len(same) == 1:
                found[(g.name, n.name)] = same[0]
    return found


def _reduction_lanes(engine_graphs: list[Graph]) -> dict[tuple[str, str], int]:
    """(engine graph, row-reduction node) -> the lanes of its accumulator, for kernels whose sums differ in lanes
    (two norms fused in one kernel): the kernel's sum accumulators in code order pair with its mean/sum nodes in
    graph order where they are as many."""
    found: dict[tuple[str, str], int] = {}
    for g in engine_graphs:
        code = {k.id: k.code for k in g.kernels if k.kind == "generated"}
        reductions: dict[str, list[str]] = {}
        for n in g.nodes:
            if n.kernel in code and n.target.endswith((".mean.dim", ".sum.dim_IntList")):
                reductions.setdefault(n.kernel, []).append(n.name)
        for kernel, names in reductions.items():
            each = cpp_sum_lanes_each(code[kernel])
            if len(each) == len(names):
                found.update({(g.name, name): lanes for name, lanes in zip(names, each)})
    return found


def residual_sums(tgraph: Graph, matched: dict[str, tuple[list[Match], list[str]]], engine_graphs: list[Graph],
                  plan: list[Decision]) -> tuple[list[str], list[str]]:
    """Trainer adds whose sum the engine keeps in BF16, as (rounded, stored): `rounded`, the engine rounds the sum
    (its state at the match: stored in BF16, read back by every consumer); `stored`, one kernel computes it in FP32
    for its own readers (a norm) and stores it in BF16 for the kernels after it, which load that copy (Inductor
    realizes a residual sum it otherwise recomputes in each consumer). Only where the engine's add sums the same
    operands (both sides' matches): vLLM's Cohere sums `residual + (attn + mlp)`, HF `(residual + attn) + mlp`."""
    rounds = {d.node for d in plan if d.engine is not None and d.engine.rounds and d.rule == "matched"}
    tnodes = tgraph.node_map()
    rounded, stored = [], []
    for g in engine_graphs:
        nodes, users, computed_in = g.node_map(), g.users(), g.computed_in()
        by_train = {m.train: m.engine for m in matched.get(g.name, ([], []))[0]}
        for t_name, e_name in by_train.items():
            t, e = tnodes.get(t_name), value_base(nodes, e_name)
            if t is None or e is None or op_name(t.target) != "add" or op_name(e.target) != "add" or \
                    not is_low(e.dtype) or not _same_operands(t, e, tnodes, nodes, by_train):
                continue
            if t_name in rounds:
                rounded.append(t_name)
            elif len(own := computed_in.get(e.name, set())) == 1 and \
                    any(computed_in.get(u) and not computed_in[u] & own for u in users.get(e.name, [])):
                stored.append(t_name)
    return rounded, stored


def _same_operands(t: Node, e: Node, tnodes: dict[str, Node], enodes: dict[str, Node],
                   by_train: dict[str, str]) -> bool:
    """Does the engine's add `e` sum what the trainer's add `t` sums: every matched operand of `t` an operand of `e`,
    and at least one matched?"""
    operands = {b.name for i in e.inputs if (b := value_base(enodes, i)) is not None}
    seen = 0
    for i in t.inputs:
        tb = value_base(tnodes, i)
        m = by_train.get(tb.name) if tb is not None else None
        eb = value_base(enodes, m) if m else None
        if eb is None:
            continue
        if eb.name not in operands:
            return False
        seen += 1
    return seen > 0


def norm_rereads(tgraph: Graph, engine_graphs: list[Graph],
                 matched: dict[str, tuple[list[Match], list[str]]] | None = None) -> list[str]:
    """The trainer norms (HF modules) whose engine kernel reads its input back from the BF16 copy it stored: layer
    norms (not those reading every pass from a copy stored alone, `norm_reads_stored`), and RMS norms whose matched
    row mean the engine takes of a sum its kernel stores (`_rms_rereads`)."""
    kernels = {k.id: k for g in engine_graphs for k in g.kernels}
    layer_norms = [m for m, k in _first_norms(_layer_norm_pairs(tgraph, engine_graphs), True) if k in kernels
                   and cpp_rereads_store(kernels[k].code) and not stored_alone(kernels[k])]
    rms = _rms_rereads(tgraph, engine_graphs, matched or {})
    return [*layer_norms, *(m for m, alone in rms if not alone and m not in layer_norms)]


def _first_norms(pairs: list[tuple[str, str]], first: bool) -> list[tuple[str, str]]:
    """The (HF module, kernel) pairs of the first layer norm of each kernel (`first`), or of its later ones: a kernel
    that normalizes one stored input twice (Falcon's `ln_attn` and `ln_mlp`) takes the first mean in the loop that
    stores the input, from the FP32 value; each later norm's mean in a loop after it, from the stored copy."""
    seen: set[str] = set()
    out = []
    for m, k in pairs:
        if (k not in seen) == first:
            out.append((m, k))
        seen.add(k)
    return out


def norm_reads_stored(tgraph: Graph, engine_graphs: list[Graph],
                      matched: dict[str, tuple[list[Match], list[str]]] | None = None) -> list[str]:
    """The trainer norms (HF modules) whose engine kernel stores its input in BF16 in a loop nest that computes
    nothing else and reads it back in every pass (`reload.stored_alone`: layer norms, and RMS norms whose matched
    row mean is of such a store, Granite's last layer), or whose kernel normalizes the stored input after another
    norm of it (`_first_norms`): the norm, its mean too, reads the rounded input."""
    kernels = {k.id: k for g in engine_graphs for k in g.kernels if k.kind == "generated"}
    pairs = _layer_norm_pairs(tgraph, engine_graphs)
    later = {m for m, k in _first_norms(pairs, False) if k in kernels and cpp_rereads_store(kernels[k].code)}
    layer_norms = [m for m, k in pairs if k in kernels and (stored_alone(kernels[k]) or m in later)]
    rms = _rms_rereads(tgraph, engine_graphs, matched or {})
    return [*layer_norms, *(m for m, alone in rms if alone and m not in layer_norms)]


def _rms_rereads(tgraph: Graph, engine_graphs: list[Graph], matched: dict[str, tuple[list[Match], list[str]]]
                 ) -> list[tuple[str, bool]]:
    """(HF module, its mean reads the store too) for each HF module whose first row mean (an RMS norm's
    `x.pow(2).mean(-1)`, a written-out layer norm's `x.mean(-1)`) is matched to an engine mean of a value (or its
    square) that the same kernel stores in BF16 and reads back in its later loops (a residual sum Inductor realizes
    in the norm's kernel: Granite's second layer, Cohere's last): that mean reads the FP32 sum and the rest of the
    norm the rounded copy, unless the sum is stored in a loop nest of its own (`stored_alone`: Granite's last
    layer), where the mean reads the rounded copy too."""
    nodes = tgraph.node_map()
    graphs = {g.name: g for g in engine_graphs}
    found: dict[str, bool] = {}  # HF module -> its mean reads the store too, in the order first matched
    for gname, (ms, _) in matched.items():
        g = graphs.get(gname)
        if g is None:
            continue
        enodes = g.node_map()
        kernels = {k.id: k for k in g.kernels if k.kind == "generated"}
        for m in ms:
            n, e = nodes.get(m.train), enodes.get(m.engine)
            if (n is None or e is None or not n.module or n.module in found or op_name(n.target) != "mean"
                    or not is_row_reduction(n, nodes) or e.kernel not in kernels or not e.inputs):
                continue
            operand = enodes.get(e.inputs[0])
            if operand is not None and op_name(operand.target) == "pow" and operand.inputs:
                operand = enodes.get(operand.inputs[0])
            base = value_base(enodes, operand.name) if operand is not None else None
            kernel = kernels[e.kernel]
            stored = {a.node for a in kernel.args if a.role in ("out", "inout") and is_low(a.dtype)}
            if base is not None and base.name in stored and cpp_rereads_store(kernel.code):
                found[n.module] = base.name in stored_alone(kernel)
    return list(found.items())


def _layer_norm_pairs(tgraph: Graph, engine_graphs: list[Graph]) -> list[tuple[str, str]]:
    """(HF module, engine kernel) per trainer layer norm. A trainer layer norm is one ATen op whose output the matcher
    does not pair, so its kernel is found by position: the engine kernels holding a `var_mean` (its decomposed layer
    norm), in graph order, pair with the trainer's layer norms in graph order; [] unless they are as many."""
    modules = [n.module for n in tgraph.nodes if n.module and is_row_norm(n)]
    kernels = _layer_norm_kernels(engine_graphs)
    return list(zip(modules, kernels)) if len(modules) == len(kernels) else []


def _layer_norm_kernels(engine_graphs: list[Graph]) -> list[str]:
    """The engine kernel of each `var_mean` (a decomposed layer norm), in graph order: a kernel computing two norms
    of one input (Falcon's `ln_attn` and `ln_mlp`) is there twice."""
    return [n.kernel for g in engine_graphs for n in g.nodes if n.kernel and ".var_mean." in n.target]


def _layer_norm_lanes(tgraph: Graph, engine_graphs: list[Graph], lanes: dict[str, int]) -> dict[str, int]:
    """HF module -> the lanes of the engine kernel computing its layer norm (`_layer_norm_pairs`); where the kernels
    and the layer norms are not as many, every layer norm gets the kernels' lanes only where all of them agree."""
    pairs = _layer_norm_pairs(tgraph, engine_graphs)
    if pairs:
        return {m: lanes.get(k, 0) for m, k in pairs}
    modules = [n.module for n in tgraph.nodes if n.module and is_row_norm(n)]
    found = {lanes.get(k, 0) for k in _layer_norm_kernels(engine_graphs)}
    return {m: next(iter(found)) for m in modules} if len(found) == 1 else {}


def module_lanes(members: list[Site], lanes: dict[str, int]) -> dict[str, int]:
    """HF module -> its sites' engine kernel's lanes, for modules whose sites all sit in kernels of one order."""
    found: dict[str, set[int]] = {}
    for s in members:
        if s.train.module and s.engine is not None:
            found.setdefault(s.train.module, set()).add(lanes.get(s.engine.kernel or "", 0))
    return {m: next(iter(v)) for m, v in sorted(found.items()) if len(v) == 1 and next(iter(v)) > 0}


def _opaque_decisions(engine_cap: Capture, train: TrainSide, notes: list[str]) -> list[Decision]:
    """Decisions for values the engine computes inside opaque ops: its attention, its MoE experts (registry).
    Appends what the attention analysis notes to `notes`."""
    tgraph = train.capture.graphs[0]
    ids = stable_ids(tgraph)
    attn, attn_notes = attention_decisions(engine_cap.attention, tgraph, train.gm, train.values,
                                           tp.primary_graphs(engine_cap.graphs), ids)
    notes += attn_notes
    moe_calls = [(g.name, k.id) for g in engine_cap.graphs for k in g.kernels
                 if k.kind == "extern" and (r := engine_rule(k.name, engine_cap.attention)) is not None
                 and r.kind == "moe"]
    return attn + (experts_decisions(tgraph, train.values, train.changed, moe_calls, ids) if moe_calls else [])


def _routing(engine_cap: Capture, buffers: Buffers, train: TrainSide, ref: str) -> list[RoutingAgreement]:
    """The MoE routing agreement of each layer at the reference shape (none for a dense model)."""
    tgraph = train.capture.graphs[0]
    return [a for g in engine_cap.graphs if ref in g.shapes or not g.shapes
            for a in routing_agreement(tgraph, train.values, engine_routing(g, buffers.get(ref, {})), ref)]


def logits_notes(engine_cap: Capture, train_cap: Capture, config: dict) -> list[str]:
    """The two sides computing logits with different weights: a gap no rounding explains, named first."""
    untied = not config.get("tie_word_embeddings", True)
    trainer_head = any(name == "lm_head.weight" for g in train_cap.graphs for name in g.inputs.values())
    if engine_cap.logits_weight == "input embedding" and untied and trainer_head:
        return [f"logits differ by model, not by rounding: the engine computes them with the input embedding "
                f"(vLLM's {engine_cap.architecture} does not read lm_head.weight), the trainer with this checkpoint's "
                "own lm_head.weight (tie_word_embeddings false); the log-prob gap measures two models. Tie the "
                "checkpoint's LM head to its embedding, or serve it with an engine model that reads lm_head.weight"]
    return []


def _trainer_roots(tgraph: Graph, engine_graphs: list[Graph]) -> list[str]:
    """The engine's module roots renamed to the trainer's (`align_module_roots`), each as a note."""
    return [f"engine modules under `{a}` named as the trainer's `{b}`"
            for a, b in align_module_roots(tgraph, engine_graphs).items()]


def analyze(engine_cap: Capture, buffers: Buffers, train: TrainSide, *, model: str, layers_total: int,
            config: dict, reproduce: str = "", notes: list[str] | None = None) -> ScanResult:
    """Everything after both sides have run: rounding, replay evidence, matching, the plan, sites, regions."""
    t0 = time.perf_counter()
    notes = list(notes or [])
    if len(engine_cap.graphs) != 1:
        notes.append(f"engine compiled {len(engine_cap.graphs)} graphs; sites are searched in each")
    notes += logits_notes(engine_cap, train.capture, config)
    tgraph = train.capture.graphs[0]
    notes += _trainer_roots(tgraph, engine_cap.graphs)
    labels = [s.label for s in engine_cap.shapes] or list(buffers)
    timings: dict[str, float] = {}
    per_graph, matched, replay, engine_values = _reference_decisions(engine_cap, buffers, train, labels[0], timings)
    t = time.perf_counter()
    attn = _opaque_decisions(engine_cap, train, notes)
    others: dict[str, list[Decision]] = {}
    for label in labels[1:]:
        graphs_here, more = _shape_decisions(engine_cap, buffers, train, label, matched)
        replay += more
        others[label] = merge_decisions(tgraph, [*graphs_here, [a.model_copy(deep=True) for a in attn]])
    plan = _merge_shapes(merge_decisions(tgraph, [*per_graph, attn]), others, labels[0])
    mark_reads(tgraph, plan, engine_cap.graphs)
    tp_replay, tp_notes = tp.after_merge(plan, per_graph, engine_cap, buffers, tgraph, train.values, labels[0])
    replay, notes = replay + tp_replay, notes + tp_notes
    timings["shapes_s"] = time.perf_counter() - t
    sites, regions = _sites_and_regions(plan, tgraph, engine_cap, labels)
    not_replayed, unexplained, unregistered = _proof(sites, plan, replay, engine_cap.graphs, engine_cap.attention)
    ordered = _mark_regions(regions, sites, labels, replay, tgraph, engine_cap.graphs, matched)
    routing = _routing(engine_cap, buffers, train, labels[0])
    t = time.perf_counter()
    uniformity = (site_nonuniformity(tgraph, train.gm, train.values, sites,
                                     _site_engine_values(sites, engine_cap.graphs, engine_values), train.fp32)
                  if train.gm else {})
    timings["nonuniformity_s"] = time.perf_counter() - t
    departure = first_departure(tgraph, train.values, matched, engine_cap.graphs, engine_values)
    used = {m.engine for ms, _ in matched.values() for m in ms}
    unmatched_all = set.intersection(*(set(u) for _, u in matched.values())) if matched else set()
    return ScanResult(
        model=model, architecture=engine_cap.architecture, config_sha256=config_sha256(config),
        config=scanned_config_of(config), versions={**train.capture.versions, **engine_cap.versions},
        layers_scanned=int(config.get("num_hidden_layers",
                                      len({s.layer for s in sites if s.layer is not None}) or layers_total)),
        layers_total=layers_total, prompt_tokens=engine_cap.prompt_tokens, shapes=engine_cap.shapes,
        engine_config=engine_cap.engine_config, engine_attention=engine_cap.attention, engine_device=engine_cap.device,
        plan=plan, sites=sites,
        engine_experts=engine_experts_op(engine_cap.graphs), addmm_folds=addmm_folds(engine_cap.graphs),
        addmm_biases=addmm_biases(engine_cap.graphs), engine_rope_table=rope_table_dtype(engine_cap.graphs),
        regions=regions, replay=replay,
        matched=sum(len(ms) for ms, _ in matched.values()),
        unmatched_train=[n.name for n in tgraph.nodes if n.name in unmatched_all and n.op == "call_function"][:500],
        unmatched_engine_kernels=[k.id for g in engine_cap.graphs for k in g.kernels
                                  if k.kind == "generated" and not (set(k.nodes) & used)],
        not_replayed=not_replayed, unexplained=unexplained, unregistered_externs=unregistered,
        engine_unread=engine_cap.unread_params,
        timings={"analysis_s": round(time.perf_counter() - t0, 3), **{k: round(v, 3) for k, v in timings.items()}},
        reproduce=reproduce, notes=notes, nonuniformity=uniformity, routing=sorted(routing, key=lambda a: a.layer),
        departure=departure, ordered_sums=ordered, **_engine_reads(tgraph, matched, engine_cap.graphs, plan,
                                                                   replay, engine_values, buffers.get(labels[0], {}),
                                                                   labels[0]),
    )


def _engine_reads(tgraph: Graph, matched: dict[str, tuple[list[Match], list[str]]], engine_graphs: list[Graph],
                  plan: list[Decision], replay: list[KernelEvidence], engine_values: dict[str, dict],
                  records: dict, ref: str) -> dict[str, Any]:
    """How the engine's kernels compute what no site marks (ScanResult fields): the stored copies they read back,
    the residual sums they round, the ops they compute with Inductor's math (the order they sum rows in:
    `_mark_regions`)."""
    sums = residual_sums(tgraph, matched, engine_graphs, plan)
    return dict(norm_rereads=norm_rereads(tgraph, engine_graphs, matched),
                norm_reads_stored=norm_reads_stored(tgraph, engine_graphs, matched), rounded_sums=sums[0],
                stored_sums=sums[1],
                inductor_math=math_differences(tgraph, matched, engine_graphs, engine_values, records,
                                               [r for r in replay if r.shape in ("", ref)], replay))

