"""Align training-graph values with engine-graph values.

The two graphs decompose differently (rotate_half+cat vs split/sub/cat, separate q/k/v vs a
packed qkv projection, [batch, seq, heads, dim] vs [tokens, heads, dim]), so nodes are not
aligned by structure. Instead:
- anchors narrow the candidates: the layer index and the module path (HF and vLLM name
  modules after the same checkpoint), and the element count;
- a numeric fingerprint decides: both sides computed their values on the same tokens with
  the same weights, so the sorted values of a matching pair agree up to rounding noise
  (sorting makes the comparison invariant to layout, transposes and reshapes).
Each match carries its evidence and a confidence; unmatched values are listed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdiff.analysis.rounding import is_view
from graphdiff.ops import CASTS, op_name
from graphdiff.records import Graph, Node, layer_of, walk

TOLERANCE = 0.015  # relative L2 distance of sorted values accepted as "the same value"
SAME_LAYER_PREFERENCE = 1.5  # a neighbouring layer's candidate must be this much closer to win


@dataclass
class Match:
    train: str
    engine: str
    distance: float  # relative L2 distance of the sorted values
    confidence: float  # 1 at distance 0, 0 at the tolerance; lowered when the runner-up is close
    evidence: str
    runner_up: float = TOLERANCE  # distance of the next distinct candidate (the tolerance when there is none)


def modules_compatible(a: str | None, b: str | None, same_layer: bool) -> bool:
    la, lb = layer_of(a), layer_of(b)
    if same_layer:
        if la != lb:
            return False
        if not a or not b:
            return True
        return a.startswith(b) or b.startswith(a) or a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0]
    # A value computed at the end of one layer may be computed by the engine at the start of
    # the next (a residual sum re-done inside the next norm kernel), or in the final norm.
    return la != lb and (la is None or lb is None or abs(la - lb) == 1)


def align_module_roots(train: Graph, engine_graphs: list[Graph]) -> dict[str, str]:
    """Rename, in place, each engine module root the trainer does not have to the trainer's root that holds the
    same submodules (vLLM's Transformers backend registers HF's base model as `model`, HF names it after the
    architecture, `gpt_neox`): matching and regions then see one module per path. Returns the renames."""
    def split(path: str) -> tuple[str, str]:
        head, _, rest = path.partition(".")
        return head, rest

    def by_root(paths: set[str]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for path in paths:
            head, rest = split(path)
            out.setdefault(head, set()).add(rest)
        return out

    theirs = by_root({n.module for n in train.nodes if n.module})
    ours = by_root({n.module for g in engine_graphs for n in g.nodes if n.module})
    renames: dict[str, str] = {}
    for root, rests in ours.items():
        if root in theirs:
            continue
        shared = {t: len(rests & r) for t, r in theirs.items() if t not in ours}
        best = max(shared, key=lambda t: shared[t], default=None)
        if best is not None and 2 * shared[best] >= len(rests):
            renames[root] = best
    for g in engine_graphs:
        for n in g.nodes:
            if n.module and split(n.module)[0] in renames:
                head, rest = split(n.module)
                n.module = renames[head] + ("." + rest if rest else "")
    return renames


def best_match(name: str, scored: list[tuple], layer: int | None, module: str | None, what: str) -> Match:
    """The match to the best of `scored` (candidates sorted by distance, best first: distance, ..., engine node in
    the fourth field), with its margin over the next distinct candidate and its confidence, 1 at distance 0, 0 at the
    tolerance, lowered when the runner-up is close; `what` describes the compared values after the engine module."""
    best = scored[0]
    distinct = [s for s in scored[1:] if s[0] > best[0] * 1.5 + 1e-6]
    margin = distinct[0][0] if distinct else TOLERANCE
    confidence = max(0.0, 1.0 - best[0] / TOLERANCE) * min(1.0, margin / max(TOLERANCE / 5, 1e-9))
    return Match(name, best[3], best[0], round(confidence, 3),
                 f"layer {layer}, module {module or '?'}{what}; sorted-value distance {best[0]:.2e} "
                 f"(runner-up {margin:.2e})", margin)


def op_kind(node: Node) -> str:
    name = op_name(node.target)
    return "cast" if name in CASTS else name


FINGERPRINT_POINTS = 4096


def quantile_index(numel: int, points: int) -> torch.Tensor:
    """`points` evenly spaced indices into `numel` sorted values, first and last included (in float64: float32
    cannot hold every index past 2**24, and rounds the last one past the end)."""
    return torch.linspace(0, numel - 1, points, dtype=torch.float64).round().long()


def sorted_fingerprint(v: torch.Tensor) -> torch.Tensor:
    """Sorted values, reduced to evenly spaced quantiles for large tensors (the distance is a
    relative L2 norm, which the quantiles estimate without comparing millions of values)."""
    s = v.detach().float().reshape(-1).sort().values.double()
    if s.numel() > FINGERPRINT_POINTS:
        s = s[quantile_index(s.numel(), FINGERPRINT_POINTS)]
    return s


def match_values(train: Graph, train_values: dict[str, object], engine: Graph,
                 engine_values: dict[str, torch.Tensor]) -> tuple[list[Match], list[str]]:
    """Match every floating-point compute node of the training graph to an engine node."""
    enodes = engine.node_map()
    # Candidates indexed by (element count, layer): the layer anchor keeps matching linear in depth.
    by_key: dict[tuple[int, int | None], list[str]] = {}
    for name, ev in engine_values.items():
        if isinstance(ev, torch.Tensor) and ev.is_floating_point() and name in enodes:
            by_key.setdefault((ev.numel(), layer_of(enodes[name].module)), []).append(name)
    cache: dict[str, torch.Tensor] = {}

    def fingerprint(name: str, v: torch.Tensor) -> torch.Tensor:
        if name not in cache:
            cache[name] = sorted_fingerprint(v)
        return cache[name]

    matches: list[Match] = []
    unmatched: list[str] = []
    for t in train.nodes:
        v = train_values.get(t.name)
        if t.op != "call_function" or is_view(t) or not isinstance(v, torch.Tensor) or not v.is_floating_point():
            continue
        if v.numel() < 2:  # one value: matched only where parameters alone make it (xIELU's softplus of its alphas)
            one = _one_value_match(t, v, train, engine, engine_values, by_key.get((1, layer_of(t.module)), []))
            if one is not None:
                matches.append(one)
            continue
        tv = fingerprint("t:" + t.name, v)
        scale = float(tv.norm()) or 1.0
        layer = layer_of(t.module)
        near: dict[bool, list[tuple[float, bool, int, str]]] = {}
        for same_layer in (True, False):  # the own layer, and the neighbouring layers (and no layer)
            if same_layer:
                layers: list[int | None] = [layer]
            else:
                layers = [None] if layer is not None else []
                layers += [layer - 1, layer + 1] if layer is not None else sorted(
                    {k[1] for k in by_key if k[0] == v.numel() and k[1] is not None})
            found = []
            for e in (e for ly in layers for e in by_key.get((v.numel(), ly), [])):
                if modules_compatible(t.module, enodes[e].module, same_layer):
                    d = float((fingerprint("e:" + e, engine_values[e]) - tv).norm()) / scale
                    # Equal values are common (a cast that is a no-op in FP32, a view): prefer the
                    # same kind of op, then the later node (the value as its consumers see it).
                    found.append((round(d, 6), op_kind(enodes[e]) != op_kind(t), -engine.position(e), e))
            near[same_layer] = sorted(found)
        # The own layer wins unless a neighbouring layer's value is much closer: a residual sum the engine
        # re-computes in the next layer's norm kernel can otherwise lose to an unrelated own-layer value that is
        # merely within the tolerance (a long prompt's residual is dominated by one MLP output).
        own, other = ([x for x in near[k] if x[0] <= TOLERANCE] for k in (True, False))
        scored = near[True] if own and not (other and other[0][0] * SAME_LAYER_PREFERENCE < own[0][0]) else (
            near[False] if other else [])
        if not scored:
            unmatched.append(t.name)
            continue
        matches.append(best_match(t.name, scored, layer, enodes[scored[0][3]].module, f", {v.numel()} values"))
    return matches, unmatched


def _one_value_match(t: Node, v: torch.Tensor, train: Graph, engine: Graph, engine_values: dict[str, torch.Tensor],
                     candidates: list[str]) -> Match | None:
    """A one-element trainer value made from parameters alone (xIELU's softplus of its alphas) matched to the engine
    value made from the same parameters (by name) that is nearest it within the tolerance, the later on a tie (its
    value as its consumers see it); None where it reads an activation or nothing is near. Its value alone says too
    little: two such values of one module are often within the tolerance of each other."""
    own = _parameters_of(train, t.name)
    if not own:
        return None
    nodes = engine.node_map()
    found = []
    for e in candidates:
        ev = engine_values.get(e)
        if ev is None or nodes[e].op != "call_function" or _parameters_of(engine, e) != own:
            continue
        d = abs(float(ev) - float(v)) / (abs(float(v)) or 1.0)
        if d <= TOLERANCE:
            found.append((round(d, 6), op_kind(nodes[e]) != op_kind(t), -engine.position(e), e))
    if not found:
        return None
    found.sort()
    return best_match(t.name, found, layer_of(t.module), nodes[found[0][3]].module,
                      ", one value made from the parameters " + ", ".join(sorted(own)))


def _parameters_of(graph: Graph, name: str) -> frozenset[str]:
    """The parameters (by name) a value is made from; empty where it reads anything else (an activation, a
    constant-free input)."""
    nodes = graph.node_map()
    back = walk([name], lambda n: [i for i in nodes[n].inputs if i in nodes])
    placeholders = [i for i in back if nodes[i].op == "placeholder"]
    if not placeholders or any(i not in graph.inputs for i in placeholders):
        return frozenset()
    return frozenset(graph.inputs[i] for i in placeholders)


def repeated_part(v: torch.Tensor) -> tuple[int, int, torch.Tensor] | None:
    """(dim, r, the value once) where `v` repeats one value r times along a dimension, each entry in turn (keys
    broadcast to every query head of their group: Falcon's `torch.broadcast_to(key, query.shape)`) or the whole in
    turn; None where it repeats nothing. The most repeats first: a key repeated 4 times also repeats its pair twice,
    and the value once is the one key."""
    for dim, size in enumerate(v.shape):
        for r in range(size, 1, -1):
            if size % r:
                continue
            for parts in ((size // r, r), (r, size // r)):  # each entry r times; the whole r times
                at = dim + 1 if parts[1] == r else dim
                split = v.unflatten(dim, parts)
                first = split.narrow(at, 0, 1)
                if torch.equal(split, first.expand_as(split)):
                    return dim, r, first.squeeze(at)
    return None


def match_repeated(train: Graph, train_values: dict[str, object], engine: Graph,
                   engine_values: dict[str, torch.Tensor], names: list[str]) -> list[Match]:
    """Trainer values `names` that repeat one value along a dimension (`repeated_part`) matched to the engine value
    that holds it once (the engine's keys, one per KV head): same layer and compatible module, the sorted values of
    the value once within the tolerance."""
    enodes, tnodes = engine.node_map(), train.node_map()
    by_key: dict[tuple[int, int | None], list[str]] = {}
    for name, ev in engine_values.items():
        if isinstance(ev, torch.Tensor) and ev.is_floating_point() and name in enodes:
            by_key.setdefault((ev.numel(), layer_of(enodes[name].module)), []).append(name)
    out = []
    for name in names:
        t, v = tnodes[name], train_values.get(name)
        if not (isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 2):
            continue
        part = repeated_part(v)
        if part is None or part[2].unique().numel() < 2:  # a constant repeats along any dimension
            continue
        once = sorted_fingerprint(part[2])
        scale = float(once.norm()) or 1.0
        scored = sorted((round(float((sorted_fingerprint(engine_values[e]) - once).norm()) / scale, 6),
                         op_kind(enodes[e]) != op_kind(t), -engine.position(e), e)
                        for e in by_key.get((part[2].numel(), layer_of(t.module)), [])
                        if modules_compatible(t.module, enodes[e].module, True))
        if not scored or scored[0][0] > TOLERANCE:
            continue
        out.append(best_match(name, scored, layer_of(t.module), enodes[scored[0][3]].module,
                              f": the value once ({part[2].numel()} of {v.numel()} values, {part[1]} times along "
                              f"dim {part[0]})"))
    return out
