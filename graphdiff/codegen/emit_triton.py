"""ATen fragment -> Triton kernels, forward and backward, one program per row of the last dimension.

The fragment splits into a *prologue* of exact data movement on its inputs (rotate_half's slices, cat and
neg; unsqueezes), run by PyTorch under autograd, and a *core* of elementwise ops and last-dim reductions,
one kernel per output. Each core op is written as Inductor's Triton codegen writes it on the installed torch
(`inductor_lowering`: its decompositions, lowerings and Triton op overrides: libdevice.rsqrt, libdevice.exp,
`/`, pow as multiplications, mean as an FP32 sum divided by the row size), because on a GPU the engine runs
Inductor's kernels. Row reductions are Inductor's persistent reduction: one FP32 `tl.sum` over the row padded
to a power of two (masked lanes 0). Inside a kernel every value is FP32 in registers; `_rne` rounds to BF16
(nearest even, on the FP32 bits: the interpreter's BF16 store truncates) exactly where the plan rounds, and the
store is exact because the value is already on the grid.

The backward kernel recomputes the forward from the saved inputs (no activations kept) and runs the reverse
pass in FP32, treating roundings as identities (straight-through, like autograd through `.to`). Gradients are
stored only for inputs that need one: in the input's dtype where the input has the output's shape (BF16
rounded to nearest even in the kernel), and for an input broadcast to every row (a norm weight) reduced
blockwise: each program runs a block of rows and stores one FP32 partial row, so the buffer is programs x D,
not rows x D. Other broadcasts (per-row scalars, cos/sin over heads) store FP32 rows reduced after the kernel.
A fragment with a prologue runs under non-reentrant checkpointing (`_inputs_only`), so the FP32 tensors the
prologue makes are made again in the backward rather than kept.

Values keep the PyTorch function's names (names.py); Inductor's temporaries inside a node are `<value>_<op>`
(`variance_sum`), a kernel input's pointer, row offsets and stride `<value>_ptr`, `_rows`, `_s`, and the adjoint
of a value `d_<value>`.
"""

from __future__ import annotations

import dataclasses
import re

from graphdiff.codegen import inductor_lowering
from graphdiff.codegen.emit_torch import Unsupported, expression
from graphdiff.codegen.fragment import Fragment, rounding
from graphdiff.codegen.inductor_lowering import Step
from graphdiff.codegen.names import Namer, arguments, value_names
from graphdiff.ops import EXACT, is_low, op_name
from graphdiff.records import Node, walk

MOVES = EXACT - {"neg", "clone", "alias", "contiguous"}  # data movement: only in the prologue
STEP = "__step"  # what Inductor's steps of one node are lowered as, then renamed (no value's name starts with `_`)


def _renamed(steps: list[Step], out: str, namer: Namer | None) -> list[Step]:
    """Steps lowered as STEP with the result `out` and each temporary `<out>_<op>` (a fresh name of `namer`;
    `<out>_<k>` without one)."""
    rename = {st.var: out if st.var == STEP else namer.claim(f"{out}_{st.op}") if namer is not None
              else out + st.var[len(STEP):] for st in steps}

    def sub(text: str) -> str:
        return re.sub(rf"\b{STEP}(_\d+)?\b", lambda m: rename.get(m.group(0), m.group(0)), text)

    return [dataclasses.replace(st, var=rename[st.var], args=tuple(rename.get(a, a) for a in st.args),
                                expr=sub(st.expr)) for st in steps]


def forward_steps(n: Node, nodes: dict[str, Node], row_dim: int, names: dict[str, str] | None = None,
                  namer: Namer | None = None) -> list[Step]:
    """Node n as Inductor's Triton codegen computes it (masked lanes hold 0 and never reach a store), reading each
    value by its variable (`names`, default the node names) and naming its temporaries with `namer`."""
    name = op_name(n.target)
    if name in MOVES:
        raise Unsupported(f"{n.target} after computation (the kernel holds one row per program)")
    if name in ("mean", "sum"):
        a = n.call[0]
        dims, keep = a[1], (a[2] if len(a) > 2 else False)
        if list(dims) not in ([-1], [row_dim]) or not keep:
            raise Unsupported(f"{n.target} over {dims} (only last-dim reductions with keepdim)")
    try:
        var = {i: (names or {}).get(i, i) for i in nodes}
        steps = _renamed(inductor_lowering.lower(n, nodes, var, STEP), var[n.name], namer)
    except inductor_lowering.Unsupported as e:
        raise Unsupported(str(e)) from e
    if any(s.op == "sum" for s in steps) and name not in ("mean", "sum"):
        raise Unsupported(f"{n.target} reduces inside (only mean/sum over the row)")
    return steps


