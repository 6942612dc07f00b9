"""Every library or process global graphdiff changes is back as it was afterwards (no engine needed).

Each test records the global before, checks that graphdiff did change it while its call ran (so the test can
fail), and that it is the same object or value afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from graphdiff.models.tiny import make_tiny

    return make_tiny("qwen3", tmp_path_factory.mktemp("qwen3"), layers=1)


def test_make_tiny_leaves_the_global_generator_alone(tiny_qwen3: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from graphdiff.models.tiny import make_tiny

    from_config, during = transformers.AutoModelForCausalLM.from_config, []

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        during.append(torch.random.get_rng_state())
        return from_config(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", recording)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    make_tiny("qwen3", tmp_path, layers=1, seed=0)
    assert during and not torch.equal(during[0], before)  # HF's init ran on the seeded generator
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's stream goes on where it was
    assert (tmp_path / "model.safetensors").read_bytes() == (tiny_qwen3 / "model.safetensors").read_bytes()


def test_load_hf_model_gives_back_transformers_progress_bars(tiny_qwen3: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers
    from transformers.utils import logging as hf_logging

    from graphdiff.capture.hf import load_hf_model

    from_pretrained, during = transformers.AutoModelForCausalLM.from_pretrained, []

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        during.append(hf_logging.is_progress_bar_enabled())
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    hf_logging.enable_progress_bar()
    load_hf_model(tiny_qwen3)
    assert during == [False]
    assert hf_logging.is_progress_bar_enabled()


def test_inductor_hooks_put_inductor_back() -> None:
    import torch._inductor.compile_fx as compile_fx_mod
    import torch._inductor.config as inductor_config
    import torch._inductor.debug as inductor_debug
    from torch._inductor.graph import GraphLowering

    from graphdiff.capture.inductor_hooks import inductor_hooks

    inductor_config.trace.provenance_tracking_level = 0
    before = (compile_fx_mod.compile_fx, GraphLowering.compile_to_module,
              inductor_debug.set_kernel_post_grad_provenance_tracing, inductor_config.trace.provenance_tracking_level)
    with inductor_hooks():
        during = (compile_fx_mod.compile_fx, GraphLowering.compile_to_module,
                  inductor_debug.set_kernel_post_grad_provenance_tracing,
                  inductor_config.trace.provenance_tracking_level)
        assert all(d is not b for d, b in zip(during, before))
    after = (compile_fx_mod.compile_fx, GraphLowering.compile_to_module,
             inductor_debug.set_kernel_post_grad_provenance_tracing, inductor_config.trace.provenance_tracking_level)
    assert after == before


def test_buffer_recorder_removes_its_kernel_wrappers() -> None:
    from graphdiff.capture.inductor_code import KernelCall, KernelDef
    from graphdiff.capture.inductor_hooks import BufferRecorder

    def kernel(in_ptr0, out_ptr0):  # noqa: ANN001, ANN202
        out_ptr0.copy_(in_ptr0)

    mod = types.ModuleType("compiled")
    mod.cpp_fused_0 = kernel
    kdef = KernelDef("cpp_fused_0", "cpp", [("in_ptr0", "bfloat16"), ("out_ptr0", "bfloat16")], "")
    rec = BufferRecorder(mod, [KernelCall(id="cpp_fused_0:1", name="cpp_fused_0", extern=False,
                                          args=["buf0", "buf1"])], {"cpp_fused_0": kdef}, weights=set())
    assert mod.cpp_fused_0 is not kernel
    rec.remove()
    assert mod.cpp_fused_0 is kernel


def test_engine_process_state_puts_environment_config_and_threads_back(tmp_path: Path) -> None:
    import torch._inductor.config as inductor_config

    from graphdiff.engines.vllm.start import engine_env, engine_process_state

    env = engine_env(tmp_path)
    before = ({k: os.environ.get(k) for k in env}, inductor_config.force_disable_caches, torch.get_num_threads())
    assert before[1] is False
    with engine_process_state(env):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == env["TORCHINDUCTOR_CACHE_DIR"]
        assert inductor_config.force_disable_caches is True
        torch.set_num_threads(1 if before[2] != 1 else 2)  # as vLLM's CPU worker binds its threads
    assert ({k: os.environ.get(k) for k in env}, inductor_config.force_disable_caches,
            torch.get_num_threads()) == before


def test_forced_kind_applied_puts_torch_cpu_and_environment_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphdiff.capture import cpu_kind

    kinds = cpu_kind.posable_kinds()
    if not kinds:
        pytest.skip("this CPU has no lesser kind to pose as")
    kind = kinds[-1]
    monkeypatch.setenv(cpu_kind.FORCE_ENV, kind)
    names = ("_is_amx_tile_supported", "_init_amx", "_is_avx512_bf16_supported", "_is_avx512_supported")
    before = ({n: getattr(torch.cpu, n) for n in names},
              {k: os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "PYTHONPATH")})
    with cpu_kind.forced_kind_applied() as applied:
        assert applied == kind and cpu_kind.cpu_kind() == kind
        assert any(getattr(torch.cpu, n) is not f for n, f in before[0].items())
        assert "forced_kind" in os.environ["PYTHONPATH"]  # already there where this session runs forced
    assert {n: getattr(torch.cpu, n) for n in names} == before[0]
    assert {k: os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "PYTHONPATH")} == before[1]


def _defined(names: object) -> list[bool]:
    return [hasattr(torch.ops._C, n) for n in names]


def test_cuda_only_placeholders_are_undefined_by_the_last_block() -> None:
    pytest.importorskip("vllm")
    from graphdiff.engines.vllm.cpu import CUDA_ONLY_C_OPS, cuda_only_placeholders

    with cuda_only_placeholders() as missing:
        if not missing:
            pytest.skip("this vLLM build defines the CUDA-only ops itself")
        assert all(_defined(missing))
        with cuda_only_placeholders() as again:
            assert again == []
        assert all(_defined(missing))  # the inner block defined nothing, so it undefines nothing
    assert not any(_defined(missing))
    assert set(missing) <= set(CUDA_ONLY_C_OPS)


def test_as_asked_puts_the_cpu_platform_and_the_ops_back() -> None:
    pytest.importorskip("vllm")
    from graphdiff.engines.vllm.cpu import CUDA_ONLY_C_OPS, as_asked, on_cpu_platform

    if not on_cpu_platform():
        pytest.skip("VLLM_COMPILE is kept only on the CPU platform")
    from vllm.platforms.cpu import CpuPlatform

    before = (CpuPlatform.__dict__["check_and_update_config"], _defined(CUDA_ONLY_C_OPS))
    if all(before[1]):
        pytest.skip("this vLLM build defines the CUDA-only ops itself")
    with as_asked({"mode": 3}, []):
        assert CpuPlatform.__dict__["check_and_update_config"] is not before[0]
        assert all(_defined(CUDA_ONLY_C_OPS))
    assert (CpuPlatform.__dict__["check_and_update_config"], _defined(CUDA_ONLY_C_OPS)) == before


def test_importing_the_tp_worker_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even where vLLM imports it in a capture's worker (GRAPHDIFF_TP_WORKER=1), the import changes nothing."""
    import torch._inductor.compile_fx as compile_fx_mod

    from graphdiff.engines.vllm import tp_worker
    from graphdiff.engines.vllm.tp import VLLM_COMPILE_ENV, WORKER_ENV

    monkeypatch.setenv(WORKER_ENV, "1")
    monkeypatch.setenv(VLLM_COMPILE_ENV, "1")
    before = compile_fx_mod.compile_fx
    spec = importlib.util.spec_from_file_location("tp_worker_fresh_import", tp_worker.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)  # the module's import-time code, run again as vLLM's import runs it
    assert compile_fx_mod.compile_fx is before and fresh.HOOKS is None and not fresh._ACTIVE


