"""Closed-form gradients for the PyTorch path of a splice: an RMS norm's, a one-op activation's, a rotary embedding's.

Autograd through a splice's FP32 ops keeps activation-sized FP32 intermediates, so the runtime would run it under
checkpointing: its forward again in the backward, then autograd's reverse of every op, each a fresh FP32 tensor (on
the CPU a fresh tensor's page faults cost more than the op). Where the fragment is one of these forms, the patch
carries its gradient from the inputs alone, and the runtime runs the forward without autograd:

- an RMS norm `weight * round(x * rsqrt(mean(x²) + eps))` (x its input in FP32, `round` where the plan stores the
  normalized value; `rms_norm_backward`):

      n  = x * r,  r = rsqrt(mean(x²) + eps),  d_n = round(grad * weight)
      d_weight = Σ_rows grad * round(n)
      d_x      = r * (d_n - x * r² * mean(d_n * x))

  the same as autograd's up to the FP32 order of its sums (`check` holds it to that);
- a one-op activation (SiLU, GELU) on its FP32 input: ATen's own backward op of it (`activation_backward`), the
  gradient autograd computes, bit for bit (where the engine's Inductor math computes the forward, autograd's gradient
  is still the eager op's);
- a rotary embedding `x * cos + rotate_half(x) * sin` per rotated input (`rotary_backward`): grad * cos plus
  rotate_half's transpose of grad * sin, each half one add, as autograd sums it (bit for bit); it reads the cos and
  sin tables only, so the runtime keeps no rotated input (the tables' own gradient is autograd's: none in HF, where
  they are made from a buffer).

A rounding passes the gradient rounded to the stored dtype, as autograd through `.to` does. The forward is the emitted
function unchanged, so the patched values are the same bit for bit. `recognise` finds the form in the fragment (the ATen
ops HF's forward records); `emit` writes the generated module's `torch_<slug>_backward`, which calls the helpers the
patch carries as source (`PARTS`), and generation keeps it only where `check` finds it autograd's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphdiff.codegen.fragment import Fragment, rounding
from graphdiff.ops import op_name
from graphdiff.records import Node
from graphdiff.replay.sum_order import ordered_mean


def rms_norm_backward(grad: torch.Tensor, hidden_states: torch.Tensor, weight: torch.Tensor, eps: float,
                      round_normed: bool, lanes: int = 0, needs: tuple[bool, bool] = (True, True)
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d_hidden_states, d_weight) of `weight * round(x * rsqrt(mean(x²) + eps))`, x = hidden_states in FP32, the
    normalized value stored in BF16 where `round_normed`; the row mean in an engine kernel's order where `lanes`.
    Only the gradients `needs` asks for; each in its input's dtype. FP32 temporaries are updated in place: a fresh
    activation-sized tensor costs the CPU's allocator page faults that are most of an elementwise op's time."""
    x = hidden_states.float()
    squares = torch.pow(x, 2)
    variance = ordered_mean(squares, [-1], True, lanes) if lanes else torch.mean(squares, [-1], keepdim=True)
    del squares
    r = torch.rsqrt(variance + eps)
    d_weight = None
    if needs[1]:
        normed = x * r
        normed = normed.to(torch.bfloat16) if round_normed else normed
        d_weight = (grad.float() * normed).sum_to_size(weight.shape).to(weight.dtype)
        del normed
    if not needs[0]:
        return None, d_weight
    d_normed = grad.to(torch.float32, copy=True).mul_(weight.float())  # a copy: the incoming gradient is autograd's
    if round_normed:  # the gradient rounds where the value was stored, as autograd through `.to` rounds it
        d_normed = d_normed.to(torch.bfloat16).float()
    c = torch.mean(d_normed * x, [-1], keepdim=True).mul_(r).mul_(r)
    d_x = d_normed.addcmul_(x, c, value=-1).mul_(r)
    return d_x.to(hidden_states.dtype), d_weight


