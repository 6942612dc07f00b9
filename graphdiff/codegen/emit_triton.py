"""ATen fragment -> Triton kernels, forward and backward, one program per row of the last dimension.

The fragment splits into a *prologue* of exact data movement on its inputs (rotate_half's slices, cat and
neg; unsqueezes), run by PyTorch under autograd, and a *core* of elementwise ops and last-dim reductions,
one kernel per output. Inside a kernel every value is FP32 in registers; `_rne` rounds to BF16 (nearest
even, on the FP32 bits: the interpreter's BF16 store truncates) exactly where the plan rounds, and the
store is exact because the value is already on the grid. Row reductions accumulate in FP64 so the result
does not depend on the reduction order (verify compares them with the plan replay reducing in FP64).
The backward kernel recomputes the forward from the saved inputs (no activations kept) and runs the
reverse pass in FP32, treating roundings as identities (straight-through, like autograd through `.to`).
"""

from __future__ import annotations

from graphdiff.codegen.emit_torch import Unsupported, expression
from graphdiff.codegen.fragment import Fragment, rounding
from graphdiff.model import Node
from graphdiff.ops import EXACT, IDENTITY, is_low, op_name

CORE = {"add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "sigmoid", "silu", "reciprocal", "mean",
        "sum"} | IDENTITY


def v(name: str) -> str:
    return f"v_{name}"


def _arg(a: object) -> str:
    if isinstance(a, dict) and "node" in a:
        return v(a["node"])
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return repr(float(a))
    raise Unsupported(f"argument {a!r}")


def forward_line(n: Node, row_dim: int) -> str:
    """FP32 Triton expression for node n (masked lanes hold 0 and never reach a store or a reduction)."""
    a = n.call[0]
    name = op_name(n.target)
    x = _arg(a[0]) if a else ""
    if name in IDENTITY:
        return x
    if name in ("add", "sub", "mul"):
        return f"{x} {dict(add='+', sub='-', mul='*')[name]} {_arg(a[1])}"
    if name == "div":
        return f"tl.math.div_rn({x}, {_arg(a[1])})"
    if name == "neg":
        return f"-{x}"
    if name == "pow":
        c = a[1]
        if not (isinstance(c, (int, float)) and float(c).is_integer() and 1 <= c <= 4):
            raise Unsupported(f"pow with exponent {c!r}")
        return " * ".join([x] * int(c))
    if name == "rsqrt":
        return f"tl.math.div_rn(1.0, tl.sqrt_rn({x}))"
    if name == "sqrt":
        return f"tl.sqrt_rn({x})"
    if name == "reciprocal":
        return f"tl.math.div_rn(1.0, {x})"
    if name == "exp":
        return f"tl.exp({x})"
    if name == "sigmoid":
        return f"tl.math.div_rn(1.0, 1.0 + tl.exp(-{x}))"
    if name == "silu":
        return f"tl.math.div_rn({x}, 1.0 + tl.exp(-{x}))"
    if name in ("mean", "sum"):
        dims, keep = a[1], (a[2] if len(a) > 2 else False)
        if list(dims) not in ([-1], [row_dim]) or not keep:
            raise Unsupported(f"{n.target} over {dims} (only last-dim reductions with keepdim)")
        total = f"tl.sum(tl.where(mask, ({x}).to(tl.float64), 0.0), axis=0)"
        return f"({total} / D).to(tl.float32)" if name == "mean" else f"({total}).to(tl.float32)"
    raise Unsupported(f"{n.target} has no Triton form")


def grads(n: Node) -> list[tuple[str, str]]:
    """(input variable, contribution) pairs of node n's adjoint `g` (reverse mode, FP32)."""
    a = n.call[0]
    name = op_name(n.target)
    refs = [x for x in a if isinstance(x, dict) and "node" in x]
    x = _arg(a[0]) if a else ""
    y = _arg(a[1]) if len(a) > 1 and name in ("add", "sub", "mul", "div") else ""
    out = v(n.name)
    if name in IDENTITY | {"add", "sum"}:
        rules = [(x, "g"), (y, "g")] if name == "add" else [(x, "g")]
    elif name == "sub":
        rules = [(x, "g"), (y, "-g")]
    elif name == "mul":
        rules = [(x, f"g * {y}"), (y, f"g * {x}")]
    elif name == "div":
        rules = [(x, f"g / {y}"), (y, f"-g * {x} / ({y} * {y})")]
    elif name == "neg":
        rules = [(x, "-g")]
    elif name == "pow":
        c = int(a[1])
        rules = [(x, f"g * {float(c)!r}" + "".join(f" * {x}" for _ in range(c - 1)))]
    elif name == "rsqrt":
        rules = [(x, f"g * -0.5 * {out} * {out} * {out}")]
    elif name == "sqrt":
        rules = [(x, f"g * 0.5 / {out}")]
    elif name == "reciprocal":
        rules = [(x, f"-g * {out} * {out}")]
    elif name == "exp":
        rules = [(x, f"g * {out}")]
    elif name == "sigmoid":
        rules = [(x, f"g * {out} * (1.0 - {out})")]
    elif name == "silu":
        s = f"(1.0 / (1.0 + tl.exp(-{x})))"
        rules = [(x, f"g * {s} * (1.0 + {x} * (1.0 - {s}))")]
    elif name == "mean":
        rules = [(x, "g / D")]
    else:
        raise Unsupported(f"no derivative for {n.target}")
    names = {_arg(r) for r in refs}
    return [(var, expr) for var, expr in rules if var in names]


