"""Opaque engine kernels: what the engine's attention rounds inside, and whether the trainer's differs.

The scan sees inside generated kernels (replay); an extern attention kernel is opaque. What it keeps in
FP32 inside comes from this registry, keyed by the backend the engine reports (`Capture.attention`).
Every entry (attention rule or extern) names the device and the kernel library it describes; a lookup is by
(op, device, build), the device and the ops build being what the capture records (`engine_device`, a capture with
no device recorded being a CPU one), so a CPU entry never decides a CUDA op nor the reverse. CUDA entries carry a
reference written from the kernel's source (graphdiff.replay.cuda_reference).
The trainer side is decided numerically, as for every other site: its attention node is re-run on
FP32-upcast inputs and the result rounded once; where that differs from the trainer's stored output,
the trainer rounds inside its attention (softmax probabilities stored as BF16 before P@V) and the
engine, per the registry, does not. One decision (a site) per layer, rule `opaque-registry`, region kind
`attention`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphdiff.capture.cpu_kind import stores_truncate
from graphdiff.ops import is_attention
from graphdiff.records import MATMUL_REDUCED_FACT, Decision, Evidence, Graph, SideState, layer_of
from graphdiff.replay import cuda_reference as cuda


@dataclass(frozen=True)
class AttentionRule:
    backend: str  # the engine's attention backend name (vLLM: AttentionBackend.get_name())
    isa: str | None  # the backend's kernel variant where it matters (vLLM CPU: vec, vec16, amx), None: any
    probabilities_fp32: bool  # P stays FP32 into P@V (scores, softmax and accumulation FP32 too)
    source: str  # where this is known from
    device: str  # the device whose kernel it describes: "cpu" or "cuda"
    library: str  # the kernel library that runs it
    reference: Callable[..., torch.Tensor] | None = None  # what the kernel computes, in torch (CUDA entries)


_FA_SOURCE = ("Dao-AILab/flash-attention csrc/flash_attn/src/flash_fwd_kernel.h: `rP = convert_type<Element>(acc_s)` "
              "before the P@V gemm, FP32 accumulator rescaled per key block, row sum of the FP32 P, divided at the end")
RULES = (
    AttentionRule("CPU_ATTN", "vec", True,
                  "vLLM csrc/cpu/cpu_attn_vec.hpp: q scaled in FP32, scores, softmax, P and P@V in FP32, output "
                  "rounded once; the op equals torch sdpa on FP32-upcast q/k/v rounded once "
                  "(tests/test_opaque_engine.py); on the `_C_AVX2` build its 8-lane vectors sum in another order: "
                  "equal on >= 99.9% of outputs, the rest a few ulp (tests/test_engine_attention.py)",
                  "cpu", "vLLM CPU _C ops (cpu_attn)"),
    AttentionRule("CPU_ATTN", "amx", False,
                  "vLLM's CPU amx kernel (CPUs with AMX tiles): scores and softmax in FP32, the unnormalized "
                  "probabilities exp(s - running max) rounded to BF16 for the AMX P@V, FP32 accumulation, divided by "
                  "the row sum at the end; it equals that computation on >= 99.9% of outputs up to 2048 keys at head "
                  "size 64, and HF's BF16 sdpa rounds P too: no rounding-location site (tests/test_opaque_engine.py)",
                  "cpu", "vLLM CPU _C ops (cpu_attn, AMX)"),
    AttentionRule("FLASH_ATTN", None, False, _FA_SOURCE + " (vLLM vllm/v1/attention/backends/flash_attn.py calls "
                  "vllm_flash_attn's varlen forward); as torch's CUDA sdpa does", "cuda", "FlashAttention",
                  cuda.attention_p_bf16),
    AttentionRule("FLASHINFER", None, False,
                  "flashinfer include/flashinfer/attention/prefill.cuh `compute_sfm_v`: P cast to the input dtype "
                  "(`vec_cast` into `s_frag_f16`) for the P@V MMA, the row sum `d` taken from that BF16 P by an MMA; "
                  "FP32 accumulation (vLLM vllm/v1/attention/backends/flashinfer.py)", "cuda", "FlashInfer",
                  cuda.flashinfer_attention),
    AttentionRule("TRITON_ATTN", None, False,
                  "vLLM vllm/attention/ops/triton_unified_attention.py: `acc += tl.dot(P.to(V.dtype), V)` with the "
                  "row sum of the FP32 P, divided at the end (vllm/v1/attention/backends/triton_attn.py)", "cuda",
                  "vLLM Triton attention", cuda.attention_p_bf16),
)


@dataclass(frozen=True)
class ExternRule:
    """What an opaque engine op (an extern kernel call) rounds, by the name the capture gives the call, on the
    devices and the kernel library it describes."""

    op: str  # a substring of the extern's name ("onednn_mm", "_C.rotary_embedding")
    kind: str  # matmul | attention | kv-cache | norm | activation | rope | allreduce | selection | moe
    fp32_inside: bool  # FP32 from its inputs to its outputs, each output rounded once
    rounds: str  # what it rounds, in one line
    source: str  # where this is known from: a test against the real op (tests/test_opaque_ops_engine.py)
    devices: tuple[str, ...]  # where the op runs as described: ("cpu",), ("cuda",); both for pure data movement
    library: str  # the kernel library / build family that runs it
    # the ops builds (cpu_kind.kernel_build) it holds for, () any; a capture with no build recorded matches.
    # vLLM CPU's `_C_AVX512` / `_C_AVX2` builds store BF16 by truncation (a rounding in another mode than the
    # trainer's, at the same place; the patch's emulations round to nearest): the `_C`-only entries describe
    # nothing there and the op's sites are unproven
    builds: tuple[str, ...] = ()
    # engine facts (Capture.attention) that must hold for the claim, as (key, value); an absent fact fails
    requires: tuple[tuple[str, str], ...] = ()
    reference: Callable[..., Any] | None = None  # what the kernel computes, in torch (CUDA entries)


_TESTED = "tests/test_opaque_ops_engine.py, against the real op"
_CPU_C, _CUDA_C = "vLLM CPU _C ops", "vLLM CUDA _C ops"
_BOTH = ("cpu", "cuda")
_CUBLAS_EXACT = ((MATMUL_REDUCED_FACT, "false"),)
_CUBLAS = ("cuBLAS with torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction off (recorded in the "
           "capture): FP32 accumulation, rounded once; with it on (torch's default) cuBLAS may round split-K "
           "partial sums to BF16, so the GEMM is not proven bit-exact and the entry does not apply")
EXTERNS = (
    ExternRule("onednn_mm", "matmul", True, "one GEMM accumulated in FP32, the result rounded once",
               f"equals F.linear on the same BF16 inputs bit for bit at 1 to 513 rows ({_TESTED})",
               devices=("cpu",), library="oneDNN (vLLM CPU _C ops)"),
    ExternRule("weight_packed_linear", "matmul", True,
               "one GEMM accumulated in FP32 (AMX tiles), the bias added in FP32, the result rounded once",
               f"vLLM CPU's small-weight GEMM on AMX CPUs; equals F.linear on >= 99.9% of outputs at 1 to 2048 rows, "
               f"the rest summation order ({_TESTED})", devices=("cpu",), library=_CPU_C),
    ExternRule("extern_kernels.mm", "matmul", True, "ATen GEMM, result rounded once", "Inductor's extern: ATen mm",
               devices=("cpu",), library="ATen CPU (oneDNN / MKL)"),
    ExternRule("extern_kernels.addmm", "matmul", True, "ATen GEMM + bias, result rounded once", "ATen addmm",
               devices=("cpu",), library="ATen CPU (oneDNN / MKL)"),
    ExternRule("extern_kernels.bmm", "matmul", True, "ATen batched GEMM, result rounded once", "ATen bmm",
               devices=("cpu",), library="ATen CPU (oneDNN / MKL)"),
    ExternRule("extern_kernels.mm", "matmul", True, "cuBLAS GEMM, result rounded once", _CUBLAS,
               devices=("cuda",), library="cuBLAS", requires=_CUBLAS_EXACT, reference=cuda.cublas_gemm),
    ExternRule("extern_kernels.addmm", "matmul", True, "cuBLAS GEMM + bias in FP32, result rounded once", _CUBLAS,
               devices=("cuda",), library="cuBLAS", requires=_CUBLAS_EXACT, reference=cuda.cublas_gemm),
    ExternRule("extern_kernels.bmm", "matmul", True, "cuBLAS batched GEMM, result rounded once", _CUBLAS,
               devices=("cuda",), library="cuBLAS", requires=_CUBLAS_EXACT, reference=cuda.cublas_gemm),
    ExternRule("unified_attention", "attention", False, "per attention backend (RULES)", "RULES in this module",
               devices=_BOTH, library="vLLM attention custom op (the backend per RULES)"),
    ExternRule("unified_kv_cache_update", "kv-cache", True, "copies BF16 keys/values into the paged KV cache",
               "a copy in the cache dtype: no arithmetic", devices=_BOTH, library="vLLM attention custom op"),
    ExternRule("_C.rms_norm", "norm", True, "RMSNorm in FP32 (the weight multiply too), output rounded once",
               _TESTED, devices=("cpu",), library=_CPU_C, builds=("_C",)),
    ExternRule("_C.rms_norm", "norm", False,
               "variance in FP32, x * rstd stored in BF16, times the BF16 weight in BF16 (rounded again)",
               "vLLM csrc/layernorm_kernels.cu rms_norm_kernel: `((scalar_t)(x * s_variance)) * weight[idx]`",
               devices=("cuda",), library=_CUDA_C, reference=cuda.rms_norm),
    ExternRule("_C.fused_add_rms_norm", "norm", False,
               "writes residual = bf16(x + r); the norm applies the FP32 sum's variance to that BF16 sum, in FP32, "
               "output rounded once", _TESTED, devices=("cpu",), library=_CPU_C, builds=("_C",)),
    ExternRule("_C.fused_add_rms_norm", "norm", False,
               "writes residual = bf16(x + r) (BF16 add); the variance of that rounded sum; then as rms_norm: "
               "x * rstd stored in BF16, times the weight in BF16",
               "vLLM csrc/layernorm_kernels.cu fused_add_rms_norm_kernel (`_f16Vec` `+=` is `__hadd2`, "
               "`sum_squares` of the rounded sum, `*= s_variance` then `*= weight` each stored in BF16; "
               "csrc/type_convert.cuh)", devices=("cuda",), library=_CUDA_C, reference=cuda.fused_add_rms_norm),
    ExternRule("_C.silu_and_mul", "activation", True, "silu(gate) * up in FP32, rounded once", _TESTED,
               devices=("cpu",), library=_CPU_C, builds=("_C",)),
    ExternRule("_C.silu_and_mul", "activation", False, "silu(gate) stored in BF16, times up in BF16",
               "vLLM csrc/activation_kernels.cu: `(T)(x / (1.0f + expf(-x)))`, then `ACT_FN(x) * y` in scalar_t",
               devices=("cuda",), library=_CUDA_C, reference=cuda.silu_and_mul),
    ExternRule("_C.gelu_and_mul", "activation", True, "gelu(gate) * up in FP32 (erf form), rounded once", _TESTED,
               devices=("cpu",), library=_CPU_C, builds=("_C",)),
    ExternRule("_C.gelu_and_mul", "activation", False, "erf-gelu(gate) stored in BF16, times up in BF16",
               "vLLM csrc/activation_kernels.cu gelu_kernel: `(T)(f * 0.5f * (1.0f + ::erf(f * ALPHA)))` * y",
               devices=("cuda",), library=_CUDA_C, reference=cuda.gelu_and_mul),
    ExternRule("_C.gelu_tanh_and_mul", "activation", True,
               "tanh-gelu(gate) * up in FP32 (the kernel's vectorized tanh), rounded once", _TESTED,
               devices=("cpu",), library=_CPU_C, builds=("_C",)),
    ExternRule("_C.gelu_tanh_and_mul", "activation", False, "tanh-gelu(gate) stored in BF16, times up in BF16",
               "vLLM csrc/activation_kernels.cu gelu_tanh_kernel: `(T)(0.5f * f * (1.0f + ::tanhf(inner)))` * y",
               devices=("cuda",), library=_CUDA_C, reference=cuda.gelu_tanh_and_mul),
    ExternRule("_C.rotary_embedding", "rope", True,
               "q/k rotated in FP32 with a BF16 cos/sin cache, each rounded once, in place", _TESTED,
               devices=("cpu",), library=_CPU_C, builds=("_C",)),
    ExternRule("_C.rotary_embedding", "rope", False,
               "q/k rotated with the cos/sin cache in the activation dtype (RotaryEmbedding.forward_cuda casts it): "
               "`x * cos - y * sin` in scalar_t, each product and the sum rounded to BF16; vLLM versions whose "
               "kernel reads `cos_f`, `x_f` compute it in FP32 and round once (reference: fp32_math=True)",
               "vLLM csrc/pos_encoding_kernels.cu apply_rotary_embedding (`scalar_t cos, sin`; the later "
               "`apply_token_rotary_embedding` with `static_cast<scalar_t>(x_f * cos_f - y_f * sin_f)`)",
               devices=("cuda",), library=_CUDA_C, reference=cuda.rotary_embedding),
    ExternRule("aten.topk", "selection", False, "selects the k largest values and their indices: no arithmetic",
               "a selection (ATen topk)", devices=_BOTH, library="ATen"),
    ExternRule("_C.cpu_fused_moe", "moe", False,
               "gate/up GEMM and SiLU in FP32, silu(gate) * up rounded to BF16 once (the down GEMM's input), the "
               "down GEMM and the weighted sum over the top-k experts in FP32 with FP32 routing weights, output "
               "rounded once",
               f"equals moe_engine.moe_experts_like_engine on the same inputs on 100% of outputs ({_TESTED})",
               devices=("cpu",), library=_CPU_C, builds=("_C",)),
    ExternRule("_C.shm_allreduce", "allreduce", True, "sums the ranks' BF16 partials in FP32, rounds once (truncates "
               "on the _C_AVX512 build; _C_AVX2 has no shm ops: torch.distributed's all-reduce below)",
               "vLLM CPU's tensor-parallel all-reduce: output = bf16(FP32 sum of the ranks' BF16 inputs), checked on "
               "every call a TP scan records (scan.json replay) and in tests/test_tp_engine.py",
               devices=("cpu",), library=_CPU_C),
    # vLLM CPU's fallback where its ops build has no shared-memory all-reduce (`_C_AVX2`): torch.distributed (gloo),
    # which Dynamo traces to this functional collective and Inductor calls in place; torch's own BF16 sum, so the
    # ops build's truncation does not apply to it (tensor_parallel.allreduce_truncates)
    ExternRule("_c10d_functional.all_reduce", "allreduce", True,
               "sums the ranks' BF16 inputs, each addition rounded to BF16 (nearest even) in gloo's ring order: for 2 "
               "ranks bf16(FP32 sum), rounded once",
               "torch.distributed's gloo all-reduce, measured with 2 to 4 ranks: 2 ranks equal the FP32 sum rounded "
               "once to nearest even on 100%, more ranks a per-element order of BF16 additions; checked on every "
               "call a TP scan records (scan.json replay) and in tests/test_tp_engine.py",
               devices=("cpu",), library="torch.distributed (gloo)"),
    ExternRule("_c10d_functional.all_reduce", "allreduce", False,
               "NCCL's BF16 sum: each ring step adds one rank's partial in BF16, rounding every addition; for 2 "
               "ranks bf16(a + b)", "NCCL FuncSum on __nv_bfloat16 (src/device/reduce_kernel.h)",
               devices=("cuda",), library="NCCL", reference=cuda.nccl_allreduce),
    ExternRule("vllm.all_reduce", "allreduce", False,
               "vLLM's custom all-reduce sums the ranks' BF16 partials in FP32 in rank order and rounds once; where "
               "it falls back to NCCL (PyNccl) each ring step rounds to BF16; the graph does not say which ran: for "
               "2 ranks both are bf16(a + b)",
               "vLLM csrc/custom_all_reduce.cuh `packed_reduce` (upcast to float, `packed_assign_add`, downcast); "
               "vllm/distributed/device_communicators/cuda_communicator.py picks custom all-reduce, else PyNccl",
               devices=("cuda",), library="vLLM custom all-reduce / NCCL", reference=cuda.custom_allreduce),
)


def engine_device(engine: Mapping[str, str]) -> str:
    """The device the engine's kernels ran on, as its capture records it (Capture.attention["device"]); a capture
    with no device recorded is a CPU one (captures before the device was recorded ran vLLM CPU)."""
    return (engine.get("device") or "cpu").split(":")[0]


def extern_rule(name: str, build: str = "", device: str = "cpu",
                facts: Mapping[str, str] | None = None) -> ExternRule | None:
    """The registry entry of an extern by (its name, the engine's device, its ops `build` (cpu_kind.kernel_build));
    none where the entry for that device does not hold for that build or for the engine `facts` it requires. Only an
    entry of `device` decides: a CUDA op with no CUDA entry is unregistered."""
    rule = next((r for r in EXTERNS if r.op in name and device in r.devices), None)
    if rule is None or (build and rule.builds and build not in rule.builds):
        return None
    return rule if all((facts or {}).get(k) == v for k, v in rule.requires) else None


def engine_rule(name: str, engine: Mapping[str, str]) -> ExternRule | None:
    """`extern_rule` keyed by what the engine capture records (Capture.attention: device, build, flags)."""
    return extern_rule(name, engine.get("build", ""), engine_device(engine), engine)


def unregistered_why(name: str, engine: Mapping[str, str]) -> str:
    """Why no entry describes extern `name` on this engine, in one phrase ("" where one does)."""
    if engine_rule(name, engine) is not None:
        return ""
    device = engine_device(engine)
    same = [r for r in EXTERNS if r.op in name and device in r.devices]
    if not same:
        other = sorted({d for r in EXTERNS if r.op in name for d in r.devices})
        return f"no {device} entry" + (f" (described for {', '.join(other)} only)" if other else "")
    rule = same[0]
    if engine.get("build") and rule.builds and engine["build"] not in rule.builds:
        return f"its {rule.library} entry holds for build {', '.join(rule.builds)}, not {engine['build']}"
    return "its {} entry holds only where {} (the capture records {})".format(
        rule.library, ", ".join(f"{k}={v}" for k, v in rule.requires),
        ", ".join(f"{k}={engine.get(k, 'nothing')}" for k, _ in rule.requires))


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
    """The rule of the engine's attention kernel by (backend, kernel variant, device)."""
    for rule in RULES:
        if rule.backend == info.get("backend") and rule.isa in (None, info.get("isa")) \
                and rule.device == engine_device(info):
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

