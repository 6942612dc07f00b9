"""The wrapper reader on Triton-backend code. No GPU was available to record a real Triton dump, so
this text is written by hand in the format Inductor's Triton wrapper uses (launcher objects called
with `.run(...)`, `triton_meta` signatures, provenance handles); the C++ backend is covered by the
recorded dump in fixtures/dumps."""

from graphdiff.capture.inductor_code import kernel_args, parse_kernel_calls, parse_kernel_defs

SRC = """
triton_poi_fused_mul_silu_0 = async_compile.triton('triton_poi_fused_mul_silu_0', '''
import triton
import triton.language as tl

@triton_heuristics.pointwise(
    size_hints={'x': 65536},
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'out_ptr0': '*bf16', 'xnumel': 'i32', 'XBLOCK': 'constexpr'},
                 'device': DeviceProperties(type='cuda', index=0), 'constants': {}},
    inductor_meta={'kernel_name': 'triton_poi_fused_mul_silu_0'},
)
@triton.jit
def triton_poi_fused_mul_silu_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
''', device_str='cuda')


class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        buf0 = empty_strided_cuda((16, 4096), (4096, 1), torch.bfloat16)
        # [Provenance debug handles] extern_kernels.mm:1
        extern_kernels.mm(arg0_1, arg1_1, out=buf0)
        buf1 = empty_strided_cuda((16, 2048), (2048, 1), torch.bfloat16)
        # [Provenance debug handles] triton_poi_fused_mul_silu_0:2
        stream0 = get_raw_stream(0)
        triton_poi_fused_mul_silu_0.run(buf0, buf1, 32768, stream=stream0)
        return (buf1, )
"""


def test_triton_kernel_params_roles_and_dtypes():
    (k,) = parse_kernel_defs(SRC).values()
    assert k.backend == "triton"
    assert k.params == [("in_ptr0", "bfloat16"), ("out_ptr0", "bfloat16"), ("xnumel", None), ("XBLOCK", None)]


def test_triton_calls_and_externs_in_order():
    defs = parse_kernel_defs(SRC)
    calls = parse_kernel_calls(SRC, defs)
    assert [(c.id, c.extern) for c in calls] == [("extern_kernels.mm:1", True),
                                                 ("triton_poi_fused_mul_silu_0:2", False)]
    assert calls[0].kwargs == {"out": "buf0"}
    args = kernel_args(calls[1], defs[calls[1].name])
    assert [(a.name, a.role, a.dtype) for a in args] == [("buf0", "in", "bfloat16"), ("buf1", "out", "bfloat16"),
                                                          ("?", "scalar", None)]