def step_line(s: Step) -> str:
    if s.op == "sum":  # Inductor's persistent reduction: FP32, the whole row in one block
        return f"{s.var} = tl.sum(tl.where(mask, {s.args[0]}, 0.0), axis=0)"
    return f"{s.var} = {s.expr}"


def grads(s: Step) -> list[tuple[str, str]]:
    """(input variable, contribution) pairs of step s's adjoint `g` (reverse mode, FP32)."""
    a = s.args
    out = s.var
    if s.op in ("identity", "sum"):
        return [(a[0], "g")]
    if s.op == "add":
        return [(a[0], "g"), (a[1], "g")]
    if s.op == "sub":
        return [(a[0], "g"), (a[1], "-g")]
    if s.op == "mul":
        return [(a[0], f"g * {a[1]}"), (a[1], f"g * {a[0]}")]
    if s.op in ("truediv", "div_rn"):
        return [(a[0], f"g / {a[1]}"), (a[1], f"-g * {out} / {a[1]}")]
    if s.op == "neg":
        return [(a[0], "-g")]
    if s.op == "rsqrt":
        return [(a[0], f"g * -0.5 * {out} * {out} * {out}")]
    if s.op == "sqrt":
        return [(a[0], f"g * 0.5 / {out}")]
    if s.op == "exp":
        return [(a[0], f"g * {out}")]
    if s.op == "sigmoid":
        return [(a[0], f"g * {out} * (1.0 - {out})")]
    if s.op == "constant":
        return []
    raise Unsupported(f"no derivative for Inductor's ops.{s.op}")


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


def emit(frag: Fragment, slug: str, nodes: dict[str, Node], names: dict[str, str] | None = None) -> list[str] | str:
    """Kernel source lines (indented for the module's `if triton is not None:` block), or why not. `names`: each
    input's and node's variable, as in the PyTorch function (names.value_names)."""
    try:
        return _emit(frag, slug, nodes, names or value_names(frag, arguments(frag)))
    except Unsupported as e:
        return str(e)


def _emit(frag: Fragment, slug: str, nodes: dict[str, Node], names: dict[str, str]) -> list[str]:
    if frag.table_inputs:
        raise Unsupported("an input the engine gathers from a low-precision table (PyTorch path only)")
    prologue, core = split(frag)
    core_names = {n.name for n in core}
    if not all(o in core_names for o in frag.outputs):
        raise Unsupported("an output is pure data movement")
    index = {r: i for i, r in enumerate(frag.regions)}
    flags = [f"A{i}" for i in range(len(index))]
    namer = Namer.holding(names)  # the kernels' temporaries
    lines: list[str] = []
    params = ", ".join(names[i] for i in frag.inputs)
    # `lanes` (a CPU engine's row-sum order) is the PyTorch path's: the kernels sum as Inductor's Triton reductions
    wrapper = [f"def triton_{slug}({params}, align: frozenset[str], lanes: int = 0):",
               '    """Same as the PyTorch function, as Triton kernels (the prologue stays in PyTorch)."""']
    for n in prologue:
        wrapper.append(f"    {names[n.name]} = {expression(n, nodes, names)}  # {n.target}, exact")
    wrapper.append("    flags = {" + ", ".join(f"'A{i}': {r!r} in align" for r, i in index.items()) + "}")
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
        steps = {n.name: forward_steps(n, nodes, len(shape) - 1, names, namer) for n in comp}
        lines += _kernel(kname, comp, steps, [names[i] for i in ins], names[o], {names[i] for i in scalar}, flags,
                         frag, index, shape[-1], names)
        per_row = sorted(ins.index(s) for s in scalar & set(ins))
        wrapper.append(f"    {names[o]} = _RowKernel.apply(({kname}_fwd, {kname}_bwd, {per_row}), flags, "
                       f"{_out_bf16(frag, o, nodes)}, {', '.join(names[i] for i in ins)})")
    wrapper.append(f"    return ({', '.join(names[o] for o in frag.outputs)},)")
    if prologue:  # its data movement makes new FP32 tensors the kernels would keep: keep the inputs instead
        wrapper[0] = wrapper[0].replace(f"def triton_{slug}(", f"def _triton_{slug}_body(")
        wrapper += ["", f"def triton_{slug}({params}, align: frozenset[str], lanes: int = 0):",
                    '    """Same as the PyTorch function, as Triton kernels, keeping only the inputs for backward."""',
                    f"    return _inputs_only(_triton_{slug}_body, {params}, align=align)"]
    return ["    " + ln if ln else "" for ln in [*lines, *wrapper]]


