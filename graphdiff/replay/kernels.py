"""Replay one generated engine kernel on its real recorded buffers, and score the rounding model.

A kernel's FX fragment (the nodes the scheduler fused into it) is re-executed by the
RoundingInterpreter on the kernel's recorded inputs, once under the predicted model (FP32 in
registers, low precision only where the kernel stores) and once under "round after every op"
(naive), and the results are compared bit for bit with the kernel's recorded low-precision stores.
The capture names most buffers for certain; the few it cannot (an input passed under another name,
one part of a concatenation written in place) are placed by shape and value, and the assignment that
replays best is kept. Where the predicted model is not exact, conversions the kernel really performs
in registers are searched for, one at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from graphdiff.ops import is_low, op_name
from graphdiff.records import Graph, Kernel, KernelEvidence, KernelRecord, Node
from graphdiff.replay.forms import SUFFIX as FORM_SUFFIX
from graphdiff.replay.forms import two_step_variance
from graphdiff.replay.inductor_math import INDUCTOR_MATH
from graphdiff.replay.interpreter import LOW, run_fragment, to_dtype
from graphdiff.replay.kernel_fragment import is_view, kernel_fragment
from graphdiff.replay.reload import SUFFIX, nest_reductions, reload_variant, reloaded_stores, stored_alone
from graphdiff.replay.sum_order import cpp_sum_lanes, is_row_reduction, triton_sum_lanes
from graphdiff.replay.values import (
    as_node_value,
    bind_symbols,
    fp32_error,
    numel,
    placement_closeness,
    score,
    sym_value,
)

MAX_PERMUTATIONS = 120
FP32_ORDER_TOLERANCE = 1e-5  # FP32 stores agreeing within this (relative) differ only in summation order


class Declared:
    """Node dtypes by name, read through the graph's index (no per-kernel copy)."""

    def __init__(self, graph: Graph) -> None:
        self.nodes = graph.node_map()

    def get(self, name: str, default: str | None = None) -> str | None:
        node = self.nodes.get(name)
        return node.dtype if node is not None else default


@dataclass
class _Binding:
    """What the capture says for certain about a kernel call's buffers, and what is left to place."""

    inputs: dict[str, Any]  # fragment input node -> its recorded value (or symbol value)
    loose: list[str]  # fragment inputs with no named buffer
    free: list[str]  # recorded input buffers no named input took
    outputs: dict[str, str]  # stored buffer -> fragment node it holds
    open: list[str]  # stored buffers with no node named for them


def _bind(graph: Graph, k: Kernel, record: KernelRecord, known: dict[str, str], frag: list[Node], external: list[str],
          syms: dict[str, int]) -> _Binding:
    nodes = graph.node_map()
    node_buf = {v: b for b, v in known.items()}
    inputs: dict[str, Any] = {}
    loose: list[str] = []
    for e in external:
        n = nodes[e]
        if n.sym is not None and (v := sym_value(n.sym, syms)) is not None:
            inputs[e] = v  # a size, or a SymInt expression of sizes (`s27 + 1`) computed outside the kernel
            continue
        buf = node_buf.get(e)
        if buf is not None and buf in record["in"]:
            inputs[e] = as_node_value(record["in"][buf], n, syms)
        else:
            loose.append(e)
    taken = {node_buf.get(e) for e in inputs}
    free = [b for b in record["in"] if b not in taken]
    names = {n.name for n in frag}
    # Stores the capture names a node for (buffers whose size disagrees hold a part of it, e.g. one input
    # of a concatenation written in place; those are placed by value, or left out). A store the capture names
    # no node for may be named by the extern that reads it (a mutating extern's input, e.g. the q/k copies
    # _C.rotary_embedding rotates in place): the same value stored twice.
    named = {a.name: a.node or (known.get(a.name) if known.get(a.name) in names else None) for a in k.args}
    outputs = {a.name: node for a in k.args
               if a.role in ("out", "inout") and (node := named[a.name]) is not None and node in names
               and isinstance(record["out"].get(a.name), torch.Tensor)
               and numel(nodes[node].shape, syms) == record["out"][a.name].numel()}
    open_bufs = [a.name for a in k.args if a.role in ("out", "inout") and a.name not in outputs
                 and a.name in record["out"]]
    return _Binding(inputs, loose, free, outputs, open_bufs)


def _sinks(graph: Graph, frag: list[Node]) -> set[str]:
    names, users = {n.name for n in frag}, graph.users()
    return {n.name for n in frag if not is_view(n) and any(u not in names for u in users.get(n.name, []))}


