"""Transcendental ops the way Inductor's C++ kernels compute them, for replaying those kernels.

ATen's eager FP32 tanh/exp/log/sin/cos/erf/sqrt/expm1 on the CPU and Inductor's C++ codegen
(`at::vec::Vectorized<float>::tanh()`, SLEEF) differ in the last bit on 0.3-60% of elements; a 1-ulp difference
of tanh near -1 becomes a BF16 flip after 0.5*x*(1+tanh), so GELU-tanh kernels replayed with eager ops agree on
99.93-99.96% only. Replaying a C++ kernel, these ops run as a one-op function compiled by Inductor itself
(one compile per op per process, dynamic shapes, flattened input: the vectorized path with a masked tail, as in
the engine's kernels). Other ops agree bit for bit with eager (rsqrt, reciprocal, pow, sigmoid). A generated patch
carries `inductor_math` too: its aligned code computes these ops as the engine's kernels do.
"""

from __future__ import annotations

import torch

INDUCTOR_MATH = frozenset({"tanh", "exp", "log", "sin", "cos", "erf", "sqrt", "expm1"})
# ops Inductor lowers through the math above (GELU: `0.5 * x * (1 + erf(x / sqrt(2)))`, or its tanh form), which a
# trainer runs as one ATen kernel with ATen's own math: computed as a one-op Inductor function too
GELU_FORMS = {"gelu": "none", "gelu_tanh": "tanh"}  # inductor_math name -> F.gelu's `approximate`
MATH_OPS = INDUCTOR_MATH | {"gelu"}


def math_form(op: str, kwargs: dict | None = None) -> str | None:
    """The `inductor_math` name computing ATen op `op` (short name) called with `kwargs`: the op itself for
    INDUCTOR_MATH, `gelu` / `gelu_tanh` by its `approximate`; None for any other op or argument."""
    kwargs = kwargs or {}
    if op == "gelu" and set(kwargs) <= {"approximate"}:
        return {v: k for k, v in GELU_FORMS.items()}.get(kwargs.get("approximate", "none"))
    return op if op in INDUCTOR_MATH and not kwargs else None


def inductor_math(name: str, x: torch.Tensor, scalar: bool = False) -> torch.Tensor:
    """`torch.<name>(x)` (FP32; `gelu`, `gelu_tanh`: `F.gelu`, GELU_FORMS) as an Inductor-generated kernel computes
    it: through a one-op function Inductor compiles (once per op, for any shape; flattened, so the vectorized path
    with a masked tail runs, as in the engine's kernels). `scalar`: as a loop Inductor did not vectorize computes it
    (`std::exp`, the C library's, in a router's two-wide top-k loop), compiled without vectors. Registered as one
    op, `graphdiff::inductor_<name>` (`..._scalar`), so a traced or compiled trainer keeps it whole; its gradient is
    the eager op's, by recompute."""
    op_id = f"inductor_{name}_scalar" if scalar else f"inductor_{name}"
    try:
        return getattr(torch.ops.graphdiff, op_id)(x)
    except AttributeError:
        pass
    # a patch carries this function's source alone: the GELU forms (GELU_FORMS) are spelled out here
    approximate = {"gelu": "none", "gelu_tanh": "tanh"}.get(name)
    eager = getattr(torch, name) if approximate is None else (
        lambda t: torch.nn.functional.gelu(t, approximate=approximate))

    def one_op(t: torch.Tensor) -> torch.Tensor:
        return eager(t)

    # a code object per op: Dynamo keeps compiled code per code object, and a shared one recompiles for each op
    one_op.__code__ = one_op.__code__.replace(co_name=op_id)
    # Inductor's FX graph cache keys the generated code by graph and config, not by the vector ISA it was generated
    # for; this process compiles it for its own. An 8-lane (AVX2) kernel compiled with AVX-512's 16-lane vectors
    # stores past its buffer, so wherever a cache is shared by CPUs of another width (a patch in a cluster's shared
    # cache; posing processes keep their own, cpu_kind) the ISA's width, in the config, keys it.
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    bits = 1 if scalar else pick_vec_isa().bit_width()  # simdlen 1: Inductor emits no vectors
    compiled = torch.compile(one_op, backend="inductor", dynamic=True, fullgraph=True,
                             options={"cpp.simdlen": bits} if bits else None)

    @torch.library.custom_op(f"graphdiff::{op_id}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        if torch.fx._symbolic_trace.is_fx_symbolic_tracing():  # a trace records the op; running the graph computes it
            return eager(x)
        flat = x.detach().contiguous().reshape(-1)
        with torch.no_grad():  # the forward only (one compiled entry); the gradient is `backward`'s
            if flat.numel() < 2:  # dynamic=True specializes 0/1-element inputs; pad to keep the vector path
                return compiled(torch.cat([flat, flat.new_zeros(2 - flat.numel())]))[: x.numel()].reshape(x.shape)
            return compiled(flat).reshape(x.shape)

    @op.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    def backward(ctx: torch.autograd.function.BackwardCFunction, grad: torch.Tensor) -> torch.Tensor:
        (saved,) = ctx.saved_tensors
        with torch.enable_grad():
            x = saved.detach().requires_grad_(True)
            return torch.autograd.grad(eager(x), x, grad)[0]

    op.register_autograd(backward, setup_context=setup_context)
    return op(x)