def split(frag: Fragment) -> tuple[list[Node], list[Node]]:
    prologue: list[Node] = []
    known = set(frag.inputs)
    core = []
    for n in frag.nodes:
        if op_name(n.target) in EXACT and all(i in known for i in n.inputs):
            prologue.append(n)
            known.add(n.name)
        else:
            core.append(n)
    return prologue, core


def emit(frag: Fragment, slug: str, nodes: dict[str, Node]) -> list[str] | str:
    """Kernel source lines (indented for the module's `if triton is not None:` block), or why not."""
    try:
        return _emit(frag, slug, nodes)
    except Unsupported as e:
        return str(e)


def _emit(frag: Fragment, slug: str, nodes: dict[str, Node]) -> list[str]:
    prologue, core = split(frag)
    core_names = {n.name for n in core}
    for n in core:
        if op_name(n.target) not in CORE:
            raise Unsupported(f"{n.target} after computation (the kernel holds one row per program)")
    if not all(o in core_names for o in frag.outputs):
        raise Unsupported("an output is pure data movement")
    index = {r: i for i, r in enumerate(frag.regions)}
    flags = [f"A{i}" for i in range(len(index))]
    lines: list[str] = []
    wrapper = [f"def triton_{slug}({', '.join(f'x{i}' for i in range(len(frag.inputs)))}, align: frozenset[str]):",
               '    """Same as the PyTorch function, as Triton kernels (the prologue stays in PyTorch)."""']
    for i, name in enumerate(frag.inputs):
        wrapper.append(f"    {v(name)} = x{i}")
    for n in prologue:
        wrapper.append(f"    {v(n.name)} = {expression(n)}  # {n.target}, exact")
    wrapper.append("    flags = {" + ", ".join(f"'A{i}': {r!r} in align" for r, i in index.items()) + "}")
    outs = []
    for j, o in enumerate(frag.outputs):
        comp = _component(core, o)
        ins = []
        for n in comp:
            ins += [i for i in n.inputs if i not in core_names and i not in ins]
        shape = nodes[o].shape or []
        if not shape or not isinstance(shape[-1], int):
            raise Unsupported(f"output {o} has no static last dimension")
        scalar = {i for i in ins if (nodes[i].shape or [1])[-1] == 1 and shape[-1] != 1}
        scalar |= {n.name for n in comp if (n.shape or [1])[-1] == 1 and shape[-1] != 1}
        kname = f"_k_{slug}_{j}"
        lines += _kernel(kname, comp, ins, o, scalar, flags, frag, index, len(shape) - 1)
        out_low = is_low(nodes[o].dtype)
        site = frag.sites.get(o)
        if not out_low:
            bf16 = "False"
        elif site is not None and frag.keep_fp32.get(o, False):
            bf16 = f"{site!r} not in align"  # FP32 out only when its region is aligned
        else:
            bf16 = "True"
        per_row = sorted(ins.index(s) for s in scalar & set(ins))
        wrapper.append(f"    o{j} = _RowKernel.apply(({kname}_fwd, {kname}_bwd, {per_row}), flags, {bf16}, "
                       f"{', '.join(v(i) for i in ins)})")
        outs.append(f"o{j}")
    wrapper.append(f"    return ({', '.join(outs)},)")
    return ["    " + ln if ln else "" for ln in [*lines, *wrapper]]


def _component(core: list[Node], output: str) -> list[Node]:
    by_name = {n.name: n for n in core}
    need, stack = set(), [output]
    while stack:
        n = stack.pop()
        if n in by_name and n not in need:
            need.add(n)
            stack += by_name[n].inputs
    return [n for n in core if n.name in need]


def _round_lines(n: Node, frag: Fragment, index: dict[str, int], pad: str) -> list[str]:
    when = rounding(frag, n.name)
    if when is None:
        return []
    if when[0] == "unless-aligned":
        return [f"{pad}if not A{index[when[1]]}:", f"{pad}    {v(n.name)} = _rne({v(n.name)})"]
    if when[0] == "if-aligned":
        return [f"{pad}if A{index[when[1]]}:", f"{pad}    {v(n.name)} = _rne({v(n.name)})"]
    return [f"{pad}{v(n.name)} = _rne({v(n.name)})"]