def _out_bf16(frag: Fragment, o: str, nodes: dict[str, Node]) -> str:
    """Whether the kernel stores output `o` in BF16, as code: always, never, or unless its region is aligned."""
    site = frag.sites.get(o)
    if not is_low(nodes[o].dtype):
        return "False"
    if site is not None and frag.keep_fp32.get(o, False):  # FP32 out only when its region is aligned (and those
        needed = [site, *frag.fp32_with.get(o, [])]  # of the code reading it, `fp32_with`)
        if len(needed) == 1:
            return f"{site!r} not in align"
        return f"not ({' and '.join(f'{r!r} in align' for r in needed)})"
    return "True"


def _component(core: list[Node], output: str) -> list[Node]:
    by_name = {n.name: n for n in core}
    if output not in by_name:
        return []
    need = {output, *walk([output], lambda n: [i for i in by_name[n].inputs if i in by_name])}
    return [n for n in core if n.name in need]


def _round_lines(n: Node, x: str, frag: Fragment, index: dict[str, int], pad: str) -> list[str]:
    """Node n's rounding (its variable `x`) where the plan rounds it."""
    when = rounding(frag, n.name)
    if when is None:
        return []
    if when[0] == "unless-aligned":
        return [f"{pad}if not A{index[when[1]]}:", f"{pad}    {x} = _rne({x})"]
    if when[0] == "if-aligned":
        return [f"{pad}if A{index[when[1]]}:", f"{pad}    {x} = _rne({x})"]
    return [f"{pad}{x} = _rne({x})"]


def _rows_of(steps: dict[str, list[Step]], comp: list[Node], ins: list[str], scalar: set[str]) -> set[str]:
    """Variables that hold a row (the others hold one value per row: reductions, constants, per-row inputs)."""
    row = {i for i in ins if i not in scalar}
    for n in comp:
        for st in steps[n.name]:
            if st.op not in ("sum", "constant") and any(a in row for a in st.args):
                row.add(st.var)
    return row


def _loads(ins: list[str], scalar: set[str], pad: str, valid: str) -> list[str]:
    """Each input's row (or its one value per row) loaded in FP32 (`ins`, `scalar`: variables)."""
    head = []
    for i in ins:
        base = f"{i}_ptr + tl.load({i}_rows + row)"
        if i in scalar:
            head.append(f"{pad}{i} = tl.load({base}).to(tl.float32)")
        else:
            head.append(f"{pad}{i} = tl.load({base} + cols * {i}_s, mask={valid}, other=0.0).to(tl.float32)")
    return head


def _body(comp: list[Node], steps: dict[str, list[Step]], frag: Fragment, index: dict[str, int], pad: str,
          names: dict[str, str]) -> list[str]:
    """The component's steps in order, each node rounded where the trainer rounds it."""
    lines = []
    for n in comp:
        for st in steps[n.name]:
            lines.append(f"{pad}{step_line(st)}  # {n.target}" + (f": {st.op}" if st.var != names[n.name] else ""))
        lines += _round_lines(n, names[n.name], frag, index, pad)
    return lines


