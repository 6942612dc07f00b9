"""Which outputs of the cut fragments may leave their splice in FP32 (`Fragment.keep_fp32`, `fp32_with`): where every
consumer reads them as the engine does while the regions it needs are aligned."""

from __future__ import annotations

from graphdiff.codegen.fragment import Fragment, is_add, is_boundary
from graphdiff.ops import CASTS, EXACT, MATMULS, op_name
from graphdiff.records import Graph, layer_of, walk
from graphdiff.runtime import module_regex


def decide_outputs(graph: Graph, frags: list[Fragment], attention: dict[str, str] | None = None,
                   replaced: dict[str, str] | None = None) -> None:
    """May an output that an aligned site leaves in FP32 cross the splice boundary unrounded?

    Yes when every consumer is re-emitted by the patch (it reads FP32 and rounds where the engine
    stores), a matmul (the runtime rounds nn.Linear inputs to the weight dtype: the engine stores
    matmul inputs in BF16), or plain elementwise code whose results only reach matmuls (SwiGLU's
    `act(gate) * up` stays FP32 by type promotion, as it does in the engine's fused kernel).
    Also, while the attention regions it reaches are aligned, when the unpatched code it feeds only reaches
    matmuls and the attention ops in `attention` (op node -> region; their splice rounds its inputs to BF16 as the
    engine stores them): a rotary embedding's FP32 cos/sin, which the engine's RoPE kernel reads in FP32 and HF's
    `q * cos + rotate_half(q) * sin` then computes in FP32 by type promotion, rounded once by the engine's op.
    Also, while the carry regions are aligned, when it feeds a carried module's own residual add (a post-norm's
    output: the engine's fused add reads it unrounded, the carried FP32 residual sums it in FP32); and while the
    experts regions of `replaced` are aligned, when it feeds their modules (the splice reads it rounded, as the
    engine's fused-MoE op loads its BF16 store).
    Otherwise (attention, unpatched code) the value is rounded at the boundary.
    """
    r = _Reach(graph, frags, attention or {})
    within = [(module_regex(m), region) for m, region in (replaced or {}).items()]
    for f in frags:
        for o in f.outputs:
            ok, carried = True, set()
            for u in r.through_views(o):
                if u in r.patched:  # re-emitted: it reads FP32 as the engine does while its own regions are aligned
                    carried.update(r.patched[u])
                    continue
                if r.matmul(u):
                    continue
                if (regions := r.carried_add(u)) is not None:
                    carried.update(regions)
                    continue
                if (region := next((g for rx, g in within if rx.fullmatch(r.nodes[u].module or "")), None)):
                    carried.add(region)
                    continue
                n = r.nodes[u]
                if not is_boundary(n) and n.op == "call_function" and all(r.matmul(w) for w in r.through_views(u)):
                    continue
                ok = False
            reached = None if ok or not attention else r.reached_attention(o)
            f.keep_fp32[o] = ok or bool(reached)
            if f.keep_fp32[o] and (reached or carried):
                f.fp32_with[o] = sorted(set(reached or []) | carried)


def served_nodes(graph: Graph, frags: list[Fragment]) -> dict[str, list[str]]:
    """The nodes the splices of `frags` re-emit in every layer they serve, each with its splice's regions: a fragment
    is cut at its representative layer, and its splice runs that code in each layer whose module its pattern matches
    (of its group, `layers`); a function splice only the nodes of its own frames (the caller's forward is not
    replaced)."""
    out: dict[str, list[str]] = {}
    for f in frags:
        out.update({n.name: f.regions for n in f.nodes})
        rx = module_regex(f.module)
        frames = {n.source.function for n in f.nodes if n.source is not None}
        for n in graph.nodes:
            if n.op != "call_function" or not rx.fullmatch(n.module or ""):
                continue
            if f.layers and layer_of(n.module) not in f.layers:
                continue
            if f.target == "function" and (n.source is None or n.source.function == "forward"
                                           or n.source.function not in frames):
                continue
            out[n.name] = f.regions
    return out


class _Reach:
    """What the consumers of a fragment's output are (decide_outputs): re-emitted code, matmuls, a carried
    module's residual add, or the attention ops of `attention` (op node -> region)."""

    def __init__(self, graph: Graph, frags: list[Fragment], attention: dict[str, str]) -> None:
        self.nodes, self.users, self.attention = graph.node_map(), graph.users(), attention
        self.patched = served_nodes(graph, [f for f in frags if not f.problems and f.target != "carry"])
        self.carries = [(module_regex(f.module), f.regions) for f in frags if not f.problems and f.target == "carry"]

    def matmul(self, u: str) -> bool:
        return op_name(self.nodes[u].target) in MATMULS

    def through_views(self, name: str) -> list[str]:
        out = []
        for u in self.users.get(name, []):
            if op_name(self.nodes[u].target) in ("view", "_unsafe_view", "reshape", "transpose", "t", "permute") \
                    and u not in self.patched:
                out += self.through_views(u)
            else:
                out.append(u)
        return out

    def carried_add(self, u: str) -> list[str] | None:
        """The carry regions of the module whose own residual add `u` is: with them aligned it sums in FP32 (the
        residual carried in FP32, type promotion), as the engine's fused add reads a norm's unrounded output."""
        if not is_add(self.nodes[u]):
            return None
        return next((regions for rx, regions in self.carries if rx.match(self.nodes[u].module or "")), None)

    def reached_attention(self, name: str) -> list[str] | None:
        """The attention regions the unpatched code fed by `name` reaches, if it reaches only them and matmuls and
        computes on the way (through data movement alone, rounding at the boundary is the attention op's rounding)."""
        def readers(u: str) -> list[str]:  # re-emitted code reads FP32, rounds as the engine: the walk stops there
            return [w for w in self.users.get(u, []) if not self.matmul(w) and w not in self.patched]

        regions: set[str] = set()
        computes = False
        for w in walk([name], readers, through=lambda w: w not in self.attention):
            if w in self.attention:
                regions.add(self.attention[w])
            elif is_boundary(self.nodes[w]) or self.nodes[w].op != "call_function":
                return None
            else:
                computes = computes or op_name(self.nodes[w].target) not in EXACT | CASTS
        return sorted(regions) if computes else None
