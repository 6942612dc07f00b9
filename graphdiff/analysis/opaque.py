"""Opaque engine kernels: what the engine's attention rounds inside, and whether the trainer's differs.

The scan sees inside generated kernels (replay); an extern attention kernel is opaque. What it keeps in
FP32 inside comes from this registry, keyed by the backend the engine reports (`Capture.attention`).
The trainer side is decided numerically, as for every other site: its attention node is re-run on
FP32-upcast inputs and the result rounded once; where that differs from the trainer's stored output,
the trainer rounds inside its attention (softmax probabilities stored as BF16 before P@V) and the
engine, per the registry, does not. One decision (a site) per layer, rule `opaque-registry`, region kind
`attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphdiff.capture.cpu_kind import stores_truncate
from graphdiff.ops import is_attention
from graphdiff.records import Decision, Evidence, Graph, SideState, layer_of


@dataclass(frozen=True)
class AttentionRule:
    backend: str  # the engine's attention backend name (vLLM: AttentionBackend.get_name())
    isa: str | None  # the backend's kernel variant where it matters (vLLM CPU: vec, vec16, amx), None: any
    probabilities_fp32: bool  # P stays FP32 into P@V (scores, softmax and accumulation FP32 too)
    source: str  # where this is known from


RULES = (
    AttentionRule("CPU_ATTN", "vec", True,
                  "vLLM csrc/cpu/cpu_attn_vec.hpp: q scaled in FP32, scores, softmax, P and P@V in FP32, output "
                  "rounded once; the op equals torch sdpa on FP32-upcast q/k/v rounded once "
                  "(tests/test_opaque_engine.py); on the `_C_AVX2` build its 8-lane vectors sum in another order: "
                  "equal on >= 99.9% of outputs, the rest a few ulp (tests/test_engine_attention.py)"),
    AttentionRule("CPU_ATTN", "amx", False,
                  "vLLM's CPU amx kernel (CPUs with AMX tiles): scores and softmax in FP32, the unnormalized "
                  "probabilities exp(s - running max) rounded to BF16 for the AMX P@V, FP32 accumulation, divided by "
                  "the row sum at the end; it equals that computation on >= 99.9% of outputs up to 2048 keys at head "
                  "size 64, and HF's BF16 sdpa rounds P too: no rounding-location site (tests/test_opaque_engine.py)"),
    AttentionRule("FLASH_ATTN", None, False, "FlashAttention casts P to BF16 for P@V, as torch's CUDA sdpa does"),
    AttentionRule("FLASHINFER", None, False, "FlashInfer casts P to BF16 for P@V, as torch's CUDA sdpa does"),
    AttentionRule("TRITON_ATTN", None, False, "vLLM's Triton attention casts P to the value dtype for P@V"),
)


@dataclass(frozen=True)
class ExternRule:
    """What an opaque engine op (an extern kernel call) rounds, by the name the capture gives the call."""

    op: str  # a substring of the extern's name ("onednn_mm", "_C.rotary_embedding")
    kind: str  # matmul | attention | kv-cache | norm | activation | rope | allreduce
    fp32_inside: bool  # FP32 from its inputs to its outputs, each output rounded once
    rounds: str  # what it rounds, in one line
    source: str  # where this is known from: a test against the real op (tests/test_opaque_ops_engine.py)
    # the claim holds only where the op rounds to nearest even: not for vLLM CPU's `_C_AVX512` / `_C_AVX2` builds,
    # which store BF16 by truncation (a rounding in another mode than the trainer's, at the same place; the patch's
    # emulations round to nearest): there the entry describes nothing and the op's sites are unproven
    nearest_only: bool = False


_TESTED = "tests/test_opaque_ops_engine.py, against the real op"
EXTERNS = (
    ExternRule("onednn_mm", "matmul", True, "one GEMM accumulated in FP32, the result rounded once",
               f"equals F.linear on the same BF16 inputs bit for bit at 1 to 513 rows ({_TESTED})"),
    ExternRule("weight_packed_linear", "matmul", True,
               "one GEMM accumulated in FP32 (AMX tiles), the bias added in FP32, the result rounded once",
               f"vLLM CPU's small-weight GEMM on AMX CPUs; equals F.linear on >= 99.9% of outputs at 1 to 2048 rows, "
               f"the rest summation order ({_TESTED})"),
    ExternRule("extern_kernels.mm", "matmul", True, "ATen GEMM, result rounded once", "Inductor's extern: ATen mm"),
    ExternRule("extern_kernels.addmm", "matmul", True, "ATen GEMM + bias, result rounded once", "ATen addmm"),
    ExternRule("extern_kernels.bmm", "matmul", True, "ATen batched GEMM, result rounded once", "ATen bmm"),
    ExternRule("unified_attention", "attention", False, "per attention backend (RULES)", "RULES in this module"),
    ExternRule("unified_kv_cache_update", "kv-cache", True, "copies BF16 keys/values into the paged KV cache",
               "a copy in the cache dtype: no arithmetic"),
    ExternRule("_C.rms_norm", "norm", True, "RMSNorm in FP32 (the weight multiply too), output rounded once",
               _TESTED, nearest_only=True),
    ExternRule("_C.fused_add_rms_norm", "norm", False,
               "writes residual = bf16(x + r); the norm applies the FP32 sum's variance to that BF16 sum, in FP32, "
               "output rounded once", _TESTED, nearest_only=True),
    ExternRule("_C.silu_and_mul", "activation", True, "silu(gate) * up in FP32, rounded once", _TESTED,
               nearest_only=True),
    ExternRule("_C.gelu_and_mul", "activation", True, "gelu(gate) * up in FP32 (erf form), rounded once", _TESTED,
               nearest_only=True),
    ExternRule("_C.gelu_tanh_and_mul", "activation", True,
               "tanh-gelu(gate) * up in FP32 (the kernel's vectorized tanh), rounded once", _TESTED,
               nearest_only=True),
    ExternRule("_C.rotary_embedding", "rope", True,
               "q/k rotated in FP32 with a BF16 cos/sin cache, each rounded once, in place", _TESTED,
               nearest_only=True),
    ExternRule("aten.topk", "selection", False, "selects the k largest values and their indices: no arithmetic",
               "a selection (ATen topk)"),
    ExternRule("_C.cpu_fused_moe", "moe", False,
               "gate/up GEMM and SiLU in FP32, silu(gate) * up rounded to BF16 once (the down GEMM's input), the "
               "down GEMM and the weighted sum over the top-k experts in FP32 with FP32 routing weights, output "
               "rounded once",
               f"equals moe_engine.moe_experts_like_engine on the same inputs on 100% of outputs ({_TESTED})",
               nearest_only=True),
    ExternRule("_C.shm_allreduce", "allreduce", True, "sums the ranks' BF16 partials in FP32, rounds once (truncates "
               "on the _C_AVX512 build; _C_AVX2 has no shm ops: torch.distributed's all-reduce below)",
               "vLLM CPU's tensor-parallel all-reduce: output = bf16(FP32 sum of the ranks' BF16 inputs), checked on "
               "every call a TP scan records (scan.json replay) and in tests/test_tp_engine.py"),
    # vLLM CPU's fallback where its ops build has no shared-memory all-reduce (`_C_AVX2`): torch.distributed (gloo),
    # which Dynamo traces to this functional collective and Inductor calls in place; torch's own BF16 sum, so the
    # ops build's truncation does not apply to it (tensor_parallel.allreduce_truncates)
    ExternRule("_c10d_functional.all_reduce", "allreduce", True,
               "sums the ranks' BF16 inputs, each addition rounded to BF16 (nearest even) in gloo's ring order: for 2 "
               "ranks bf16(FP32 sum), rounded once",
               "torch.distributed's gloo all-reduce, measured with 2 to 4 ranks: 2 ranks equal the FP32 sum rounded "
               "once to nearest even on 100%, more ranks a per-element order of BF16 additions; checked on every "
               "call a TP scan records (scan.json replay) and in tests/test_tp_engine.py"),
)


def extern_rule(name: str, build: str = "") -> ExternRule | None:
    """The registry entry of an extern by its name; none where the entry's claim does not hold for the engine's
    ops `build` (cpu_kind.kernel_build)."""
    rule = next((r for r in EXTERNS if r.op in name), None)
    return None if rule is not None and rule.nearest_only and stores_truncate(build) else rule


def truncates_output(info: dict[str, str]) -> bool:
    """Does the engine's attention op store its output by truncation (vLLM CPU's `_C_AVX512` / `_C_AVX2` builds,
    loaded on CPUs without AVX-512 BF16) rather than rounding to nearest even?"""
    return info.get("backend") == "CPU_ATTN" and stores_truncate(info.get("build", ""))


def exp_polynomial(info: dict[str, str]) -> bool:
    """Does the engine's attention op compute exp (its softmax, its softcap's tanh) by vLLM CPU's AVX-512 polynomial
    (`fast_exp`, csrc/cpu/cpu_attn_macros.h: the `_C` and `_C_AVX512` builds) rather than the C library's
    (`_C_AVX2`)?"""
    return info.get("backend") == "CPU_ATTN" and info.get("build") in ("_C", "_C_AVX512")


def attention_rule(info: dict[str, str]) -> AttentionRule | None:
    for rule in RULES:
        if rule.backend == info.get("backend") and rule.isa in (None, info.get("isa")):
            return rule
    return None


def _changed_fraction(n: torch.fx.Node, values: dict[str, Any]) -> tuple[float, str] | None:
    """Fraction of the attention output that differs from the same op on FP32 inputs rounded once, and the
    output's dtype."""
    from graphdiff.analysis.rounding import rerun_fp32

    out = values.get(n.name)
    out = out[0] if isinstance(out, tuple | list) else out
    if not isinstance(out, torch.Tensor) or out.dtype == torch.float32:
        return None
    try:
        exact = rerun_fp32(n, values)
    except Exception:  # an op that refuses FP32 inputs: no evidence either way
        return None
    exact = exact[0] if isinstance(exact, tuple | list) else exact
    return float((exact.to(out.dtype) != out).float().mean()), str(out.dtype).removeprefix("torch.")


