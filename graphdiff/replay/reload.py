"""Stores that a later loop nest of the same generated kernel reads back.

Inductor's C++ kernels with a reduction have two loop nests: the first computes up to the reduction (and stores
what it must), the second computes what depends on the reduction. A value the first nest stores in low precision
is either recomputed in FP32 by the second nest, or re-loaded from its store (`loadu(out_ptr0 ...)`, read from the
kernel's code): then the second nest's consumers read the *rounded* value while the first nest's (the sum of
squares) used the FP32 register. One value per node cannot say that, so the fragment is rewritten: those
consumers read a rounded copy (Granite's and Cohere's residual + norm kernels). Without a
reduction, a value one loop nest stores and the next reads back is read rounded by all its consumers (Apertus's
xIELU: its parameters' softplus). A store the kernel updates in place (`in_out_ptrN`) is re-loaded
when a loop nest after the one that stores it loads it. Where the storing loop nest computes nothing else (no
reduction, no other store: GPT-2's and OPT's final residual re-sum, stored in place, before LayerNorm's mean,
variance and normalize nests), every consumer is in a later nest and reads the rounded value, the reductions too.
"""

from __future__ import annotations

import copy
import re

from graphdiff.ops import is_low, op_name
from graphdiff.records import Kernel, Node

REDUCTIONS = frozenset({"mean", "sum", "amax", "amin", "var", "var_mean", "max", "min", "prod", "logsumexp"})
SAME_VALUE = frozenset({"convert_element_type", "_to_copy", "view", "reshape", "_unsafe_view", "expand", "permute",
                        "clone", "unsqueeze", "squeeze", "alias"})
SUFFIX = "__reloaded"


_PARAMS = re.compile(r'extern "C"\s+void\s+\w+\s*\(([^)]*)\)')
_ALIAS = re.compile(r"\bauto\s+(\w+)\s*=\s*(\w+)\s*;")
_NEST = re.compile(r"for\s*\(\s*int64_t\s+x0\s*=")  # the outer loop of each loop nest


def _pointers(k: Kernel) -> dict[str, str]:
    """Each store argument's (out/inout) pointer name in the kernel's code. The C++ signature lists the parameters
    in the order of the call's args (an out pointer's number can skip one that aliases an in/out buffer:
    `auto out_ptr0 = in_out_ptr1;`); without it, out args are out_ptr0, out_ptr1, ... in order."""
    m = _PARAMS.search(k.code or "")
    names = [p.strip().split()[-1].lstrip("*&") for p in m.group(1).split(",")] if m else []
    if m and len(names) == len(k.args):
        return {a.name: p for a, p in zip(k.args, names) if a.role in ("out", "inout")}
    outs = [a for a in k.args if a.role == "out"]
    inouts = [a for a in k.args if a.role == "inout"]
    return {**{a.name: f"out_ptr{i}" for i, a in enumerate(outs)},
            **{a.name: f"in_out_ptr{i}" for i, a in enumerate(inouts)}}


def _names(body: str, ptr: str) -> list[str]:
    """The pointer and the local names aliasing it."""
    return [ptr, *(a for a, b in _ALIAS.findall(body) if b == ptr)]


def _loads(text: str, names: list[str]) -> bool:
    return any(re.search(rf"(loadu\(\s*{p}\b|=\s*{p}\s*\[)", text) for p in names)


def _stores(text: str, names: list[str]) -> bool:
    return any(re.search(rf"(\.store\(\s*{p}\b|\b{p}\s*\[[^\]]*\]\s*=(?!=))", text) for p in names)