def _adjoints(flat: list[Step], ins: list[str], out: str, row_vars: set[str], p: str) -> tuple[list[str], set[str]]:
    """Reverse-mode lines from the output's gradient back to the inputs, and the variables that got an adjoint
    (`d_<variable>`)."""
    live = set(ins)  # variables that depend on an input: the only ones with an adjoint
    for st in flat:
        if any(a in live for a in st.args):
            live.add(st.var)
    rev = [f"{p}g = tl.load(gout_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)", f"{p}d_{out} = g"]
    have = {out}
    for st in reversed(flat):
        if st.var not in have:
            continue
        rev.append(f"{p}g = d_{st.var}  # through {st.op}")
        for var, expr in grads(st):
            if var not in live:
                continue
            contrib = f"tl.sum(tl.where(mask, {expr}, 0.0), axis=0)" if var not in row_vars and st.var in row_vars \
                else expr
            rev.append(f"{p}d_{var} = d_{var} + {contrib}" if var in have else f"{p}d_{var} = {contrib}")
            have.add(var)
    return rev, have


def _grad_stores(ins: list[str], scalar: set[str], have: set[str], p: str) -> tuple[list[str], list[str]]:
    """Per input, by its gradient mode GMk: the stores in the row loop, and the stores after it (mode 4: summed)."""
    stores, finals = [], []
    for k, i in enumerate(ins):
        if i in scalar:
            value = f"d_{i}" if i in have else "0.0"
            stores += [f"{p}if GM{k} == 3:", f"{p}    tl.store(g{k}_ptr + row, {value})"]
            continue
        value = f"d_{i}" if i in have else "tl.zeros([BLOCK], dtype=tl.float32)"
        stores += [f"{p}if GM{k} == 1:", f"{p}    tl.store(g{k}_ptr + row * D + cols, {value}, mask=mask)",
                   f"{p}if GM{k} == 2:", f"{p}    tl.store(g{k}_ptr + row * D + cols, _rne({value}), mask=mask)",
                   f"{p}if GM{k} == 4:", f"{p}    acc{k} += tl.where(valid, {value}, 0.0)"]
        finals += [f"    if GM{k} == 4:", f"        tl.store(g{k}_ptr + pid * D + cols, acc{k}, mask=mask)"]
    return stores, finals


def _kernel(kname: str, comp: list[Node], steps: dict[str, list[Step]], ins: list[str], out: str, scalar: set[str],
            flags: list[str], frag: Fragment, index: dict[str, int], d: int, names: dict[str, str]) -> list[str]:
    """The forward and backward Triton kernels of one component, one row per program (backward: RPP rows); `ins`,
    `out`, `scalar`: variables (`names`: each node's)."""
    params = ", ".join(f"{i}_ptr, {i}_rows, {i}_s" for i in ins)
    consts = "".join(f", {f}: tl.constexpr" for f in flags)
    body = _body(comp, steps, frag, index, "    ", names)
    note = []
    if d > inductor_lowering.persistent_limit() and any(st.op == "sum" for ss in steps.values() for st in ss):
        note = [f"    # rows of {d} > {inductor_lowering.persistent_limit()}: Inductor loops over such rows with an "
                "autotuned block; this sum reduces the row at once (FP32 order may differ)"]
    head = ["    row = tl.program_id(0)", "    cols = tl.arange(0, BLOCK)", "    mask = cols < D"]
    signature = f"out_ptr, {params}, D, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr{consts}"
    fwd = ["@triton.jit", f"def {kname}_fwd({signature}):", *note,
           *head, *_loads(ins, scalar, "    ", "mask"), *body, f"    y = {out}", "    if OUT_BF16:",
           "        y = _rne(y)", "    tl.store(out_ptr + row * D + cols, y, mask=mask)", ""]

    p = "        "
    flat = [st for n in comp for st in steps[n.name]]
    rev, have = _adjoints(flat, ins, out, _rows_of(steps, comp, ins, scalar), p)
    stores, finals = _grad_stores(ins, scalar, have, p)
    grad_params = ", ".join(f"g{k}_ptr" for k in range(len(ins)))
    modes = "".join(f", GM{k}: tl.constexpr" for k in range(len(ins)))
    loop = ["    pid = tl.program_id(0)", "    cols = tl.arange(0, BLOCK)", "    mask = cols < D",
            *[f"    acc{k} = tl.zeros([BLOCK], dtype=tl.float32)" for k, i in enumerate(ins) if i not in scalar],
            "    for r in range(RPP):  # a block of rows per program: broadcast weights' gradients summed in registers",
            "        ok = pid * RPP + r < n_rows",
            "        row = tl.where(ok, pid * RPP + r, n_rows - 1)  # past the end: the last row again, not summed",
            "        valid = mask & ok"]
    bwd = ["@triton.jit",
           f"def {kname}_bwd(gout_ptr, {params}, {grad_params}, D, n_rows, RPP, BLOCK: tl.constexpr{modes}{consts}):",
           *note, *loop, *_loads(ins, scalar, p, "mask"), *_body(comp, steps, frag, index, p, names), *rev, *stores,
           *finals, ""]
    return fwd + bwd