def test_tp_worker_hooks_live_from_the_worker_build_to_stop_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM mixes the extension into its worker class and builds the worker: that installs the hooks (and the
    placeholder ops for VLLM_COMPILE); stop_capture, which the capture's save calls, undoes both."""
    import torch._inductor.compile_fx as compile_fx_mod

    from graphdiff.engines.vllm import tp_worker
    from graphdiff.engines.vllm.tp import VLLM_COMPILE_ENV, WORKER_ENV

    pytest.importorskip("vllm")
    from graphdiff.engines.vllm.cpu import CUDA_ONLY_C_OPS

    class WorkerBase:  # like vLLM's: its __init__ does not call super().__init__
        def __init__(self, **kwargs: object) -> None:
            self.kwargs = kwargs

    class Worker(WorkerBase):
        pass

    monkeypatch.setenv(WORKER_ENV, "1")
    monkeypatch.setenv(VLLM_COMPILE_ENV, "1")
    before = (compile_fx_mod.compile_fx, _defined(CUDA_ONLY_C_OPS))
    Worker.__bases__ = (*Worker.__bases__, tp_worker.GraphdiffWorkerExtension)  # as vLLM's init_worker does
    try:
        worker = Worker(rank=0)
        assert worker.kwargs == {"rank": 0}
        assert compile_fx_mod.compile_fx is not before[0] and tp_worker.HOOKS is not None
        assert all(_defined(CUDA_ONLY_C_OPS))
    finally:
        tp_worker.stop_capture()
    assert (compile_fx_mod.compile_fx, _defined(CUDA_ONLY_C_OPS)) == before


def test_extern_recorder_puts_the_op_packets_back() -> None:
    from graphdiff.engines.vllm.tp_worker import ExternRecorder

    before = torch.ops.aten.relu
    rec = ExternRecorder(("aten.relu",))
    assert torch.ops.aten.relu is not before
    rec.remove()
    assert torch.ops.aten.relu is before


def test_attention_registration_is_undone_by_its_last_user(tiny_qwen3: Path) -> None:
    from transformers import AttentionInterface

    from graphdiff.capture.hf import load_hf_model
    from graphdiff.runtime.attention import use_attention

    a, b = load_hf_model(tiny_qwen3), load_hf_model(tiny_qwen3)
    registry, impl = dict(AttentionInterface._global_mapping), a.config._attn_implementation

    def fn(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return AttentionInterface._global_mapping["sdpa"](*args, **kwargs)

    undo_a, undo_b = use_attention(a, "graphdiff_test", fn), use_attention(b, "graphdiff_test", fn)
    assert AttentionInterface._global_mapping["graphdiff_test"] is fn
    assert a.config._attn_implementation == b.config._attn_implementation == "graphdiff_test"
    undo_a()
    undo_a()  # idempotent: b's use still counts
    assert a.config._attn_implementation == impl and "graphdiff_test" in AttentionInterface._global_mapping
    undo_b()
    assert dict(AttentionInterface._global_mapping) == registry and b.config._attn_implementation == impl


def test_attention_registration_puts_back_what_the_name_held() -> None:
    from transformers import AttentionInterface

    from graphdiff.runtime.attention import register_attention

    sdpa = AttentionInterface._global_mapping["sdpa"]
    undo = register_attention("sdpa", lambda *a, **k: None)
    assert AttentionInterface._global_mapping["sdpa"] is not sdpa
    undo()
    assert AttentionInterface._global_mapping["sdpa"] is sdpa
