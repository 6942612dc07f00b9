"""Mixture-of-experts as vLLM CPU computes it: what a router or experts splice runs in the trainer, and (`--exact`)
the engine's own fused-MoE op forward with that computation's gradient backward.

The generated patch carries the source of these two functions (the runtime imports nothing of the scanner); the
scan runs them for its numeric check of the trainer's experts (analysis.moe), and the registry entry
`_C.cpu_fused_moe` (opaque.EXTERNS) is tested against the real op with them. `module` is the trainer's own router
or experts module, whose forward they replace.
"""

from __future__ import annotations

import torch

from graphdiff.replay.inductor_math import inductor_math
from graphdiff.replay.sum_order import ordered_sum

# How the engine ran its experts and router (ScanResult.engine_experts); the generated module sets its own from the
# scan. MOE_ROUTER_LANES: the lanes the router's kernel sums its exps in (0: no such sum recorded)
MOE_ISA, MOE_ACTIVATION, MOE_PADDED_INTERMEDIATE, MOE_ROUTER_LANES = "vec", "silu", 0, 0
# The routed scaling factor the engine multiplies its experts' sum by (in FP32, unrounded), not the routing weights
MOE_OUTPUT_SCALE = 1.0
# The router's kernel computes the weights' exp unvectorized (std::exp, not SLEEF's: ScanResult.engine_experts)
MOE_ROUTER_SCALAR_EXP = False
# The router's kernel computes the logsumexp in one unvectorized loop (std::exp, summed left to right, std::log), and
# keeps it FP32 for the weights (MOE_ROUTER_LOGSUMEXP_FP32) rather than storing it in BF16
MOE_ROUTER_SCALAR_LOGSUMEXP, MOE_ROUTER_LOGSUMEXP_FP32 = False, False
# The engine takes the router's top-k unsorted: the experts' order decides the order their weights are summed in
MOE_ROUTER_TOPK_SORTED = True
# The engine runs the MoE block's one-output linears (a shared expert's gate) as a GEMM of its own (oneDNN)
MOE_ONE_OUTPUT_GEMM = False
# The engine adds a shared expert's down GEMM to the experts' sum inside one ATen addmm (Inductor folds
# add(mm(a, b), c) into addmm(c, a, b) where the GEMM is ATen's: vLLM CPU's _C_AVX2 build has no oneDNN)
MOE_ADDMM_COMBINE = False


def moe_constants(engine_experts: dict[str, str]) -> list[str]:
    """The generated module's lines that set the engine's experts and router constants."""
    e = engine_experts
    return [f"MOE_ISA, MOE_ACTIVATION, MOE_PADDED_INTERMEDIATE, MOE_ROUTER_LANES = {e.get('isa', 'vec')!r}, "
            f"{e.get('activation', 'silu')!r}, {int(e.get('padded_intermediate', 0))}, {int(e.get('router_lanes', 0))}",
            f"MOE_OUTPUT_SCALE = {float(e.get('output_scale', 1.0))!r}",
            f"MOE_ROUTER_SCALAR_EXP = {e.get('router_exp') == 'scalar'}",
            f"MOE_ROUTER_SCALAR_LOGSUMEXP, MOE_ROUTER_LOGSUMEXP_FP32 = "
            f"{e.get('router_logsumexp', '').startswith('scalar')}, {e.get('router_logsumexp') == 'scalar-fp32'}",
            f"MOE_ROUTER_TOPK_SORTED = {e.get('router_topk') != 'unsorted'}",
            f"MOE_ONE_OUTPUT_GEMM = {bool(e.get('one_output_gemm'))}",
            f"MOE_ADDMM_COMBINE = {bool(e.get('addmm_combine'))}"]


def left_to_right_sum(t: torch.Tensor) -> torch.Tensor:
    """The last dimension's sum, element after element (keepdim): an unrolled row's order."""
    total = t[..., :1]
    for i in range(1, t.shape[-1]):
        total = total + t[..., i:i + 1]
    return total