PRELUDE = '''
try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the runtime uses the PyTorch functions
    triton = None

if triton is not None:
    try:  # the names Inductor's Triton kernels call their math library by
        from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
    except ImportError:
        from triton.language.extra import libdevice
        tl_math = tl.math
    if os.environ.get("TRITON_INTERPRET") == "1":

        class _InterpretedLibdevice:
            """The interpreter runs no extern (libdevice) calls: tl.math's function of the same name, which the
            interpreter computes with numpy (its FP32 results are numpy's, not CUDA's)."""

            def __getattr__(self, name):
                return lambda *args: getattr(tl.math, name)(*args)

        libdevice = _InterpretedLibdevice()

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

    def _inputs_only(fn, *inputs, align):
        """fn keeping only its inputs for the backward (non-reentrant checkpointing): the FP32 tensors its
        PyTorch prologue makes (rotate_half's cat) are made again in the backward, not kept."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return torch.utils.checkpoint.checkpoint(fn, *inputs, align=align, use_reentrant=False)
        return fn(*inputs, align=align)

    GRAD_PROGRAMS = 1024  # the backward's programs when a broadcast weight's gradient is summed blockwise

    def _grad_mode(t: torch.Tensor, shape: torch.Size, per_row: bool, need: bool) -> int:
        """How the backward kernel stores this input's gradient: 0 not at all, 1 FP32 rows, 2 BF16 rows (the
        input has the output's shape), 3 one FP32 value per row, 4 one FP32 partial row per program (the
        input is one row broadcast to all rows: a norm weight)."""
        if not need:
            return 0
        if per_row:
            return 3
        if t.shape == shape:
            return 2 if t.dtype == torch.bfloat16 else 1
        if t.numel() == shape[-1]:
            return 4
        return 1

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
            ctx.save_for_backward(*inputs)  # inputs only: the backward kernel recomputes the forward
            ctx.kernels, ctx.flags, ctx.shape = kernels, flags, shape
            return out

        @staticmethod
        def backward(ctx, gout):
            inputs = ctx.saved_tensors
            _, bwd, per_row = ctx.kernels
            shape = ctx.shape
            d = shape[-1]
            rows = gout.numel() // d
            modes = [_grad_mode(t, shape, i in per_row, need) for i, (t, need)
                     in enumerate(zip(inputs, ctx.needs_input_grad[3:]))]
            programs = min(rows, GRAD_PROGRAMS) if 4 in modes else rows
            rpp = -(-rows // programs)
            programs = -(-rows // rpp)
            grads = []
            for t, m in zip(inputs, modes):
                size = {0: (1,), 1: (rows, d), 2: (rows, d), 3: (rows, 1), 4: (programs, d)}[m]
                grads.append(torch.empty(size, dtype=torch.bfloat16 if m == 2 else torch.float32, device=gout.device))
            args = [a for t in inputs for a in (t, *_rows(t, shape))]
            bwd[(programs,)](gout.contiguous(), *args, *grads, d, rows, rpp, BLOCK=triton.next_power_of_2(d),
                             **{f"GM{k}": m for k, m in enumerate(modes)}, **ctx.flags)
            out = []
            for t, g, m in zip(inputs, grads, modes):
                if m == 0:
                    out.append(None)
                elif m == 4:
                    out.append(g.sum(0).view(t.shape).to(t.dtype))
                else:
                    out.append(g.view(*shape[:-1], g.shape[-1]).sum_to_size(t.shape).to(t.dtype))
            return (None, None, None, *out)
'''