def _place_outputs(b: _Binding, frag: list[Node], values: dict[str, Any], record: KernelRecord, syms: dict[str, int],
                   sinks: set[str]) -> dict[str, str]:
    """Named stores plus each unnamed one placed at the fragment value closest to what it holds. A view is a
    candidate too: the pass-through part of a partial RoPE (`cat([rotated, x[..., d:]])`) is stored as a copy of
    a slice, one input of a concatenation written in place; on a tie the computing node is preferred (its store is
    where the rounding happens)."""
    placed = dict(b.outputs)
    for buf in b.open:
        real = record["out"][buf]
        options = [n.name for n in frag if n.name not in placed.values()
                   and numel(n.shape, syms) == real.numel() and to_dtype(n.dtype) is not None
                   and (to_dtype(n.dtype) == real.dtype or n.name in sinks)
                   and isinstance(values.get(n.name), torch.Tensor)]
        by = {n.name: n for n in frag}
        if options:  # a buffer we cannot place is left out of the comparison
            placed[buf] = max(options, key=lambda c: (placement_closeness(values, c, real), not is_view(by[c])))
    return placed


@dataclass
class _Plan:
    """How one kernel's fragment is re-run: the nodes (possibly rewritten), their dtypes, what is rounded anyway,
    and whether transcendental ops compute as Inductor's C++ kernels do."""

    frag: list[Node]
    declared: Any
    rounded: frozenset[str]
    syms: dict[str, int]
    cpp: bool
    compute: torch.dtype
    ordered: dict[str, int] = field(default_factory=dict)  # row reductions summed in the kernel's order

    def run(self, inputs: dict[str, Any], extra: frozenset[str] | set[str] = frozenset()) -> Any:
        return run_fragment(self.frag, inputs, self.declared, "fp32", self.syms, rounded=self.rounded | set(extra),
                            compute=self.compute, inductor_math=self.cpp, ordered=self.ordered)


class _WithAdded:
    """Declared dtypes plus those of the nodes a rewritten fragment adds."""

    def __init__(self, base: Declared, extra: dict[str, str | None]) -> None:
        self.base, self.extra = base, extra

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.extra[name] if name in self.extra else self.base.get(name, default)


def _candidates(node: Node, b: _Binding, record: KernelRecord, syms: dict[str, int]) -> list[str]:
    """The recorded input buffers no named input took that can hold `node`'s value (its size and dtype)."""
    want, dt = numel(node.shape, syms), to_dtype(node.dtype)
    return [x for x in b.free if isinstance(record["in"][x], torch.Tensor) and record["in"][x].numel() == want
            and (dt is None or record["in"][x].dtype == dt)]


def readable_fragment(graph: Graph, k: Kernel, record: KernelRecord, known: dict[str, str], frag: list[Node],
                      external: list[str], syms: dict[str, int]) -> tuple[list[Node], list[str], int]:
    """The fragment without the nodes that read, directly or through other fragment nodes, a value no buffer the
    kernel was passed can hold: the kernel does not compute them (Inductor names the FX nodes lowered with a buffer
    as its origins: an attention mask an HF model builds once, copied for each layer's attention call, lists the
    mask's chain under every layer's copy kernel, though only the first computes it). Returns the fragment, its
    inputs and how many nodes it lost."""
    b = _bind(graph, k, record, known, frag, external, syms)
    nodes = graph.node_map()
    gone = {e for e in b.loose if not _candidates(nodes[e], b, record, syms)}
    return _without(frag, gone) if gone else (frag, external, 0)


def passed_values(k: Kernel, known: dict[str, str], frag: list[Node], external: list[str]) \
        -> tuple[list[Node], list[str]]:
    """The fragment reading, not recomputing, the listed nodes whose values the kernel is passed in a read-only
    buffer (a dump lists a fusion group's nodes under each kernel of the group: the GQA copy of K lists the K norm
    and RoPE that an earlier kernel stored in the buffer it copies). What only fed them is left to
    `readable_fragment`. Low-precision values only: an FP32 store placed at a mean holds its row sum."""
    passed = {known[a.name] for a in k.args if a.role == "in" and a.name in known}
    cut = [n.name for n in frag if n.name in passed and is_low(n.dtype)]
    if not cut:
        return frag, external
    return [n for n in frag if n.name not in cut], list(dict.fromkeys([*external, *cut]))


