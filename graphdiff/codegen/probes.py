"""Probe tensors shaped as the trainer capture's values, and the emitted code run at another token count than the
captured one (a size of the capture baked in fails there)."""

from __future__ import annotations

import torch

from graphdiff.codegen.fragment import Fragment
from graphdiff.errors import first_line
from graphdiff.records import Node


def _probe_shape(node: Node, tokens: int = 0, other: int = 0, outer_only: bool = False) -> list[int]:
    """The node's captured shape (a symbolic size as 8), with the captured token count `tokens` made `other`:
    every size equal to it, or (`outer_only`) the outermost one only."""
    shape = [s if isinstance(s, int) else 8 for s in (node.shape or [])]
    hits = [k for k, s in enumerate(shape) if tokens and s == tokens][:1 if outer_only else None]
    return [other if k in hits else s for k, s in enumerate(shape)]


def probe(node: Node, gen: torch.Generator, tokens: int = 0, other: int = 0, outer_only: bool = False
          ) -> torch.Tensor:
    """A seeded tensor of the node's dtype and shape; integers are 0 or 1, valid as token ids and positions (an
    embedding's ids: Gemma's scaled embedding, a region wherever sqrt(hidden) is no BF16 value)."""
    shape = _probe_shape(node, tokens, other, outer_only)
    dtype = getattr(torch, node.dtype or "float32")
    if not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        return torch.randint(0, 2, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def other_length_problem(frag: Fragment, nodes: dict[str, Node], tokens: int) -> str:
    """The emitted code run at another token count than the captured one: it must run and give each output its
    captured shape with that count (a size baked in from the capture fails here); "" when it does. A feature size
    that equals the captured count (GPT-NeoX's rotary dimension 16 at 16 tokens) makes the probe ambiguous: the
    code passes if it runs with every such size changed, or with only each input's outermost one."""
    if tokens < 2 or frag.compiled is None:  # one token, or nothing emitted: nothing to run at another count
        return ""
    problems = [_at_other_length(frag, nodes, tokens, outer_only) for outer_only in (False, True)]
    return "" if "" in problems else problems[0]


def _at_other_length(frag: Fragment, nodes: dict[str, Node], tokens: int, outer_only: bool) -> str:
    assert frag.compiled is not None
    other = tokens + 5
    gen = torch.Generator().manual_seed(1)
    # a parameter or buffer keeps its size (Phi's tiny inv_freq has 16 entries, as the captured prompt has tokens)
    probes = [probe(nodes[i], gen, *((tokens, other, outer_only) if nodes[i].param is None else ()))
              for i in frag.inputs]
    try:
        with torch.no_grad():
            outs = frag.compiled(*probes, align=frozenset(frag.regions))
    except Exception as e:  # the emitted code's own failure at that size is the finding
        return f"the emitted code does not run at {other} tokens (captured at {tokens}): {first_line(e)[:120]}"
    for o, name in zip(outs, frag.outputs):
        if not _follows(list(o.shape), _probe_shape(nodes[name]), tokens, other):
            return (f"the emitted code gives {name} the shape {list(o.shape)} at {other} tokens, not "
                    f"{_probe_shape(nodes[name], tokens, other)}: a size of the capture is baked in")
    return ""


def _follows(shape: list[int], captured: list[int], tokens: int, other: int) -> bool:
    """Is `shape` the `captured` shape at `other` tokens? Each size the captured count is follows the count or, a
    feature size that happens to equal it (GPT-NeoX's rotary dimension 16 at 16 tokens), keeps it; one follows."""
    if len(shape) != len(captured):
        return False
    same = all(s == c or (c == tokens and s == other) for s, c in zip(shape, captured))
    return same and (tokens not in captured or other in shape)