def _closing(text: str, i: int) -> int:
    """The index just past the brace that closes the one at `i` (len(text) where none does)."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return j + 1
    return len(text)


def _children(text: str, start: int, end: int) -> list[int]:
    """Where each statement of a `{...}` body (text[start:end], braces excluded) begins: a block, a braced loop,
    or a statement up to its `;` (a `#pragma` line joins the statement after it)."""
    starts, i = [], start
    while i < end:
        while i < end and text[i].isspace():
            i += 1
        if i >= end:
            break
        first = i
        if text.startswith("#", i):  # a pragma: part of what follows
            i = text.find("\n", i) + 1 or end
            while i < end and text[i].isspace():
                i += 1
        if i < end and text[i] == "{":
            i = _closing(text, i)
        elif text.startswith("for", i) and (brace := text.find("{", i, end)) != -1:
            i = _closing(text, brace)
        else:
            semi = text.find(";", i, end)
            i = end if semi == -1 else semi + 1
        starts.append(first)
    return starts


def _nests(body: str) -> list[str]:
    """The kernel's loop nests, in order (the whole body where no outer loop is recognized). Outer-loop fusion
    runs several nests inside one outer loop (`for x0 { {sum over x1} for x1 {normalize} }`: Inductor's
    OuterLoopFusedKernel, e.g. a residual + RMSNorm kernel on AVX2): each inner loop is a nest there."""
    starts = [m.start() for m in _NEST.finditer(body)]
    if not starts:
        return [body]
    nests = []
    for a, b in zip(starts, [*starts[1:], len(body)]):
        brace = body.find("{", a, b)
        if brace == -1:
            nests.append(body[a:b])
            continue
        inner = _children(body, brace + 1, _closing(body, brace) - 1)
        looped = [c for c, d in zip(inner, [*inner[1:], b]) if re.search(r"\bfor\s*\(", body[c:d])]
        if len(looped) < 2:
            nests.append(body[a:b])
            continue
        cuts = [a, *looped[1:], b]
        nests += [body[c:d] for c, d in zip(cuts, cuts[1:])]
    return nests


def _stored_args(k: Kernel) -> list[tuple[str, list[str], str]]:
    """(node, pointer names, role) of each low-precision store whose node is known."""
    body = (k.code or "").split("{", 1)[-1]
    ptrs = _pointers(k)
    return [(a.node, _names(body, ptrs[a.name]), a.role) for a in k.args
            if a.role in ("out", "inout") and a.node and is_low(a.dtype) and a.name in ptrs]


def _store_nest(nests: list[str], names: list[str]) -> int | None:
    return next((i for i, nest in enumerate(nests) if _stores(nest, names)), None)


def reloaded_stores(k: Kernel) -> list[str]:
    """FX nodes whose low-precision store the kernel's own code reads back: an out pointer loaded, or an in/out
    pointer loaded by a loop nest after the one that stores it (before, it is read as an input)."""
    body = (k.code or "").split("{", 1)[-1]
    nests = _nests(body)
    found = []
    for node, names, role in _stored_args(k):
        if role == "out":
            if _loads(body, names):
                found.append(node)
            continue
        first = _store_nest(nests, names)
        if first is not None and any(_loads(nest, names) for nest in nests[first + 1:]):
            found.append(node)
    return found


def stored_alone(k: Kernel) -> set[str]:
    """Re-loaded stores whose storing loop nest reduces nothing and stores nothing else: none of the value's
    consumers is computed from the FP32 register, all read it back rounded (the reductions too)."""
    body = (k.code or "").split("{", 1)[-1]
    nests = _nests(body)
    if len(nests) < 2:
        return set()
    reloaded = set(reloaded_stores(k))
    ptrs = [_names(body, p) for p in _pointers(k).values()]
    alone = set()
    for node, names, _ in _stored_args(k):
        i = _store_nest(nests, names)
        if node not in reloaded or i is None or "tmp_acc" in nests[i]:
            continue
        if not any(_stores(nests[i], other) for other in ptrs if other != names):
            alone.add(node)
    return alone


def nest_reductions(k: Kernel) -> dict[str, int]:
    """Re-loaded stores -> how many reductions their storing loop nest computes (`tmp_accN` accumulators): only
    those read the FP32 register; a reduction of the same value in a later nest reads the store (GPT-NeoX's two
    LayerNorms of one residual sum: the first mean from the registers, the second's from the BF16 store)."""
    body = (k.code or "").split("{", 1)[-1]
    nests = _nests(body)
    reloaded, out = set(reloaded_stores(k)), {}
    for node, names, _ in _stored_args(k):
        i = _store_nest(nests, names)
        if node in reloaded and i is not None:
            out[node] = len(set(re.findall(r"\bfloat\s+(tmp_acc\d+)\s*=", nests[i])))
    return out


def _depends(frag: list[Node]) -> dict[str, set[str]]:
    inside = {n.name for n in frag}
    deps: dict[str, set[str]] = {}
    for n in frag:  # graph order
        d: set[str] = set()
        for i in n.inputs:
            if i in inside:
                d |= {i, *deps.get(i, ())}
        deps[n.name] = d
    return deps


def _swap(a: object, alias: dict[str, str]) -> object:
    if isinstance(a, list):
        return [_swap(x, alias) for x in a]
    if isinstance(a, dict) and "node" in a:
        return {"node": alias.get(a["node"], a["node"])}
    if isinstance(a, dict) and "dict" in a:
        return {"dict": {k: _swap(v, alias) for k, v in a["dict"].items()}}
    return a


def _swap_call(call: list, alias: dict[str, str]) -> list:
    """A node's [args, kwargs] (Node.call) with its node references renamed by `alias`."""
    return [_swap(x, alias) for x in call]


def reload_variant(frag: list[Node], stored: list[str], alone: set[str] | frozenset[str] = frozenset(),
                   in_nest: dict[str, int] | None = None) -> tuple[list[Node], set[str]]:
    """The fragment with the after-reduction uses of each re-loaded store reading its rounded value (every use, for
    a store in `alone`: see `stored_alone`; with `in_nest`, every use but the first n reductions of the value and
    what feeds them, n its storing nest's reductions: see `nest_reductions`); returns the new node list and the
    added nodes to round (named `<node>__reloaded`)."""
    by = {n.name: n for n in frag}
    deps = _depends(frag)
    reductions = {n.name for n in frag if op_name(n.target) in REDUCTIONS}
    users: dict[str, list[str]] = {}
    for n in frag:
        for i in n.inputs:
            users.setdefault(i, []).append(n.name)
    out = [copy.deepcopy(n) for n in frag]
    rounded: set[str] = set()
    for s in (s for s in stored if s in by):
        chain = [s]
        for c in chain:  # the store and the casts/views that carry its value
            chain += [u for u in users.get(c, []) if op_name(by[u].target) in SAME_VALUE and u not in chain]
        after = [] if s in alone else [r for r in reductions if s in deps[r]]
        # after a reduction that reads it: the consumers past that reduction (the second loop nest); with none,
        # every consumer (a scalar computed and stored by a first loop nest, read back by the next: xIELU's
        # softplus of its parameters)
        later = [u for c in chain for u in users.get(c, []) if u not in chain
                 and (not after or any(r in deps[u] for r in after))]
        if in_nest is not None and s in in_nest:  # the storing nest's own reductions read the register
            direct = [r for r in by if r in reductions and s in deps[r] and not deps[r] & reductions]
            mine = direct[:in_nest[s]]
            feeding = {u for r in mine for u in (r, *deps[r]) if not deps[u] & reductions}
            later = [u for c in chain for u in users.get(c, []) if u not in chain and u not in feeding]
        if not later:
            continue
        alias = {s: s + SUFFIX}
        src = by[s]
        added = [Node(name=s + SUFFIX, op="call_function", target="prims.convert_element_type.default", inputs=[s],
                      call=[[{"node": s}, {"dtype": src.dtype}], {}], dtype=src.dtype, shape=src.shape)]
        rounded.add(s + SUFFIX)
        for c in chain[1:]:  # re-apply the chain's casts for the later consumers
            cn = copy.deepcopy(by[c])
            cn.name, cn.call = c + SUFFIX, _swap_call(cn.call, alias)
            cn.inputs = [alias.get(i, i) for i in cn.inputs]
            alias[c] = cn.name
            added.append(cn)
        pos = {n.name: i for i, n in enumerate(out)}
        for u in later:
            out[pos[u]].call = _swap_call(out[pos[u]].call, alias)
            out[pos[u]].inputs = [alias.get(i, i) for i in out[pos[u]].inputs]
        first = min(pos[u] for u in later)
        out[first:first] = added
    return out, rounded