def moe_router_like_engine(module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """vLLM CPU's routing: top-k of the BF16 router logits (the GEMM reads BF16 inputs; unsorted, where the engine's is:
    MOE_ROUTER_TOPK_SORTED), softmax over those k in FP32
    (renormalized: their exps summed left to right, as the engine's kernel unrolls the row; else their share of all)
    with the exp of the engine's Inductor kernel (vectorized or, where MOE_ROUTER_SCALAR_EXP, not: the weights' exp
    in a two-wide loop; MOE_ROUTER_SCALAR_LOGSUMEXP: the logsumexp too, as one unrolled loop computes it),
    weights kept FP32. Returned in the order the module's own forward returns them (Qwen:
    logits, weights, indices; Granite: indices, weights, logits), told apart by dtype and width on the module's
    first call."""
    hidden_states = hidden_states.reshape(-1, module.weight.shape[1]).to(module.weight.dtype)
    logits = torch.nn.functional.linear(hidden_states, module.weight)
    values, indices = torch.topk(logits, module.top_k, dim=-1, sorted=MOE_ROUTER_TOPK_SORTED)
    if getattr(module, "norm_topk_prob", True):  # exp(v - max) / sum, exp as the engine's Inductor kernel computes it
        shifted = values.float() - values.float().amax(-1, keepdim=True)
        exps = inductor_math("exp", shifted, MOE_ROUTER_SCALAR_EXP)
        weights = exps / left_to_right_sum(exps)  # as the engine's kernel unrolls a top-k row's sum
    else:  # exp(v - logsumexp(logits)), logsumexp as the engine's kernel computes it
        x = logits.float()
        top = x.amax(-1, keepdim=True)
        top = torch.where(top.abs() == float("inf"), torch.zeros_like(top), top)
        if MOE_ROUTER_SCALAR_LOGSUMEXP:  # one unrolled scalar loop
            log_z = inductor_math("log", left_to_right_sum(inductor_math("exp", x - top, True)), True) + top
        else:  # exps summed in the kernel's lanes, log, + max
            exps = inductor_math("exp", x - top)
            total = ordered_sum(exps, [-1], True, MOE_ROUTER_LANES) if MOE_ROUTER_LANES else exps.sum(-1, keepdim=True)
            log_z = inductor_math("log", total) + top
        if not MOE_ROUTER_LOGSUMEXP_FP32:  # stored in the logits' dtype (BF16) between the kernel's loops
            log_z = log_z.to(logits.dtype).float()
        weights = inductor_math("exp", values.float() - log_z, MOE_ROUTER_SCALAR_EXP)
    order = module.__dict__.get("_graphdiff_router_order")
    if order is None:  # the module's own forward, once per module: which output is which, and its dtype
        with torch.no_grad():
            own = type(module).forward(module, hidden_states)
        order = [("indices" if not o.is_floating_point() else "logits"
                  if o.shape[-1] == logits.shape[-1] != weights.shape[-1] else "weights", o.dtype) for o in own]
        module.__dict__["_graphdiff_router_order"] = order
    got = dict(indices=indices, logits=logits, weights=weights)
    return tuple(got[kind] if kind == "weights" else got[kind].to(dtype) for kind, dtype in order)


def moe_experts_like_engine(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """vLLM CPU's fused MoE: gate/up GEMM and the activation in FP32, silu(gate) * up rounded once, the down GEMM
    and the weighted sum over the chosen experts in FP32, the output rounded once. It reads its input in the weights'
    dtype, as the engine's op reads the stored activation (the patched trainer may hand it FP32)."""
    low = module.gate_up_proj.dtype
    x = hidden_states.to(low).float()
    out = torch.zeros(x.shape[0], module.down_proj.shape[1], dtype=torch.float32, device=x.device)
    inter = module.gate_up_proj.shape[1] // 2
    for e in top_k_index.unique().tolist():
        tokens, slot = torch.where(top_k_index == e)
        gate_up = x[tokens] @ module.gate_up_proj[e].float().t()
        act = (module.act_fn(gate_up[:, :inter]) * gate_up[:, inter:]).to(low)
        down = act.float() @ module.down_proj[e].float().t()
        out.index_add_(0, tokens, down * top_k_weights[tokens, slot, None].float())
    return out.to(low).to(hidden_states.dtype)


PATCH_PARTS = (left_to_right_sum, moe_router_like_engine, moe_experts_like_engine)
ROUTER_FN, EXPERTS_FN = moe_router_like_engine.__name__, moe_experts_like_engine.__name__


def _packed_experts(module, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's expert weights as the engine holds them: the gate and up halves each zero-padded to
    MOE_PADDED_INTERMEDIATE rows, then packed for MOE_ISA (vLLM CPU's `prepack_moe_weight`). Kept on the module until
    the weights change (an optimizer step bumps their version)."""
    import vllm._custom_ops  # noqa: F401 - loads the op library (torch.ops._C)

    key = (gate_up_proj.data_ptr(), gate_up_proj._version, down_proj.data_ptr(), down_proj._version)
    cached = module.__dict__.get("_graphdiff_packed_experts")
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        experts, two_inter, hidden = gate_up_proj.shape
        inter, padded = two_inter // 2, MOE_PADDED_INTERMEDIATE
        w13 = gate_up_proj.new_zeros(experts, 2 * padded, hidden)
        w13[:, :inter], w13[:, padded:padded + inter] = gate_up_proj[:, :inter], gate_up_proj[:, inter:]
        w2 = down_proj.new_zeros(experts, hidden, padded)
        w2[:, :, :inter] = down_proj
        packed = (torch.empty_like(w13), torch.empty_like(w2))
        torch.ops._C.prepack_moe_weight(w13, packed[0], MOE_ISA)
        torch.ops._C.prepack_moe_weight(w2, packed[1], MOE_ISA)
    module.__dict__["_graphdiff_packed_experts"] = (key, packed)
    return packed


class _EngineExperts(torch.autograd.Function):
    """Forward: the engine's fused-MoE op. Backward: the exact gradient of the same computation in FP32 PyTorch ops
    (moe_experts_like_engine), recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, module):  # noqa: ANN001, ANN205
        ctx.save_for_backward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
        ctx.module = module
        w13, w2 = _packed_experts(module, gate_up_proj, down_proj)
        x = hidden_states.to(gate_up_proj.dtype).contiguous()  # the op reads the activation as the engine stores it
        out = torch.empty_like(x)
        torch.ops._C.cpu_fused_moe(out, x, w13, w2, None, None, top_k_weights.float().contiguous(),
                                   top_k_index.to(torch.int32).contiguous(), False, MOE_ACTIVATION, MOE_ISA)
        return out.to(hidden_states.dtype)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad)
                      for t in (hidden_states, top_k_weights, gate_up_proj, down_proj)]
            x, weights, w13, w2 = leaves

            class Weights:  # the module's weights as the recompute's leaves
                gate_up_proj, down_proj, act_fn = w13, w2, ctx.module.act_fn

            out = moe_experts_like_engine(Weights, x, top_k_index, weights)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_output) if wanted else [])
        g = [next(grads) if t.requires_grad else None for t in leaves]
        return g[0], None, g[1], g[2], g[3], None


