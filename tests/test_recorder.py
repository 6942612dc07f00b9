"""The buffer recorder wraps both kernel kinds Inductor emits (no engine needed)."""

from __future__ import annotations

import types

import torch

from graphdiff.capture.inductor_code import KernelCall, KernelDef
from graphdiff.capture.inductor_hooks import BufferRecorder


class FakeTritonLauncher:
    """Like Inductor's CachingAutotuner: the wrapper calls `kernel.run(*args, stream=...)`."""

    fn_name = "triton_poi_fused_mul_0"

    def run(self, in_ptr0, out_ptr0, xnumel, stream=None):  # noqa: ANN001
        out_ptr0.copy_(in_ptr0 * 2)


def cpp_kernel(in_ptr0, out_ptr0, ks0):  # noqa: ANN001
    out_ptr0.copy_(in_ptr0 + 1)


def _recorder(name: str, kernel: object) -> tuple[types.ModuleType, BufferRecorder]:
    mod = types.ModuleType("compiled")
    setattr(mod, name, kernel)
    kdef = KernelDef(name, "triton", [("in_ptr0", "bfloat16"), ("out_ptr0", "bfloat16"), ("xnumel", None)], "")
    call = KernelCall(id=f"{name}:1", name=name, extern=False, args=["buf0", "buf1", None])
    return mod, BufferRecorder(mod, [call], {name: kdef}, weights=set())


def test_triton_launchers_keep_their_interface_and_record():
    mod, rec = _recorder("triton_poi_fused_mul_0", FakeTritonLauncher())
    assert mod.triton_poi_fused_mul_0.fn_name == "triton_poi_fused_mul_0"  # other attributes still there
    x, y = torch.ones(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    rec.armed = True
    mod.triton_poi_fused_mul_0.run(x, y, 4, stream=0)
    r = rec.records["triton_poi_fused_mul_0:1"]
    assert torch.equal(r["in"]["buf0"], x) and torch.equal(r["out"]["buf1"], 2 * x)
    assert rec.complete()


def test_cpp_kernels_record_copies_not_views():
    mod, rec = _recorder("cpp_fused_add_0", cpp_kernel)
    x, y = torch.ones(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    rec.armed = True
    mod.cpp_fused_add_0(x, y, 4)
    x.fill_(7)  # the engine reuses its buffers: the record must not change
    assert torch.equal(rec.records["cpp_fused_add_0:1"]["in"]["buf0"], torch.ones(4, dtype=torch.bfloat16))
    assert torch.equal(rec.records["cpp_fused_add_0:1"]["out"]["buf1"], 2 * torch.ones(4, dtype=torch.bfloat16))
