"""One attention layer's training cost, as the unpatched, the portable and the `--exact` patch compute it.

    python benchmarks/attention_cost.py                      # Qwen3-0.6B's heads: 16 q, 8 kv, dim 128, 1 x 1024
    python benchmarks/attention_cost.py --heads 16 --kv-heads 8 --dim 128 --seq 4096

HF's sdpa on BF16 q/k/v (unpatched); the portable splice's attention (HF's sdpa on FP32-upcast q/k/v); the exact
splice (`attention_engine_op`: vLLM CPU's op forward, FP32 attention's gradient recomputed from the saved inputs;
needs vLLM); each of the two patched ones also with `runtime.apply(attention_gradient="bf16")`'s gradient (the BF16
flash kernel's backward at the FP32 forward's output and log-sum-exp). Forward, and forward + backward, each the
median of --repeat runs in this process's CPU time at --threads 1 (the machine may be shared), in ms; `saved_mib`:
what the forward keeps for the backward beyond the BF16 q/k/v it is given; `grad_rel_err`: its q, k and v
gradients' distance from FP32 attention's (the portable form's) relative to their norm, for one seeded output
gradient.

`lse_backward`: the lever of a flash-style backward for the exact splice, from the engine's output and a log-sum-exp
(the engine's op gives none): the log-sum-exp computed alone (causal, in query blocks) against torch's whole FP32
flash forward (which the exact backward runs now and which yields it too), and how many BF16 gradient elements the
flash backward from the engine's output gives equal to the exact FP32 gradient's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable

import torch
from patch_memory_benchmark import saved_storages  # beside this script

from graphdiff.measure.splice_cost import timed


def cpu_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median CPU milliseconds of `repeat` runs after a warm-up (splice_cost.timed)."""
    return round(1e3 * timed(fn, repeat), 1)


class Layer(torch.nn.Module):
    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def saved_mib(fn: Callable[[], object], given: list[torch.Tensor]) -> float:
    """MiB of the distinct tensors autograd keeps while `fn` runs, less the storages of `given`."""
    _, kept = saved_storages(fn)
    own = {t.untyped_storage().data_ptr() for t in given}
    return round(sum(n for p, n in kept.items() if p not in own) / 2**20, 2)


def causal_lse(q: torch.Tensor, k: torch.Tensor, scale: float, block: int = 256) -> torch.Tensor:
    """log-sum-exp of each query's causal FP32 scores [batch, heads, seq], over query blocks (keys up to the block's
    last query): what a flash-style backward needs beside the output."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, 1)
    seq = q.shape[2]
    out = q.new_empty(q.shape[:3])
    for start in range(0, seq, block):
        end = min(seq, start + block)
        scores = torch.matmul(q[:, :, start:end], k[:, :, :end].transpose(-1, -2)).mul_(scale)
        scores.masked_fill_(~torch.ones(end - start, end, dtype=torch.bool).tril(start), float("-inf"))
        out[:, :, start:end] = torch.logsumexp(scores, -1)
    return out


def lse_backward(qkv: list[torch.Tensor], layer: torch.nn.Module, scale: float, repeat: int) -> dict:
    """The flash-style backward of the exact splice, measured (see the module's docstring)."""
    from graphdiff.codegen.attention_splice import attention_engine_op

    q, k, v = (t.float() for t in qkv)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    leaves = [t.clone().requires_grad_() for t in qkv]
    engine = attention_engine_op(layer, *leaves, None, scaling=scale)[0]
    grad = torch.full_like(engine, 1e-3)
    exact = torch.autograd.grad(engine, leaves, grad)
    lse = causal_lse(q, k, scale)
    from_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.float().transpose(1, 2), q, k, v, engine.detach().float().transpose(1, 2), lse, 0.0, True, scale=scale)
    return {"lse_alone_ms": cpu_ms(lambda: causal_lse(q, k, scale), repeat),
            "flash_forward_ms": cpu_ms(lambda: flash(q, k, v, 0.0, True, scale=scale), repeat),
            "gradient_elements_equal": [round(float((a.bfloat16() == b).float().mean()), 4)
                                        for a, b in zip(from_lse, exact)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from graphdiff.codegen.attention_splice import attention_engine_op, attention_fp32_inputs

    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, h, args.seq, args.dim, generator=gen).bfloat16() for h in (args.heads, args.kv_heads,
                                                                                     args.kv_heads)]
    layer, scale = Layer(args.heads // args.kv_heads), args.dim ** -0.5
    bf16 = Layer(args.heads // args.kv_heads)
    bf16._graphdiff_attention_gradient = "bf16"  # what runtime.apply(attention_gradient="bf16") sets
    forms = {"unpatched (BF16 sdpa)": (sdpa_attention_forward, layer),
             "portable (FP32 sdpa)": (attention_fp32_inputs, layer),
             "portable, bf16 gradient": (attention_fp32_inputs, bf16)}
    if importlib.util.find_spec("vllm") is not None:
        forms["exact (engine op, FP32 gradient)"] = (attention_engine_op, layer)
        forms["exact, bf16 gradient"] = (attention_engine_op, bf16)
    result: dict[str, dict] = {}
    probe = torch.randn(1, args.seq, args.heads, args.dim, generator=gen).bfloat16()  # an output gradient
    grads: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, (fn, module) in forms.items():
        q, k, v = (t.clone().requires_grad_() for t in qkv)

        def forward(fn: Callable = fn, q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                    module: torch.nn.Module = module) -> torch.Tensor:
            return fn(module, q, k, v, None, scaling=scale)[0]

        def step(forward: Callable = forward) -> None:
            out = forward()
            out.backward(torch.full_like(out, 1e-3))

        with torch.no_grad():
            fwd = cpu_ms(forward, args.repeat)
        result[name] = {"fwd_ms": fwd, "fwd_bwd_ms": cpu_ms(step, args.repeat),
                        "saved_mib": saved_mib(forward, [q, k, v])}
        grads[name] = torch.autograd.grad(forward(), (q, k, v), probe)
    exact = grads["portable (FP32 sdpa)"]  # FP32 attention's gradient (rounded to BF16)
    for name, got in grads.items():  # each form's q/k/v gradient error relative to it
        result[name]["grad_rel_err"] = [round(float((g.float() - e.float()).norm() / e.float().norm()), 5)
                                        for g, e in zip(got, exact)]
    lse = lse_backward(qkv, layer, scale, args.repeat) if "exact, bf16 gradient" in forms else None
    print(json.dumps({"shape": vars(args), "torch": torch.__version__, "forms": result, "lse_backward": lse},
                     indent=1))


if __name__ == "__main__":
    main()