def _without(frag: list[Node], gone: set[str]) -> tuple[list[Node], list[str], int]:
    """The fragment without the nodes that read, directly or through other fragment nodes, a value in `gone`; its
    inputs; how many nodes it lost."""
    gone = set(gone)
    kept = []
    for n in frag:  # graph order: a node's inputs come before it
        if any(i in gone for i in n.inputs):
            gone.add(n.name)
        else:
            kept.append(n)
    members = {n.name for n in kept}
    return kept, list(dict.fromkeys(i for n in kept for i in n.inputs if i not in members)), len(frag) - len(kept)


def fewer_inputs(b: _Binding, frag: list[Node]) -> list[tuple[list[Node], list[str], int]]:
    """Where the fragment has more unnamed inputs than the kernel has unclaimed buffers, the fragments that read
    only as many of them (each choice's nodes, inputs, nodes lost): a dump lists a fusion group's nodes under
    each kernel of the group (the K and V copies for GQA under one SDPA group list both projections, and each
    copy kernel is passed one buffer)."""
    if len(b.loose) <= len(b.free):
        return []
    choices = itertools.islice(itertools.combinations(b.loose, len(b.free)), MAX_PERMUTATIONS)
    return [_without(frag, set(b.loose) - set(keep)) for keep in choices]


def _best_assignment(graph: Graph, b: _Binding, plan: _Plan, external: list[str],
                     record: KernelRecord) -> tuple[tuple | None, str, dict[str, str]]:
    """Try each placement of the unnamed inputs (by element count and dtype); keep the one that replays best.
    Only the input assignment changes the computation; outputs are placed after each run. Also returns the
    placement (buffer -> node) where it is certain: every placement tried and no other one replays as well.
    Several can (sums of BF16 values are exact in FP32, so their order does not show in what the kernel stores:
    a kernel re-summing the residual from the embedding on, its o_proj outputs placed in any order); a later
    kernel reading the same buffers then binds them by name."""
    nodes, sinks, syms = graph.node_map(), _sinks(graph, plan.frag), plan.syms
    best, error, ties, tried = None, "inputs could not be resolved", 0, 0
    options = [_candidates(nodes[e], b, record, syms) for e in b.loose]
    for ins in itertools.islice(distinct_choices(options), MAX_PERMUTATIONS + 1):
        tried += 1
        if tried > MAX_PERMUTATIONS:
            continue
        trial = {**b.inputs, **{e: as_node_value(record["in"][x], nodes[e], syms) for e, x in zip(b.loose, ins)}}
        run = plan.run({e: trial[e] for e in external if e in trial})
        if not run.ok:
            error = run.error
            continue
        outputs = _place_outputs(b, plan.frag, run.values, record, syms, sinks)
        s, _ = score(run.values, outputs, record)
        ties = 1 if best is None or s > best[0] else ties + (s == best[0])
        if best is None or s > best[0]:
            best = (s, trial, outputs, run.values, ins)
    certain = best is not None and ties == 1 and tried <= MAX_PERMUTATIONS
    return best, error, dict(zip(best[4], b.loose)) if certain and best is not None else {}


