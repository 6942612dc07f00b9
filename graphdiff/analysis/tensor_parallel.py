"""Tensor parallelism in the analysis: sharded values, and the all-reduce of row-parallel partial products.

A tensor-parallel engine capture holds every rank's graphs (graphdiff.engines.vllm.tp: rank 0's under their own
names, rank r's as `rank<r>/<name>`). Each rank computes

- replicated values (the residual stream, norms, every row-parallel matmul's output after its all-reduce): the
  same in every rank; they are matched like a TP=1 engine's, and rank 0's graphs, listed first, decide them (the
  merge of per-graph decisions keeps the first of equal rank);
- sharded values (a column-parallel matmul's output and what is computed from it: q/k/v, the q/k norms, RoPE,
  SiLU(gate) * up): only its own shard, `numel / tp` elements. `match_values` matches such a value to the shard
  of the trainer's value that the rank holds (its r-th part along one dimension of the trainer's value, found
  by the same sorted-value fingerprint); the engine code is the same in every rank, so a rank's shard decides
  the whole value.

A row-parallel matmul (o_proj, down_proj) is one GEMM in the trainer: its sum over the whole K dimension is
accumulated in FP32 and rounded once. The engine splits K over the ranks: each rank's matmul stores its partial
product in BF16, and the all-reduce sums the BF16 partials and rounds again. vLLM CPU's all-reduce is the in-place
extern `_C.shm_allreduce` of its ops build (FP32 sum rounded once: to nearest even on `_C`, by truncation on
`_C_AVX512`); the `_C_AVX2` build has no shared-memory ops, and vLLM falls back to torch.distributed (gloo), which
Inductor calls in place as `_c10d_functional.all_reduce_` (each BF16 addition rounded to nearest even: for 2 ranks the
FP32 sum rounded once; `allreduce_truncates`). The partials' rounding is one-sided: an `allreduce` site, decided from
the engine graph (an all-reduce extern whose buffer a matmul extern wrote, and the trainer value matched to that
buffer), with the registry entry as the description and, where the capture recorded the extern calls
(graphdiff.engines.vllm.tp_worker), the check on real data as replay evidence: the all-reduce output recomputed from the
ranks' BF16 partials ("predicted") and as one rounding of the FP32 sum of the partial products ("naive", the
trainer's).
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.nn.functional as F

from graphdiff.analysis.match import (
    TOLERANCE,
    Match,
    best_match,
    match_repeated,
    modules_compatible,
    op_kind,
    sorted_fingerprint,
)
from graphdiff.analysis.match import match_values as match_replicated
from graphdiff.analysis.opaque import engine_device, extern_rule
from graphdiff.analysis.rounding import is_view
from graphdiff.capture.collectives import AllReduce, allreduces, buffer_base
from graphdiff.capture.cpu_kind import stored, stores_truncate
from graphdiff.ops import MATMULS, op_name
from graphdiff.records import (
    Buffers,
    Capture,
    Decision,
    Evidence,
    ExternRecord,
    Graph,
    KernelEvidence,
    RegionKind,
    SideState,
    layer_of,
)

ALLREDUCE_REASON = ("a row-parallel matmul's output: the engine's all-reduce sums the ranks' partial products, each "
                    "stored in BF16 by its matmul (the all-reduce extern reads the buffer a matmul extern wrote)")


def tp_size(cap: Capture) -> int:
    size = cap.engine_config.get("tensor_parallel_size")
    return int(size) if isinstance(size, (int, str)) and size else 1


def rank_of(graph: Graph | str) -> int:
    """The tensor-parallel rank a graph of the capture belongs to (`rank<r>/<name>`; anything else: rank 0)."""
    name = graph if isinstance(graph, str) else graph.name
    head, sep, _ = name.partition("/")
    return int(head[4:]) if sep and head.startswith("rank") and head[4:].isdigit() else 0


def primary_graphs(graphs: list[Graph]) -> list[Graph]:
    """Rank 0's graphs (all of a TP=1 capture)."""
    return [g for g in graphs if rank_of(g) == 0]


# --- sharded values ----------------------------------------------------------------------------------------