def _kernel(kname: str, comp: list[Node], ins: list[str], out: str, scalar: set[str], flags: list[str],
            frag: Fragment, index: dict[str, int], row_dim: int) -> list[str]:
    params = ", ".join(f"{v(i)}_ptr, {v(i)}_rows, {v(i)}_s" for i in ins)
    consts = "".join(f", {f}: tl.constexpr" for f in flags)
    head = ["    row = tl.program_id(0)", "    cols = tl.arange(0, BLOCK)", "    mask = cols < D"]
    for i in ins:
        base = f"{v(i)}_ptr + tl.load({v(i)}_rows + row)"
        if i in scalar:
            head.append(f"    {v(i)} = tl.load({base}).to(tl.float32)")
        else:
            head.append(f"    {v(i)} = tl.load({base} + cols * {v(i)}_s, mask=mask, other=0.0).to(tl.float32)")
    body = []
    for n in comp:
        body.append(f"    {v(n.name)} = {forward_line(n, row_dim)}  # {n.target}")
        body += _round_lines(n, frag, index, "    ")
    signature = f"out_ptr, {params}, D, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr{consts}"
    fwd = ["@triton.jit", f"def {kname}_fwd({signature}):",
           *head, *body, f"    y = {v(out)}", "    if OUT_BF16:", "        y = _rne(y)",
           "    tl.store(out_ptr + row * D + cols, y, mask=mask)", ""]
    grad_params = ", ".join(f"g_{i}_ptr" for i in ins)
    rev = ["    g = tl.load(gout_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)", f"    a_{out} = g"]
    have = {out}
    for n in reversed(comp):
        if n.name not in have:
            continue
        rev.append(f"    g = a_{n.name}  # through {n.target}")
        for var, expr in grads(n):
            x = var.removeprefix("v_")
            contrib = f"tl.sum(tl.where(mask, {expr}, 0.0), axis=0)" if x in scalar and n.name not in scalar else expr
            rev.append(f"    a_{x} = a_{x} + {contrib}" if x in have else f"    a_{x} = {contrib}")
            have.add(x)
    for i in ins:
        value = f"a_{i}" if i in have else "tl.zeros([BLOCK], dtype=tl.float32)"
        if i in scalar:
            value = f"a_{i}" if i in have else "0.0"
            rev.append(f"    tl.store(g_{i}_ptr + row, {value})")
        else:
            rev.append(f"    tl.store(g_{i}_ptr + row * D + cols, {value}, mask=mask)")
    bwd = ["@triton.jit", f"def {kname}_bwd(gout_ptr, {params}, {grad_params}, D, BLOCK: tl.constexpr{consts}):",
           *head, *body, *rev, ""]
    return fwd + bwd


PRELUDE = '''
try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the runtime uses the PyTorch functions
    triton = None

if triton is not None:

    @triton.jit
    def _rne(x):
        """Round FP32 to the nearest BF16 (ties to even) and keep it as FP32: add 0x7FFF plus the lowest kept
        bit, drop the low 16 bits. Explicit because the interpreter's BF16 store truncates."""
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
        return b.to(tl.float32, bitcast=True)

    def _rows(t: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, int]:
        """Element offset of each row of `t` broadcast to `shape` (no copy of `t`), and its last-dim stride."""
        strides = t.expand(shape).stride()
        off = torch.zeros((), dtype=torch.int64, device=t.device)
        for d, n in enumerate(shape[:-1]):
            off = off.unsqueeze(-1) + torch.arange(n, dtype=torch.int64, device=t.device) * strides[d]
        return off.reshape(-1).contiguous(), strides[-1]

    class _RowKernel(torch.autograd.Function):
        """One generated forward/backward kernel pair over the rows of the broadcast shape of its inputs."""

        @staticmethod
        def forward(ctx, kernels, flags, out_bf16, *inputs):
            fwd, _, _ = kernels
            shape = torch.broadcast_shapes(*(t.shape for t in inputs))
            d = shape[-1]
            out = torch.empty(shape, dtype=torch.bfloat16 if out_bf16 else torch.float32, device=inputs[0].device)
            args = [a for t in inputs for a in (t, *_rows(t, shape))]
            block = triton.next_power_of_2(d)
            fwd[(out.numel() // d,)](out, *args, d, BLOCK=block, OUT_BF16=out_bf16, **flags)
            ctx.save_for_backward(*inputs)
            ctx.kernels, ctx.flags, ctx.shape = kernels, flags, shape
            return out

        @staticmethod
        def backward(ctx, gout):
            inputs = ctx.saved_tensors
            _, bwd, per_row = ctx.kernels
            shape = ctx.shape
            d = shape[-1]
            rows = gout.numel() // d
            # Full-size FP32 gradients per input, reduced to each input's shape (broadcast weights) after.
            grads = [torch.empty((rows, 1 if i in per_row else d), dtype=torch.float32, device=gout.device)
                     for i in range(len(inputs))]
            args = [a for t in inputs for a in (t, *_rows(t, shape))]
            bwd[(rows,)](gout.contiguous(), *args, *grads, d, BLOCK=triton.next_power_of_2(d), **ctx.flags)
            out = []
            for t, g, need in zip(inputs, grads, ctx.needs_input_grad[3:]):
                g = g.view(*shape[:-1], g.shape[-1])
                out.append(g.sum_to_size(t.shape).to(t.dtype) if need else None)
            return (None, None, None, *out)
'''
