"""One attention layer's training cost, as the unpatched, the portable and the `--exact` patch compute it.

    python benchmarks/attention_cost.py                      # Qwen3-0.6B's heads: 16 q, 8 kv, dim 128, 1 x 1024
    python benchmarks/attention_cost.py --heads 16 --kv-heads 8 --dim 128 --seq 4096

HF's sdpa on BF16 q/k/v (unpatched); the portable splice's attention (HF's sdpa on FP32-upcast q/k/v); the exact
splice (`attention_engine_op`: vLLM CPU's op forward, FP32 attention's gradient recomputed from the saved inputs;
needs vLLM). Forward, and forward + backward, each the median of --repeat runs in this process's CPU time at
--threads 1 (the machine may be shared), in ms.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable

import torch
from patch_region_cost import timed  # beside this script


def cpu_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median CPU milliseconds of `repeat` runs after a warm-up (patch_region_cost.timed)."""
    return round(1e3 * timed(fn, repeat), 1)


class Layer(torch.nn.Module):
    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


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
    forms = {"unpatched (BF16 sdpa)": sdpa_attention_forward, "portable (FP32 sdpa)": attention_fp32_inputs}
    if importlib.util.find_spec("vllm") is not None:
        forms["exact (engine op, FP32 gradient)"] = attention_engine_op
    result = {}
    for name, fn in forms.items():
        q, k, v = (t.clone().requires_grad_() for t in qkv)

        def forward(fn: Callable = fn, q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> torch.Tensor:
            return fn(layer, q, k, v, None, scaling=scale)[0]

        def step(forward: Callable = forward) -> None:
            out = forward()
            out.backward(torch.full_like(out, 1e-3))

        with torch.no_grad():
            fwd = cpu_ms(forward, args.repeat)
        result[name] = {"fwd_ms": fwd, "fwd_bwd_ms": cpu_ms(step, args.repeat)}
    print(json.dumps({"shape": vars(args), "torch": torch.__version__, "forms": result}, indent=1))


if __name__ == "__main__":
    main()