def match_values(train: Graph, train_values: dict[str, object], engine: Graph, engine_values: dict[str, torch.Tensor],
                 tp: int = 1) -> tuple[list[Match], list[str]]:
    """match.match_values, and with `tp` > 1 the trainer values it left unmatched matched to this rank's
    shard of them."""
    matches, unmatched = match_replicated(train, train_values, engine, engine_values)
    # a value repeated along a dimension (keys broadcast to every query head), held once by the engine
    more = match_repeated(train, train_values, engine, engine_values, unmatched)
    if tp > 1:
        found = {m.train for m in more}
        more += match_shards(train, train_values, engine, engine_values, [u for u in unmatched if u not in found],
                             tp, rank_of(engine))
    found = {m.train for m in more}
    return matches + more, [u for u in unmatched if u not in found]


def _shards(v: torch.Tensor, tp: int, rank: int) -> list[tuple[int, torch.Tensor]]:
    return [(d, v.chunk(tp, d)[rank]) for d in range(v.dim()) if v.shape[d] % tp == 0 and v.shape[d] >= tp]


def match_shards(train: Graph, train_values: dict[str, object], engine: Graph,
                 engine_values: dict[str, torch.Tensor], names: list[str], tp: int, rank: int) -> list[Match]:
    """Trainer values `names` matched to engine values holding rank `rank`'s shard of them: same layer and
    compatible module, `numel / tp` elements, the sorted values of the trainer value's `rank`-th part along one of
    its dimensions within the tolerance."""
    enodes, tnodes = engine.node_map(), train.node_map()
    by_key: dict[tuple[int, int | None], list[str]] = {}
    for name, ev in engine_values.items():
        if isinstance(ev, torch.Tensor) and ev.is_floating_point() and name in enodes:
            by_key.setdefault((ev.numel(), layer_of(enodes[name].module)), []).append(name)
    prints: dict[str, torch.Tensor] = {}
    out = []
    for name in names:
        t, v = tnodes[name], train_values.get(name)
        if not isinstance(v, torch.Tensor) or v.numel() % tp or v.numel() < 2 * tp:
            continue
        cands = [e for e in by_key.get((v.numel() // tp, layer_of(t.module)), [])
                 if modules_compatible(t.module, enodes[e].module, True)]
        if not cands:
            continue
        shards = [(d, sorted_fingerprint(s)) for d, s in _shards(v, tp, rank)]
        scored = []
        for e in cands:
            fp = prints.setdefault(e, sorted_fingerprint(engine_values[e]))
            dist, dim = min(((float((fp - s).norm()) / (float(s.norm()) or 1.0), d) for d, s in shards),
                            default=(float("inf"), -1))
            scored.append((round(dist, 6), op_kind(enodes[e]) != op_kind(t), -engine.position(e), e, dim))
        scored.sort()
        best = scored[0]
        if best[0] > TOLERANCE:
            continue
        out.append(best_match(name, scored, layer_of(t.module), enodes[best[3]].module,
                              f": rank {rank}'s shard ({v.numel() // tp} of {v.numel()} values, part {rank} of {tp} "
                              f"along dim {best[4]})"))
    return out


def same_weight(ref: torch.Tensor, recorded: torch.Tensor) -> bool:
    """A recorded engine weight is the trainer's, or (tensor parallelism) one rank's shard of it (padding aside)."""
    if ref.shape == recorded.shape:
        return torch.equal(ref, recorded)
    if ref.dim() != recorded.dim():
        return False
    for d in range(ref.dim()):
        if any(a != b for i, (a, b) in enumerate(zip(ref.shape, recorded.shape)) if i != d):
            continue
        n = recorded.shape[d]
        for start in range(0, ref.shape[d], n):
            part = ref.narrow(d, start, min(n, ref.shape[d] - start))
            if torch.equal(part, recorded.narrow(d, 0, part.shape[d])):
                return True
    return False


# --- the all-reduce of row-parallel partial products ---------------------------------------------------------

def allreduce_truncates(kernel: str, build: str) -> bool:
    """Does this all-reduce extern (kernel name or id) store its FP32 sum by truncation? Only vLLM's own
    `_C.shm_allreduce` on an ops build that truncates (`_C_AVX512`); torch.distributed's all-reduce, vLLM CPU's
    fallback where the build has no shared-memory ops (`_C_AVX2`), sums as torch does, rounding to nearest even."""
    return "shm_allreduce" in kernel and stores_truncate(build)


def _weight(train: Graph, train_values: dict[str, object], node: str) -> torch.Tensor | None:
    """The weight a trainer matmul multiplies by ([out, in]), through the transpose/views on its way."""
    nodes = train.node_map()
    n = nodes[node]
    if op_name(n.target) != "mm" or len(n.inputs) != 2:
        return None
    w = n.inputs[1]
    while nodes[w].op != "placeholder" and nodes[w].inputs and is_view(nodes[w]):
        w = nodes[w].inputs[0]
    v = train_values.get(w)
    return v if isinstance(v, torch.Tensor) and nodes[w].param else None


def _eq(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.reshape(-1).view(torch.int16) == b.reshape(-1).view(torch.int16)).double().mean())


def _total(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors added left to right (as Python's sum: the order decides the FP32 sum's bits)."""
    return functools.reduce(operator.add, tensors)


def _check(records: list[ExternRecord], weight: torch.Tensor | None, tp: int,
           truncate: bool = False) -> tuple[list[float], list[float], str]:
    """Per rank: the recorded all-reduce output vs bf16(FP32 sum of the ranks' BF16 partials) ("predicted"; stored as
    the all-reduce stores: by truncation where `truncate`, allreduce_truncates) and vs
    one rounding of the FP32 sum of the partial products, recomputed from each rank's matmul input and its shard
    of the weight ("naive": one GEMM, as the trainer). And how each rank's partial relates to its FP32 product."""
    partials = [r["partial"] for r in records]
    dtype = partials[0].dtype
    summed = stored(_total([p.float() for p in partials]), truncate, dtype)
    predicted = [_eq(summed, r["reduced"]) for r in records]
    xs = [x for r in records if (x := r.get("matmul_input")) is not None]
    if weight is None or len(xs) != len(records) or weight.shape[1] != sum(x.shape[-1] for x in xs):
        return predicted, predicted, "no matmul product to compare (e.g. an embedding's masked rows: exact)"
    step = weight.shape[1] // tp
    products = [F.linear(x.float(), weight[:, r * step:(r + 1) * step].float()) for r, x in enumerate(xs)]
    one = _total(products).to(dtype)
    naive = [_eq(one, r["reduced"]) for r in records]
    partial_ok = min(_eq(p.to(dtype), r["partial"]) for p, r in zip(products, records))
    how = "truncated" if truncate else "rounded"
    return predicted, naive, (f"an all-reduce of {tp} ranks: predicted = its output recomputed as the FP32 sum of the "
                              f"ranks' recorded BF16 partials, {how} once; naive = one rounding of the FP32 sum of "
                              f"the partial products (one GEMM, as the trainer); each rank's partial equals its FP32 "
                              f"product rounded once on {partial_ok:.2%}")


def allreduce_plan(plan: list[Decision], cap: Capture, buffers: Buffers, train_graph: Graph,
                   train_values: dict[str, object], ref: str) -> list[KernelEvidence]:
    """Turn the decisions on row-parallel matmul outputs into `allreduce` sites (in place, every shape variant);
    returns the all-reduce checks of every rank at the reference shape as replay evidence."""
    tp = tp_size(cap)
    per_rank: dict[int, list[AllReduce]] = {}
    for g in cap.graphs:
        per_rank.setdefault(rank_of(g), []).extend(allreduces(g))
    if not per_rank:
        return []
    graphs = {g.name: g for g in cap.graphs}
    by_buffer = {(a.graph, buffer_base(graphs[a.graph], a.buffer)): (r, i)
                 for r, ars in per_rank.items() for i, a in enumerate(ars)}
    records = buffers.get(ref, {})
    rows: list[KernelEvidence] = []
    checked: dict[int, tuple[list[float], list[float]]] = {}  # index in rank order -> per-rank fractions
    for d in plan:
        e = d.evidence
        if d.rule != "matched" or e.engine_graph not in graphs or op_name(d.op) not in MATMULS:
            continue
        where = by_buffer.get((e.engine_graph, buffer_base(graphs[e.engine_graph], e.engine_node)))
        if where is None:
            continue
        rank, index = where
        ar = per_rank[rank][index]
        if not ar.matmul:
            continue
        if index not in checked:
            group = [per_rank[r][index] for r in sorted(per_rank) if index < len(per_rank[r])]
            recs = [ext for a in group if (rec := records.get(a.kernel)) and (ext := rec.get("extern"))]
            if len(group) == tp and len(recs) == len(group):
                pred, naive, note = _check(recs, _weight(train_graph, train_values, d.node), tp,
                                           allreduce_truncates(ar.kernel, cap.attention.get("build", "")))
                rows += [KernelEvidence(kernel=a.kernel, shape=ref, predicted_bitexact=round(p, 6),
                                        naive_bitexact=round(n, 6), elements=recs[0]["reduced"].numel(), note=note)
                         for a, p, n in zip(group, pred, naive)]
                checked[index] = (pred, naive)
            else:
                checked[index] = ([], [])
        pred, naive = checked[index]
        rule = extern_rule(ar.kernel.split(":")[0], device=engine_device(cap.attention))
        mm = ar.matmul.split(":")[0]
        name = ar.kernel.split(":")[0]
        d.rule, d.site, d.kind = "opaque-registry", True, "allreduce"
        d.train = SideState(dtype="float32", how="one GEMM: its partial sums over the whole K dimension stay FP32, "
                                                 "the output is rounded once")
        d.engine = SideState(dtype=d.engine.dtype if d.engine else "bfloat16", rounds=True, on_grid=True,
                             changed=round(1 - naive[0], 6) if naive else None,
                             how=f"K split over {tp} ranks: each rank's partial product stored in BF16 by {mm}, "
                                 f"summed in FP32 by {name} and rounded again")
        d.evidence = Evidence(engine_node=e.engine_node, engine_graph=e.engine_graph, kernel=ar.kernel,
                              replay_predicted=round(pred[0], 6) if pred else None,
                              replay_naive=round(naive[0], 6) if naive else None, distance=e.distance,
                              runner_up=e.runner_up, confidence=e.confidence,
                              registry=f"{rule.op}: {rule.rounds} ({rule.source})" if rule else "")
    return rows


def region_kind(d: Decision) -> tuple[RegionKind, str] | None:
    """The region kind of an all-reduce site (set by allreduce_plan; the dataflow rules do not apply to it)."""
    return ("allreduce", ALLREDUCE_REASON) if d.kind == "allreduce" else None


def rank_agreement(per_graph: list[list[Decision]]) -> str | None:
    """One line: do the ranks' own decisions agree with rank 0's (whose decide the plan)?"""
    decided: dict[int, dict[str, tuple]] = {}
    for ds in per_graph:
        for d in ds:
            if d.rule != "no-engine-value" and d.evidence.engine_graph:
                decided.setdefault(rank_of(d.evidence.engine_graph), {}).setdefault(
                    d.node, (d.site, d.engine.on_grid if d.engine else None))
    if len(decided) < 2:
        return None
    base = decided.get(0, {})
    parts = []
    for r in sorted(decided):
        if r == 0:
            continue
        both = set(base) & set(decided[r])
        differ = sorted(n for n in both if base[n] != decided[r][n])
        parts.append(f"rank {r} decides {len(both) - len(differ)} of the {len(both)} values both decide as rank 0 "
                     "does" + (f" (differs: {', '.join(differ[:6])})" if differ else ""))
    return "tensor parallelism: every rank's graphs replayed and decided, rank 0's decisions kept; " + "; ".join(parts)


def after_merge(plan: list[Decision], per_graph: list[list[Decision]], cap: Capture, buffers: Buffers,
                train_graph: Graph, train_values: dict[str, object], ref: str) -> tuple[list[KernelEvidence],
                                                                                       list[str]]:
    """The scan's hook after the per-graph decisions are merged: all-reduce sites (and their checks as replay
    evidence), and a note on how the ranks agree. A TP=1 capture has no all-reduce: nothing changes."""
    note = rank_agreement(per_graph) if tp_size(cap) > 1 else None  # before the plan's decisions are rewritten
    rows = allreduce_plan(plan, cap, buffers, train_graph, train_values, ref)
    return rows, [note] if note else []
