"""Stores that a later loop nest of the same generated kernel reads back.

Inductor's C++ kernels with a reduction have two loop nests: the first computes up to the reduction (and stores
what it must), the second computes what depends on the reduction. A value the first nest stores in low precision
is either recomputed in FP32 by the second nest, or re-loaded from its store (`loadu(out_ptr0 ...)`, read from the
kernel's code): then the second nest's consumers read the *rounded* value while the first nest's (the sum of
squares) used the FP32 register. One value per node cannot say that, so the fragment is rewritten: those
consumers read a rounded copy (Granite's and Cohere's residual + norm kernels: 87% -> 100% replayed). Without a
reduction, a value one loop nest stores and the next reads back is read rounded by all its consumers (Apertus's
xIELU: its parameters' softplus, 63.6% -> 100%).
"""

from __future__ import annotations

import copy
import re

from graphdiff.model import Kernel, Node
from graphdiff.ops import is_low, op_name

REDUCTIONS = frozenset({"mean", "sum", "amax", "amin", "var", "var_mean", "max", "min", "prod", "logsumexp"})
SAME_VALUE = frozenset({"convert_element_type", "_to_copy", "view", "reshape", "_unsafe_view", "expand", "permute",
                        "clone", "unsqueeze", "squeeze", "alias"})
SUFFIX = "__reloaded"


def reloaded_stores(k: Kernel) -> list[str]:
    """FX nodes whose low-precision store the kernel's own code reads back (`out_ptrN` loaded). C++ and Triton
    kernels name their store parameters out_ptr0, out_ptr1, ... in the order of the out args."""
    body = (k.code or "").split("{", 1)[-1]
    found = []
    for i, a in enumerate(a for a in k.args if a.role == "out"):
        if a.node and is_low(a.dtype) and re.search(rf"(loadu\(\s*out_ptr{i}\b|=\s*out_ptr{i}\s*\[)", body):
            found.append(a.node)
    return found


def loop_nests(code: str) -> list[str]:
    """The kernel's outermost `for` loops, each with its body, in code order (one per loop nest)."""
    body = code.split("{", 1)[-1] if 'extern "C"' in code else code
    nests, pos = [], 0
    for m in re.finditer(r"\bfor\s*\(", body):
        if m.start() < pos:
            continue  # inside the previous nest
        depth, i = 0, m.end() - 1
        while i < len(body):  # the loop header's closing parenthesis
            depth += {"(": 1, ")": -1}.get(body[i], 0)
            if depth == 0:
                break
            i += 1
        j = body.find("{", i)
        if j < 0:
            break
        depth, k = 0, j
        while k < len(body):  # the body's closing brace
            depth += {"{": 1, "}": -1}.get(body[k], 0)
            if depth == 0:
                break
            k += 1
        nests.append(body[m.start():k + 1])
        pos = k + 1
    return nests


def stored_outside_reductions(k: Kernel) -> list[str]:
    """Re-loaded stores (`reloaded_stores`) whose storing loop nest computes no reduction: every consumer of such a
    value runs in a later nest and reads the store."""
    outs = [a for a in k.args if a.role == "out"]
    nests = loop_nests(k.code or "")
    found = []
    for node in reloaded_stores(k):
        i = next(i for i, a in enumerate(outs) if a.node == node)
        store = re.compile(rf"(\.store\(\s*out_ptr{i}\b|\bout_ptr{i}\s*\[[^\]]*\]\s*=[^=])")
        storing = [n for n in nests if store.search(n)]
        if storing and not any("tmp_acc" in n for n in storing):
            found.append(node)
    return found


def _depends(frag: list[Node]) -> dict[str, set[str]]:
    inside, deps = {n.name for n in frag}, {}
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


def reload_variant(frag: list[Node], stored: list[str],
                   everywhere: list[str] | tuple[str, ...] = ()) -> tuple[list[Node], set[str]]:
    """The fragment with the after-reduction uses of each re-loaded store reading its rounded value (every use, for
    the stores in `everywhere`: stored by a loop nest without a reduction); returns the new node list and the added
    nodes to round (named `<node>__reloaded`)."""
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
        after = [r for r in reductions if s in deps[r]] if s not in everywhere else []
        # after a reduction that reads it: the consumers past that reduction (the second loop nest); with none,
        # every consumer (a scalar computed and stored by a first loop nest, read back by the next: xIELU's
        # softplus of its parameters)
        later = [u for c in chain for u in users.get(c, []) if u not in chain
                 and (not after or any(r in deps[u] for r in after))]
        if not later:
            continue
        alias = {s: s + SUFFIX}
        src = by[s]
        added = [Node(name=s + SUFFIX, op="call_function", target="prims.convert_element_type.default", inputs=[s],
                      call=[[{"node": s}, {"dtype": src.dtype}], {}], dtype=src.dtype, shape=src.shape)]
        rounded.add(s + SUFFIX)
        for c in chain[1:]:  # re-apply the chain's casts for the later consumers
            cn = copy.deepcopy(by[c])
            cn.name, cn.call = c + SUFFIX, _swap(cn.call, alias)
            cn.inputs = [alias.get(i, i) for i in cn.inputs]
            alias[c] = cn.name
            added.append(cn)
        pos = {n.name: i for i, n in enumerate(out)}
        for u in later:
            out[pos[u]].call = _swap(out[pos[u]].call, alias)
            out[pos[u]].inputs = [alias.get(i, i) for i in out[pos[u]].inputs]
        first = min(pos[u] for u in later)
        out[first:first] = added
    return out, rounded