def distinct_choices(options: list[list[str]]) -> Iterator[tuple[str, ...]]:
    """Each way to take one option per position with no option taken twice, in `itertools.product`'s order: four
    inputs of one size have 24 placements, where the product lists 256 (its repeats included)."""

    def extend(i: int, taken: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
        if i == len(options):
            yield taken
            return
        for x in options[i]:
            if x not in taken:
                yield from extend(i + 1, (*taken, x))

    return extend(0, ())


Variant = tuple[_Plan, float, dict[str, Any]]  # a rewritten plan, its replay score and values


def _if_better(variant: _Plan, inputs: dict[str, Any], outputs: dict[str, str], record: KernelRecord,
               than: float) -> Variant | None:
    """The variant's replay, if it scores above `than`."""
    run = variant.run(inputs)
    got = score(run.values, outputs, record)[0] if run.ok else 0.0
    return (variant, got, run.values) if got > than else None


def _reloaded(k: Kernel, plan: _Plan, inputs: dict[str, Any], outputs: dict[str, str], record: KernelRecord,
              predicted: float) -> Variant | None:
    """The plan with re-loaded stores rounded for their later readers, if the kernel's code re-loads any and that
    replays better."""
    stored = reloaded_stores(k)
    if not stored:
        return None
    best, alone = None, stored_alone(k)
    # by dataflow (the consumers past a reduction of the value), then by loop nest (all but the storing nest's own
    # reductions): the better replay is kept
    for in_nest in (None, nest_reductions(k)):
        frag, rounded = reload_variant(plan.frag, stored, alone, in_nest)
        added = {n.name: n.dtype for n in frag if n.name.endswith(SUFFIX)}
        variant = _Plan(frag, _WithAdded(plan.declared, added), plan.rounded | rounded, plan.syms, plan.cpp,
                        plan.compute, plan.ordered)
        best = _if_better(variant, inputs, outputs, record, best[1] if best else predicted) or best
        if best is not None and best[1] == 1.0:
            break
    return best


def stored_concats(frag: list[Node], declared: Any, outputs: dict[str, str]) -> set[str]:
    """Low-precision concatenations every part of which the kernel stores: Inductor's ConcatKernel, whose parts are
    written in place into views of its buffer; a reader of the cat (a later loop nest) loads that buffer, the
    parts rounded to its dtype, not the registers that computed them (OLMo2's k-norm + RoPE: rotate_half's cat of
    the normed k halves, stored, then read back for `* sin`)."""
    stored = set(outputs.values())
    return {n.name for n in frag if n.target == "aten.cat.default" and is_low(declared.get(n.name))
            and n.inputs and all(i in stored for i in n.inputs)}


def _concats_read_back(plan: _Plan, inputs: dict[str, Any], outputs: dict[str, str], record: KernelRecord,
                       predicted: float) -> Variant | None:
    """The plan with the stored concatenations read rounded (`stored_concats`), if there are any and that replays
    better."""
    cats = stored_concats(plan.frag, plan.declared, outputs) - plan.rounded
    if not cats:
        return None
    variant = _Plan(plan.frag, plan.declared, plan.rounded | cats, plan.syms, plan.cpp, plan.compute, plan.ordered)
    return _if_better(variant, inputs, outputs, record, predicted)


def _explicit_conversions(plan: _Plan, inputs: dict[str, Any], outputs: dict[str, str], record: KernelRecord,
                          predicted: float, values: dict[str, Any]) -> tuple[float, list[str], dict[str, Any]]:
    """Conversions the kernel really performs in registers: add one at a time while the replay improves."""
    explicit: list[str] = []
    candidates = [n.name for n in plan.frag if is_low(n.dtype) and "convert_element_type" in n.target
                  and not n.name.endswith(SUFFIX)]
    while predicted < 1.0 and candidates:
        trials = []
        for c in candidates:
            run = plan.run(inputs, {*explicit, c})
            if run.ok:
                trials.append((score(run.values, outputs, record)[0], c, run.values))
        if not trials or max(trials, key=lambda t: t[0])[0] <= predicted:
            break
        predicted, c, values = max(trials, key=lambda t: t[0])
        explicit.append(c)
        candidates.remove(c)
    return predicted, explicit, values


def copy_kernel(graph: Graph, k: Kernel, record: KernelRecord) -> KernelEvidence | None:
    """A kernel whose fused nodes are all computed by other kernels (Inductor's copy-back of a buffer a mutating
    extern wrote) computes nothing: it replays if every store equals one of its loads bit for bit."""
    nodes = graph.node_map()
    if not k.nodes or any(nodes[n].kernel == k.id for n in k.nodes):
        return None
    loads = [t for t in record["in"].values() if isinstance(t, torch.Tensor)]
    stores = [t for t in record["out"].values() if isinstance(t, torch.Tensor)]
    if not stores or not all(any(i.numel() == t.numel() and i.dtype == t.dtype
                                 and torch.equal(i.reshape(-1), t.reshape(-1)) for i in loads) for t in stores):
        return None
    return KernelEvidence(kernel=k.id, predicted_bitexact=1.0, naive_bitexact=1.0,
                          elements=sum(t.numel() for t in stores), note="a copy: every store equals a load")


CUDA_ONLY = "replays on CUDA only"  # a kernel whose code the CPU cannot run yet: never counted as proven


def kernel_language(k: Kernel) -> str:
    """The language of a kernel's recorded code, which decides how it is replayed (the device its tensors lived on
    does not): "cpp" (Inductor's C++ kernels), "triton", or "" (no code recorded: its ops as ATen computes them)."""
    code = k.code or ""
    if 'extern "C"' in code:
        return "cpp"
    if "@triton.jit" in code:
        return "triton"
    return ""


def triton_lanes(k: Kernel, record: KernelRecord | None = None) -> int:
    """The lanes a Triton kernel sums each row over (`ordered_sum`): a persistent reduction's R0_BLOCK from its code,
    or a looped one's from its recorded launch (`KernelRecord.launch`: each lane accumulates its chunk across the
    loop, then the block's tree); 0 where it sums nothing or the launch was not recorded."""
    code = k.code or ""
    if kernel_language(k) != "triton" or "tl.sum(" not in code:
        return 0
    launch = record.get("launch", {}) if record is not None else {}
    return triton_sum_lanes(code) or launch.get("R0_BLOCK", 0)


def cpu_replayable(k: Kernel, record: KernelRecord | None = None) -> str:
    """Why the CPU cannot replay the kernel's code ("" where it can). A Triton kernel replays where its summation
    order is known (`triton_lanes`: pointwise, a persistent reduction, or a looped one whose launch blocks were
    recorded); otherwise the autotuner chose its blocks at launch and nothing kept them."""
    code = k.code or ""
    if kernel_language(k) == "triton" and ("tl.sum(" in code or "welford" in code) and not triton_lanes(k, record):
        return f"{CUDA_ONLY}: a looped Triton reduction, whose summation blocks the autotuner chose at launch"
    return ""


def replay_kernel(graph: Graph, k: Kernel, record: KernelRecord, known: dict[str, str], owned: set[str],
                  compute: torch.dtype = torch.float32) -> tuple[KernelEvidence, dict[str, Any], dict[str, str]]:
    """The kernel's replay evidence; under the predicted model, every fragment value; and the read-only input buffers
    it placed for certain (buffer -> FX node), which later kernels reading the same buffer read too."""
    copied = copy_kernel(graph, k, record)  # values only: whatever its code, a copy is proven by its buffers
    if copied is not None:
        return copied, {}, {}
    if why := cpu_replayable(k, record):
        return KernelEvidence(kernel=k.id, predicted_bitexact=0.0, naive_bitexact=0.0, elements=0, error=why), {}, {}
    plan, external, unread, lanes = _replay_plan(graph, k, record, known, owned, compute)
    frag, syms = plan.frag, plan.syms
    binding = _bind(graph, k, record, known, frag, external, syms)
    best, error, placed = _best_assignment(graph, binding, plan, external, record)
    if best is None and (fewer := _best_of_fewer_inputs(graph, k, record, known, binding, plan)) is not None:
        (best, error, placed), plan, frag, external, dropped = fewer
        unread += dropped
    if best is None:
        return KernelEvidence(kernel=k.id, predicted_bitexact=0.0, naive_bitexact=0.0, elements=0, error=error), {}, {}
    _, inputs, outputs, values, _ = best
    read_only = {a.name for a in k.args if a.role == "in"}
    placed = {buf: node for buf, node in placed.items() if buf in read_only}
    ext_inputs = {e: inputs[e] for e in external if e in inputs}
    predicted, elements = score(values, outputs, record)
    note = f"{unread} listed nodes read values the kernel is not passed: not computed here" if unread else ""
    if predicted < 1.0 and (found := _reloaded(k, plan, ext_inputs, outputs, record, predicted)) is not None:
        plan, predicted, values = found
        note = "a store re-loaded by the kernel's later loop nest is read rounded there"
    if predicted < 1.0 and (found := _concats_read_back(plan, ext_inputs, outputs, record, predicted)) is not None:
        plan, predicted, values = found
        note = "; ".join(filter(None, [note, "a concatenation of its stores is read back from its buffer"]))
    predicted, explicit, values = _explicit_conversions(plan, ext_inputs, outputs, record, predicted, values)
    aten = _aten_order(plan, ext_inputs, outputs, record, explicit) if plan.ordered else None
    if aten is not None and (aten[0], -aten[1]) > (predicted, -fp32_error(values, outputs, record)):
        plan.ordered, (predicted, _, values) = {}, aten  # the kernel does not sum as its code was read: ATen's order
        aten = None
    math = _aten_math(plan, ext_inputs, outputs, record, explicit) if predicted == 1.0 else None
    naive_run = run_fragment(frag, ext_inputs, Declared(graph), "eager", syms)
    naive = score(naive_run.values, outputs, record)[0] if naive_run.ok else 0.0
    fp32 = fp32_error(values, outputs, record)
    added = (SUFFIX, FORM_SUFFIX)  # nodes a rewrite added: not values of the captured graph
    values = {n: v for n, v in values.items() if not n.endswith(added)}
    outputs = {b: n for b, n in outputs.items() if not n.endswith(added)}
    if elements == 0:  # FP32 stores only (a reduction's partials): the claim is FP32 throughout, up to sum order
        predicted, naive = (1.0 if fp32 <= FP32_ORDER_TOLERANCE else 0.0), 0.0
        note = f"FP32 stores only: max relative error {fp32:.1e} (accumulation order)"
    per_output = {buf: (score(values, {buf: node}, record)[0],
                        score(naive_run.values, {buf: node}, record)[0] if naive_run.ok else 0.0)
                  for buf, node in outputs.items() if getattr(record["out"].get(buf), "dtype", None) in LOW}
    return KernelEvidence(kernel=k.id, predicted_bitexact=predicted, naive_bitexact=naive, elements=elements,
                          fp32_max_rel_error=fp32, outputs=outputs, explicit_roundings=explicit, per_output=per_output,
                          note=note, reduction_lanes=lanes if plan.ordered else 0,
                          aten_order_bitexact=aten[0] if aten is not None else None,
                          aten_order_fp32_error=aten[1] if aten is not None else None,
                          aten_math_bitexact=math), values, placed


def _replay_plan(graph: Graph, k: Kernel, record: KernelRecord, known: dict[str, str], owned: set[str],
                 compute: torch.dtype) -> tuple[_Plan, list[str], int, int]:
    """The kernel's fragment as its code computes it (read values, two-step variance, row sums in its lanes): its
    plan, inputs, how many listed nodes read values the kernel is not passed, and the lanes its rows are summed in."""
    frag, external = kernel_fragment(graph, k, owned)
    syms = bind_symbols(graph, record)
    frag, external = passed_values(k, known, frag, external)
    frag, external, unread = readable_fragment(graph, k, record, known, frag, external, syms)
    cpp = kernel_language(k) == "cpp"
    if cpp and "welford" not in k.code:
        frag = two_step_variance(frag, graph.node_map())
    lanes = cpp_sum_lanes(k.code or "") or triton_lanes(k, record)
    in_frag = {**graph.node_map(), **{n.name: n for n in frag}}
    ordered = {n.name: lanes for n in frag if lanes and is_row_reduction(n, in_frag)}
    return _Plan(frag, Declared(graph), frozenset(), syms, cpp, compute, ordered), external, unread, lanes


def _best_of_fewer_inputs(graph: Graph, k: Kernel, record: KernelRecord, known: dict[str, str], binding: _Binding,
                          plan: _Plan) -> tuple[tuple, _Plan, list[Node], list[str], int] | None:
    """Where the fragment has more unnamed inputs than the kernel has buffers (`fewer_inputs`): the choice of inputs
    that replays best, as (its `_best_assignment`, its plan, fragment and inputs, the nodes it lost); None where no
    choice replays."""
    found, best = None, None
    for fewer, ext, lost in fewer_inputs(binding, plan.frag):
        trial = _Plan(fewer, plan.declared, plan.rounded, plan.syms, plan.cpp, plan.compute,
                      {n: v for n, v in plan.ordered.items() if any(f.name == n for f in fewer)})
        got = _best_assignment(graph, _bind(graph, k, record, known, fewer, ext, plan.syms), trial, ext, record)
        if got[0] is not None and (best is None or got[0][0] > best):
            found, best = (got, trial, fewer, ext, lost), got[0][0]
    return found


def _aten_math(plan: _Plan, inputs: dict[str, Any], outputs: dict[str, str], record: KernelRecord,
               explicit: list[str]) -> float | None:
    """Bit-exact fraction of the same replay with ATen's eager math for the INDUCTOR_MATH ops of a C++ kernel's
    fragment (None where it has none): below the predicted one, the evidence that the kernel computes them with
    Inductor's math (analysis.math_ops)."""
    if not plan.cpp or not any(op_name(n.target) in INDUCTOR_MATH for n in plan.frag):
        return None
    aten = _Plan(plan.frag, plan.declared, plan.rounded, plan.syms, False, plan.compute, plan.ordered)
    run = aten.run(inputs, set(explicit))
    return score(run.values, outputs, record)[0] if run.ok else None


def _aten_order(plan: _Plan, inputs: dict[str, Any], outputs: dict[str, str], record: KernelRecord,
                explicit: list[str]) -> tuple[float, float, dict[str, Any]] | None:
    """(bit-exact, FP32 error, values) of the same replay with ATen's sum order: the evidence for the order."""
    aten = _Plan(plan.frag, plan.declared, plan.rounded, plan.syms, plan.cpp, plan.compute)
    run = aten.run(inputs, set(explicit))
    if not run.ok:
        return None
    return score(run.values, outputs, record)[0], fp32_error(run.values, outputs, record), run.values