def moe_experts_engine_op(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts as the engine computes them, by the engine's own op (vLLM CPU's `cpu_fused_moe` with the ISA and
    activation its graph called it with): bit for bit the engine's output at every batch size, times the routed
    scaling factor where the engine scales the sum (MOE_OUTPUT_SCALE: in FP32, left unrounded as the engine's next
    kernel holds it) and the router splice handed the weights unscaled; the backward is moe_experts_like_engine's
    exact gradient."""
    out = _EngineExperts.apply(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj,
                               module)
    unscaled = top_k_weights.__dict__.get("_graphdiff_unscaled", False)
    return out.float() * MOE_OUTPUT_SCALE if MOE_OUTPUT_SCALE != 1.0 and unscaled else out


ENGINE_PARTS = (_packed_experts, _EngineExperts, moe_experts_engine_op)
ENGINE_EXPERTS_FN = moe_experts_engine_op.__name__

def _engine_gemm(module, weight: torch.Tensor):  # noqa: ANN202 - vLLM's handle object
    """The engine's GEMM of `weight` (the module's, in the dtype the computation reads it in) as vLLM CPU's linear
    layer makes it (a oneDNN matmul handle), kept on the module until its weight changes; dropped at exit while the
    op library that frees it is still loaded."""
    import atexit

    import vllm._custom_ops as ops

    key = (module.weight.data_ptr(), module.weight._version, weight.dtype)
    cached = module.__dict__.get("_graphdiff_engine_gemm")
    if cached is not None and cached[0] == key:
        return cached[1]
    if cached is None:
        atexit.register(module.__dict__.pop, "_graphdiff_engine_gemm", None)
    handle = ops.create_onednn_mm(weight.detach().t(), 32)
    module.__dict__["_graphdiff_engine_gemm"] = (key, handle)
    return handle


class _EngineGemm(torch.autograd.Function):
    """Forward: `x @ weight.T` by the engine's GEMM op, in the weight's dtype. Backward: the linear's exact
    gradient."""

    @staticmethod
    def forward(ctx, x, weight, module):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        import vllm._custom_ops as ops

        return ops.onednn_mm(_engine_gemm(module, weight), x.to(weight.dtype).contiguous(), None)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        grad = grad_output.to(weight.dtype)
        grad_x = (grad @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def linear_engine_op(module, hidden_states: torch.Tensor) -> torch.Tensor:
    """An `nn.Linear` with one output and no bias (a shared expert's gate) by the engine's GEMM: ATen computes a
    one-output linear on another path than a GEMM (a matrix-vector product), whose sums differ from the engine's
    oneDNN matmul on about 0.01% of rows; the engine's input is what it stores (BF16)."""
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    return _EngineGemm.apply(x, module.weight, module).reshape(*hidden_states.shape[:-1], 1)


class _EngineLinear(torch.overrides.TorchFunctionMode):
    """While the router's own forward runs: its FP32 logits GEMM (`F.linear` of FP32 input and weight, no bias) by
    the engine's op; every other op as written."""

    def __init__(self, module) -> None:  # noqa: ANN001
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) >= 2 and args[2:] in ((), (None,)) \
                and kwargs.get("bias") is None and args[0].dtype == args[1].dtype == torch.float32:
            x, weight = args[0], args[1]
            logits = _EngineGemm.apply(x.reshape(-1, x.shape[-1]), weight, self.module)
            return logits.reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


