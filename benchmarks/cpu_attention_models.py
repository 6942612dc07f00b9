"""How vLLM CPU's attention kernel rounds, measured against candidate models of it on seeded causal prefills.

    PYTHONPATH=. python benchmarks/cpu_attention_models.py   (on the CPU whose kernel it measures: vec, or amx)

Per head size and sequence length, the fraction of the kernel's BF16 outputs equal to: torch's sdpa on FP32-upcast
inputs rounded once (P kept FP32: the `vec` registry entry), torch's sdpa on the BF16 inputs (HF's trainer), and
scores/softmax in FP32 with the unnormalized probabilities exp(s - max) rounded to BF16 before P@V (the `amx` entry).
The numbers back graphdiff.analysis.opaque.RULES; tests/test_opaque_engine.py checks the claim at one size.
"""

from __future__ import annotations

import torch

from tests.test_opaque_engine import sdpa, unnormalized_p_in_bf16, vllm_cpu_attention


def main() -> None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    print("| isa | head size | keys | sdpa, FP32 inputs | sdpa, BF16 inputs | unnormalized P in BF16 |")
    print("|---|---|---|---|---|---|")
    for d in (64, 128):
        isa = _get_attn_isa(torch.bfloat16, 128, d, "auto")
        if isa == "amx":
            torch.cpu._init_amx()  # as vLLM's worker does; without it the AMX kernel dies of SIGILL
        for s in (16, 96, 600, 2048):
            gen = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(s, n, d, generator=gen).mul(2).to(torch.bfloat16) for n in (4, 2, 2))
            scale = d ** -0.5
            real = vllm_cpu_attention(q, k, v, scale, isa)
            rows = [sdpa(q.float(), k.float(), v.float(), scale), sdpa(q, k, v, scale),
                    unnormalized_p_in_bf16(q, k, v, scale)]
            print(f"| {isa} | {d} | {s} | " + " | ".join(f"{(r == real).float().mean():.2%}" for r in rows) + " |")


if __name__ == "__main__":
    main()