def activation_backward(op: str, grad: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """d_x of the FP32 activation `op` ("silu" or "gelu", `approximate` its form) of `x`: ATen's backward op, as
    autograd calls it; in x's dtype."""
    if op == "silu":
        d_x = torch.ops.aten.silu_backward(grad.float(), x.float())
    else:
        d_x = torch.ops.aten.gelu_backward(grad.float(), x.float(), approximate=approximate)
    return d_x.to(x.dtype)


def rotary_backward(grad: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    unsqueeze_dim: int) -> torch.Tensor:
    """d_x of `x * cos + rotate_half(x) * sin` (cos and sin unsqueezed at `unsqueeze_dim`, rotate_half(x) =
    cat(-x[..., h:], x[..., :h])) in x's dtype: grad * cos plus rotate_half's transpose of grad * sin, each half one
    add, as autograd sums it. It reads x's shape and dtype only (the runtime keeps no value of it)."""
    g = grad.float()
    h = x.shape[-1] // 2
    g_sin = g * sin.float().unsqueeze(unsqueeze_dim)
    d_x = g * cos.float().unsqueeze(unsqueeze_dim)
    d_x[..., :h] += g_sin[..., h:]
    d_x[..., h:] -= g_sin[..., :h]
    return d_x.to(x.dtype)


PARTS: tuple[Callable, ...] = (rms_norm_backward, activation_backward, rotary_backward)


@dataclass
class Activation:
    """A one-op activation fragment: its input and ATen op."""

    x: str
    op: str  # "silu" or "gelu"
    approximate: str = "none"


@dataclass
class Rotary:
    """A rotary embedding fragment: `x * cos + rotate_half(x) * sin` for each of its rotated inputs."""

    cos: str
    sin: str
    unsqueeze_dim: int
    rotated: list[str]  # the input each output rotates, in output order


@dataclass
class RmsNorm:
    """What the closed form needs of a recognised norm fragment."""

    hidden_states: str  # the activation input (a fragment input)
    weight: str  # the weight input (a parameter)
    eps: float
    normed: str  # the node whose rounding is the normalized value's (`rounding(frag, normed)`)
    mean: str  # the row mean (ordered by its region where the fragment orders it)


_CASTS = ("_to_copy", "convert_element_type")


def recognise(frag: Fragment, nodes: dict[str, Node]) -> RmsNorm | Activation | Rotary | None:
    """The fragment's closed form, or None where it has none (anything but the forms above, or a rounding or an engine
    read the gradient would have to see)."""
    if frag.carry is not None or frag.reads_store or frag.rounded_reads or frag.stored_input or frag.engine_sites \
            or frag.table_inputs:
        return None
    if len(frag.outputs) != 1:
        return None if frag.inductor_math else rotary(frag, nodes)
    return rms_norm(frag, nodes) if len(frag.inputs) == 2 else activation(frag) if len(frag.inputs) == 1 else None


def _last_dim(n: Node, dim: object) -> bool:
    return dim == -1 or (isinstance(dim, int) and n.shape is not None and dim == len(n.shape) - 1)


def _rotated(add: Node, by: dict[str, Node], unsqueezed: dict[str, str], inputs: set[str]
             ) -> tuple[str, str, str, list[str]] | None:
    """(x, cos input, sin input, the nodes) of `add = x * cos + cat(-x[h:], x[:h]) * sin`, or None."""
    if op_name(add.target) != "add" or len(add.inputs) != 2:
        return None
    for plain, turned in (add.inputs, add.inputs[::-1]):
        a, b = by.get(plain), by.get(turned)
        if a is None or b is None or op_name(a.target) != "mul" or op_name(b.target) != "mul":
            continue
        x = next((i for i in a.inputs if i in inputs), None)
        cos = next((i for i in a.inputs if i in unsqueezed), None)
        cat = by.get(next((i for i in b.inputs if i not in unsqueezed), ""))
        sin = next((i for i in b.inputs if i in unsqueezed), None)
        if x is None or cos is None or sin is None or cat is None or op_name(cat.target) != "cat":
            continue
        parts = [by.get(i) for i in cat.inputs]
        if len(parts) != 2 or cat.call[0][1:] not in ([-1], [len(cat.shape or []) - 1]):
            continue
        neg, first = parts
        if neg is None or first is None:
            continue
        upper = by.get(neg.inputs[0]) if op_name(neg.target) == "neg" and neg.inputs else None
        if upper is None or _half(x, upper, first) is None:
            continue
        return x, unsqueezed[cos], unsqueezed[sin], [add.name, a.name, b.name, cat.name, neg.name, upper.name,
                                                     first.name]
    return None


def _half(x: str, upper: Node, first: Node) -> int | None:
    """h where `upper` is x[..., h:] and `first` x[..., :h] of the last dim, both slices of x."""
    def bounds(n: Node) -> tuple[int, int] | None:
        a = n.call[0]
        if op_name(n.target) != "slice" or n.inputs != [x] or len(a) != 4 or not _last_dim(n, a[1]):
            return None
        return a[2], a[3]
    lo, hi = bounds(first), bounds(upper)
    half = (first.shape or [0])[-1]
    if lo is None or hi is None or not isinstance(half, int) or lo != (0, half) or hi[0] != half or hi[1] < 2 * half \
            or (upper.shape or [0])[-1] != half:
        return None
    return half


def rotary(frag: Fragment, nodes: dict[str, Node]) -> Rotary | None:
    """`x * cos + rotate_half(x) * sin` for every output, cos and sin inputs unsqueezed once at one dim, no other
    node."""
    by = {n.name: n for n in frag.nodes}
    squeezes = [n for n in frag.nodes if op_name(n.target) == "unsqueeze"]
    if len(squeezes) != 2 or any(len(n.inputs) != 1 or n.inputs[0] not in frag.inputs for n in squeezes):
        return None
    dims = {n.call[0][1] for n in squeezes}
    if len(dims) != 1:
        return None
    unsqueezed = {n.name: n.inputs[0] for n in squeezes}
    rotated_inputs = set(frag.inputs) - set(unsqueezed.values()) - set(frag.params)
    found = [_rotated(by[o], by, unsqueezed, rotated_inputs) if o in by else None for o in frag.outputs]
    if None in found or len({(f[1], f[2]) for f in found if f}) != 1:
        return None
    used = {n for f in found if f for n in f[3]} | set(unsqueezed)
    if used != set(by) or len({f[0] for f in found if f}) != len(found):
        return None
    first = found[0]
    assert first is not None
    return Rotary(cos=first[1], sin=first[2], unsqueeze_dim=int(next(iter(dims))),
                  rotated=[f[0] for f in found if f])


def activation(frag: Fragment) -> Activation | None:
    """`[cast] silu|gelu [cast]` of the fragment's one input."""
    ops = [(n, op_name(n.target)) for n in frag.nodes]
    x = frag.inputs[0]
    if x in frag.params:
        return None
    if ops and ops[0][1] in _CASTS and ops[0][0].inputs == [x]:
        ops = ops[1:]
    if not ops or ops[0][1] not in ("silu", "gelu") or len(ops[0][0].inputs) != 1:
        return None
    act, kwargs = ops[0][0], ops[0][0].call[1]
    if set(kwargs) - {"approximate"} or len(act.call[0]) != 1 or any(o not in _CASTS for _, o in ops[1:]):
        return None
    return Activation(x=x, op=ops[0][1], approximate=str(kwargs.get("approximate", "none")))


def rms_norm(frag: Fragment, nodes: dict[str, Node]) -> RmsNorm | None:
    """The fragment as an RMS norm (`[cast] pow 2, mean -1, add eps, rsqrt, mul, [cast], mul weight, [cast]`), or None
    where it is anything else or rounds anywhere but the normalized value and the output."""
    if frag.inductor_math:
        return None
    params = [i for i in frag.inputs if i in frag.params]
    if len(params) != 1:
        return None
    weight, x_in = params[0], next(i for i in frag.inputs if i not in frag.params)
    ops = [(n, op_name(n.target)) for n in frag.nodes]
    i = 0
    x = x_in
    if ops and ops[0][1] in _CASTS and ops[0][0].inputs == [x_in]:
        x, i = ops[0][0].name, 1
    want = ["pow", "mean", "add", "rsqrt", "mul"]
    if [o for _, o in ops[i:i + 5]] != want:
        return None
    pow_, mean, add, rsqrt, mul = (n for n, _ in ops[i:i + 5])
    if (pow_.inputs != [x] or pow_.call[0][1] != 2 or mean.call[0][1:] != [[-1], True]
            or add.inputs != [mean.name] or not isinstance(add.call[0][1], float) or rsqrt.inputs != [add.name]
            or sorted(mul.inputs) != sorted([x, rsqrt.name])):
        return None
    rest = ops[i + 5:]
    normed = mul
    if rest and rest[0][1] in _CASTS and rest[0][0].inputs == [mul.name]:
        normed, rest = rest[0][0], rest[1:]
    if not rest or rest[0][1] != "mul" or sorted(rest[0][0].inputs) != sorted([weight, normed.name]):
        return None
    scaled, rest = rest[0][0], rest[1:]
    if rest and rest[0][1] in _CASTS and rest[0][0].inputs == [scaled.name]:  # (weight * normed).to(input_dtype)
        rest = rest[1:]
    out = frag.nodes[-1]
    if rest or frag.outputs != [out.name] or any(rounding(frag, n.name) is not None for n in frag.nodes
                                                 if n.name not in (normed.name, scaled.name, out.name)):
        return None
    when = rounding(frag, normed.name)
    if when is not None and when != ("always", "") and when[0] not in ("unless-aligned", "input-dtype"):
        return None
    return RmsNorm(hidden_states=x_in, weight=weight, eps=float(add.call[0][1]), normed=normed.name, mean=mean.name)


def _header(frag: Fragment, fn_name: str, forward: str, what: str, names: dict[str, str]) -> list[str]:
    return [f"def {fn_name}(grad, {', '.join(names[i] for i in frag.inputs)}, align: frozenset[str], lanes: int = 0,",
            f"        needs: tuple[bool, ...] = {(True,) * len(frag.inputs)!r}) -> tuple[torch.Tensor | None, ...]:",
            f'    """The gradient of {forward} ({what}) in closed form, from its inputs: no activation kept."""']


def _emit_rotary(frag: Fragment, form: Rotary, fn_name: str, forward: str, names: dict[str, str]) -> list[str]:
    grads = [f"grad_{names[o]}" for o in frag.outputs]
    at = {i: k for k, i in enumerate(frag.inputs)}
    lines = [f"def {fn_name}({', '.join(grads)}, {', '.join(names[i] for i in frag.inputs)}, align: frozenset[str],",
             f"        lanes: int = 0, needs: tuple[bool, ...] = {(True,) * len(frag.inputs)!r}"
             ") -> tuple[torch.Tensor | None, ...]:",
             f'    """The gradient of {forward} (a rotary embedding) in closed form: the rotated inputs\',',
             '    from the cos and sin tables."""']
    cos, sin = names[form.cos], names[form.sin]
    d = {x: f"rotary_backward({g}, {names[x]}, {cos}, {sin}, {form.unsqueeze_dim}) if needs[{at[x]}] else None"
         for g, x in zip(grads, form.rotated)}
    return [*lines, "    return (", *[f"        {d.get(i, 'None')}," for i in frag.inputs], "    )"]


def saved(frag: Fragment, form: RmsNorm | Activation | Rotary) -> tuple[list[int], list[int]]:
    """(the inputs whose values the closed form reads, the inputs it gives a gradient), as positions of the forward's
    inputs: the runtime keeps only the first, and differentiates by autograd where another input needs a gradient."""
    every = list(range(len(frag.inputs)))
    if isinstance(form, Rotary):
        return [frag.inputs.index(form.cos), frag.inputs.index(form.sin)], [frag.inputs.index(x) for x in form.rotated]
    return every, every


def emit(frag: Fragment, form: RmsNorm | Activation | Rotary, fn_name: str, forward: str, names: dict[str, str]
         ) -> list[str]:
    """`def fn_name(grad, <forward's inputs>, align, lanes, needs)`: the forward's gradient in closed form (a rotary
    embedding's takes one gradient per output)."""
    if isinstance(form, Rotary):
        return _emit_rotary(frag, form, fn_name, forward, names)
    if isinstance(form, Activation):
        approximate = f", approximate={form.approximate!r}" if form.approximate != "none" else ""
        return [*_header(frag, fn_name, forward, f"{form.op}'s, by ATen's backward op", names),
                f"    return (activation_backward({form.op!r}, grad, {names[form.x]}{approximate}) if needs[0] else "
                "None,)"]
    norm = form
    when = rounding(frag, norm.normed)
    ordered = frag.ordered.get(norm.mean)
    flags = {r: f"a{k}" for k, r in enumerate(frag.regions) if r in (ordered, when and when[1])}
    rounded = ("True" if when == ("always", "") else "False" if when is None else
               f"{names[when[1]]}.dtype != torch.float32" if when[0] == "input-dtype" else f"not {flags[when[1]]}")
    lanes = f"lanes if {flags[ordered]} else 0" if ordered in flags else "0"
    own = [norm.hidden_states, norm.weight]
    at = [frag.inputs.index(i) for i in own]
    needs = "needs" if frag.inputs == own else f"(needs[{at[0]}], needs[{at[1]}])"
    call = (f"rms_norm_backward(grad, {names[own[0]]}, {names[own[1]]}, eps={norm.eps!r}, round_normed={rounded}, "
            f"lanes={lanes}, needs={needs})")
    lines = [*_header(frag, fn_name, forward, "an RMS norm", names),
             *[f"    {flag} = {region!r} in align" for region, flag in flags.items()]]
    if frag.inputs == own:
        return [*lines, f"    return {call}"]
    return [*lines, f"    grads = {call}", f"    return ({', '.join(f'grads[{own.index(i)}]' for i in frag.inputs)},)"]


def check(forward: Callable, backward: Callable, frag: Fragment, nodes: dict[str, Node],
          form: RmsNorm | Activation | Rotary) -> str:
    """Why the closed form is not the forward's gradient ("" where it is): both on seeded inputs of the captured
    shapes, with no region aligned and with all, the inputs it does not read (`saved`) given as shapes only; each
    gradient it gives within 1% of autograd's largest (BF16 gradients differ from autograd's in their last bit where
    the FP32 sums' order differs)."""
    reads, gives = saved(frag, form)
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for i in frag.inputs:
        shape = [s if isinstance(s, int) else 4 for s in (nodes[i].shape or [])]
        dtype = getattr(torch, str(nodes[i].dtype or "bfloat16"))
        inputs.append((torch.randn(shape, generator=gen) + (1.0 if i in frag.params else 0.0)).to(dtype))
    kept = [t if k in reads else torch.empty_like(t, device="meta") for k, t in enumerate(inputs)]
    for align in (frozenset(), frozenset(frag.regions)):
        leaves = [t.clone().requires_grad_(k in gives) for k, t in enumerate(inputs)]
        outs = forward(*leaves, align=align)
        grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
        expected = torch.autograd.grad(outs, [leaves[k] for k in gives], grads)
        with torch.no_grad():
            got = backward(*grads, *kept, align=align)
        for k, e in zip(gives, expected):
            g = got[k]
            if g is None or g.shape != e.shape or g.dtype != e.dtype:
                return f"closed-form gradient of {frag.inputs[k]}: {None if g is None else (g.dtype, tuple(g.shape))}"
            if (g.float() - e.float()).abs().max() > 1e-2 * e.float().abs().max():
                return f"closed-form gradient of {frag.inputs[k]} differs from autograd's (align {sorted(align)})"
    return ""