def attention_decisions(info: dict[str, str], graph: Graph, gm: torch.fx.GraphModule | None,
                        values: dict[str, Any], engine_graphs: list[Graph],
                        ids: dict[str, str]) -> tuple[list[Decision], list[str]]:
    """Decisions (sites) where the trainer's attention rounds inside and the engine's (per the registry) does
    not, and notes on what could not be compared."""
    if not info:
        return [], ["the engine capture does not say which attention kernel ran: attention internals not compared"]
    rule = attention_rule(info)
    label = f"{info.get('backend')}" + (f" ({info['isa']})" if info.get("isa") else "")
    if rule is None:
        return [], [f"engine attention {label}: not in graphdiff's registry of opaque kernels, its internal "
                    "rounding is not compared"]
    if not rule.probabilities_fp32 or gm is None:
        return [], []
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    # the engine's attention calls, in layer order (one per layer, like the trainer's)
    calls = [(g.name, k.id) for g in engine_graphs for k in g.kernels if k.kind == "extern" and "attention" in k.name]
    attention = [n for n in graph.nodes
                 if n.op == "call_function" and is_attention(n.target) and n.name in fx_nodes]
    out = []
    for i, n in enumerate(attention):
        found = _changed_fraction(fx_nodes[n.name], values)
        if found is None or not found[0]:
            continue
        changed, dtype = found
        graph_name, call = calls[i] if len(calls) == len(attention) else ("", "")
        out.append(Decision(
            id=ids[n.name], node=n.name, op=n.target, module=n.module, layer=layer_of(n.module),
            train=SideState(dtype=dtype, rounds=True, on_grid=True, changed=changed,
                            how=f"rounds P to BF16 inside (changes {changed:.0%} of its output vs FP32 inputs)"),
            engine=SideState(dtype=dtype, how=f"P kept FP32 inside {label} (registry)" + (
                f", output truncated to {dtype} ({info['build']})" if truncates_output(info) else "")),
            rule="opaque-registry", site=True,
            evidence=Evidence(engine_graph=graph_name, kernel=call, registry=f"engine {label}: {rule.source}")))
    return out, []