def moe_router_engine_gemm(module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The router module's own routing (grouped top-k, sigmoid scores, correction bias, renormalization: as the
    engine's routing computes them) with its FP32 logits GEMM run by the engine's op (vLLM CPU's oneDNN matmul),
    whose sums run in another order than ATen's; the input is the FP32 value the engine's GEMM reads. Where the
    engine scales the experts' sum by the routed scaling factor (MOE_OUTPUT_SCALE), the weights stay unscaled, as
    its routing leaves them."""
    scale = getattr(module, "routed_scaling_factor", None)
    if MOE_OUTPUT_SCALE != 1.0 and scale is None:
        raise RuntimeError(f"{type(module).__name__} has no routed_scaling_factor: the engine scales the experts' "
                           "sum, and this router's weights cannot be left unscaled; rescan this model")
    if MOE_OUTPUT_SCALE == 1.0:
        with _EngineLinear(module):
            return type(module).forward(module, hidden_states)
    try:
        module.routed_scaling_factor = 1.0
        with _EngineLinear(module):
            outs = type(module).forward(module, hidden_states)
    finally:
        module.routed_scaling_factor = scale
    for o in outs:  # the experts splice scales the sum of what it is handed unscaled
        if o.is_floating_point() and o.shape[-1] == module.top_k:
            o.__dict__["_graphdiff_unscaled"] = True
    return outs


class _AddmmCombine(torch.overrides.TorchFunctionMode):
    """While a module's own forward runs: a bias-free linear (of `weights`, by identity; any where empty) whose output
    is added to a tensor of its shape is computed as ATen's addmm of that tensor, in the linear's dtype as the engine
    stores it, and the linear's input and weight: the GEMM and the sum accumulated in FP32 and rounded once, as the
    engine's addmm (Inductor folds `add(mm(a, b), c)` so where the engine's GEMMs are ATen's). Where both addends are
    such linears the second is folded, as Inductor's pattern takes it; an in-place add writes the sum into its first
    addend. Where the engine's addmm adds the linear to another linear's output (`biases`: folded weight -> that
    linear's weight; vLLM's parallel block sums `attn + mlp` in one addmm) and the module's code added that output to
    a third value first (Cohere's `residual + attn + mlp`), the fold is `third + addmm(that output, ...)`. Every other
    op runs as written."""

    def __init__(self, weights: tuple[torch.Tensor, ...] = (),
                 biases: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()) -> None:
        super().__init__()
        self.weights = weights
        self.biases = biases
        self.linears: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (output, input, weight)
        self.sums: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (a + b, a, b) with b a bias's output

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and args[2:] in ((), (None,)) and kwargs.get("bias") is None \
                and (not self.weights or any(args[1] is w for w in self.weights)
                     or any(args[1] is b for _, b in self.biases)):
            out = func(*args, **kwargs)
            self.linears.append((out, args[0], args[1]))
            return out
        weight = next((w for w in (*self.weights, *(b for _, b in self.biases)) if _is_transpose(args[1], w)), None) \
            if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and len(args) == 2 else None
        if weight is not None:  # a linear written `x @ self.weight.T` (Falcon's FalconLinear)
            out = func(*args, **kwargs)
            self.linears.append((out, args[0], weight))
            return out
        in_place = func in (torch.Tensor.add_, torch.Tensor.__iadd__)
        if (in_place or func in (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)) \
                and len(args) == 2 and not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            found = next((i for a in (args[1], args[0]) for i, f in enumerate(self.linears)
                          if f[0] is a and self._folds(f[2])), None)
            folded = self.linears[found] if found is not None else None
            other = args[0] if folded is not None and folded[0] is args[1] else args[1]
            if found is not None and folded is not None and other.shape == folded[0].shape:
                out, x, weight = folded
                bias_weight = next((b for w, b in self.biases if w is weight), None)
                summed = next(((t, b) for s, t, b in self.sums if s is other), None)
                if bias_weight is None or self._made_by(other, bias_weight):
                    del self.linears[found]
                    total = self._addmm(other, x, weight, out.shape)
                    return args[0].copy_(total) if in_place else total
                if summed is not None and self._made_by(summed[1], bias_weight):
                    del self.linears[found]  # (third + bias output) + linear: third + addmm(bias output, ...)
                    total = summed[0] + self._addmm(summed[1], x, weight, out.shape)
                    return args[0].copy_(total) if in_place else total
            result = func(*args, **kwargs)
            made = next((a for a in args if any(self._made_by(a, b) for _, b in self.biases)), None)
            if made is not None and not in_place:
                self.sums.append((result, args[1] if args[0] is made else args[0], made))
            return result
        return func(*args, **kwargs)

    def _folds(self, weight: torch.Tensor) -> bool:
        """Is the linear of `weight` one the engine folds (any, where no weights are named)?"""
        return not self.weights or any(weight is w for w in self.weights)

    def _made_by(self, t: torch.Tensor, weight: torch.Tensor) -> bool:
        """Is `t` the output of a recorded linear of `weight`?"""
        return any(f[0] is t and f[2] is weight for f in self.linears)

    @staticmethod
    def _addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """ATen's addmm of `bias` and the linear `x @ weight.T`, in the weight's dtype, as the engine stores it."""
        flat = bias.to(weight.dtype).reshape(-1, weight.shape[0])
        return torch.addmm(flat, x.to(weight.dtype).reshape(-1, x.shape[-1]), weight.t()).reshape(shape)


def _is_transpose(t: object, weight: torch.Tensor) -> bool:
    """Is `t` the 2-D transpose view of `weight`?"""
    return isinstance(t, torch.Tensor) and t._base is weight and t.dim() == 2 and t.shape == weight.shape[::-1] \
        and t.stride() == weight.stride()[::-1]


def addmm_folded_forward(module, forward, weights, *args, addmm_biases=(), **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
    """`module`'s own `forward`, each bias-free linear of `weights` (any, where empty) whose output it adds to another
    value computed with that add as the engine's one addmm (`_AddmmCombine`; `addmm_biases`: folded weight -> the
    weight of the linear whose output the engine adds it to)."""
    with _AddmmCombine(tuple(weights), tuple(addmm_biases)):
        return forward(*args, **kwargs)


GEMM_PARTS = (_engine_gemm, _EngineGemm)
ROUTER_GEMM_PARTS = (_EngineLinear, moe_router_engine_gemm)
LINEAR_PARTS = (linear_engine_op,)
ADDMM_PARTS = (_is_transpose, _AddmmCombine, addmm_folded_forward)
ENGINE_ROUTER_FN = moe_router_engine_gemm.__name__
