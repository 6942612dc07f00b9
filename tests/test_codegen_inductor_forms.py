"""The generated Triton kernels compute each op with the function Inductor's Triton codegen uses: their math
calls equal those of Inductor's own kernels for the same fragments, in the recorded H200 dump (torch 2.11) and
from the installed torch's Inductor, and they follow Inductor's configuration (read from it, not from a list)."""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest
import torch

from graphdiff.capture.inductor_code import parse_kernel_defs
from graphdiff.codegen import generate, inductor_lowering
from graphdiff.codegen.emit_triton import split
from graphdiff.codegen.inductor_lowering import math_calls
from graphdiff.codegen.verify import fragments

ROOT = Path(__file__).resolve().parent.parent
QWEN3 = ROOT / "fixtures" / "scans" / "tiny-qwen3"
DUMP = ROOT / "fixtures/dumps/inductor-triton-h200-tiny-qwen3-hf/torchinductor/model__0_inference_0.0/output_code.py"
ROPE_MATH = {"tl_math.sin", "tl_math.cos"}  # HF's rotary embedding, computed inside Inductor's q/k norm kernel


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Forward kernel source of each splice of the tiny-Qwen3 patch, by splice key."""
    out = tmp_path_factory.mktemp("patch")
    manifest = generate(QWEN3, out)
    src = (out / manifest.module_file).read_text()
    found = {}
    for s in manifest.splices:
        if s.triton_fn:
            slug = s.triton_fn.removeprefix("triton_")
            found[s.key] = "\n".join(re.findall(rf"def _k_{slug}_\d+_fwd\(.*?(?=\n    @triton.jit|\n    def )", src,
                                                re.S))
    return found


def dump_kernels() -> dict[str, list[str]]:
    """Math calls of each Triton kernel Inductor generated on the H200 for the same model."""
    return {name: math_calls(k.code) for name, k in parse_kernel_defs(DUMP.read_text()).items()}


def dedupe(calls: list[str]) -> list[str]:
    return list(dict.fromkeys(calls))


def test_rmsnorm_kernels_call_what_inductor_calls(kernels) -> None:
    dump = dump_kernels()
    norms = {n: c for n, c in dump.items() if "mean_mul_pow_rsqrt" in n and "cos" not in n}
    assert len(norms) >= 5
    assert all(c == ["tl.sum", "/", "libdevice.rsqrt"] for c in norms.values()), norms
    for key in ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm"):
        assert math_calls(kernels[key]) == ["tl.sum", "/", "libdevice.rsqrt"], key


def test_qk_norm_and_rope_kernels_call_what_inductor_calls(kernels) -> None:
    """Inductor fuses q/k norm and RoPE into one kernel (recomputing the norm for each rotate_half half); the
    patch splices them as two (the norm module, apply_rotary_pos_emb): the same calls, in the same order."""
    dump = dump_kernels()
    fused = [c for n, c in dump.items() if n.startswith("triton_per_") and "cos" in n and "rsqrt" in n]
    assert fused
    for calls in fused:
        assert dedupe([c for c in calls if c not in ROPE_MATH]) == ["tl.sum", "/", "libdevice.rsqrt"]
    rope = math_calls(kernels["transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb"])
    assert rope == []  # multiplications and adds only
    for key in ("model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"):
        assert math_calls(kernels[key]) == ["tl.sum", "/", "libdevice.rsqrt"], key


def test_silu_kernel_calls_what_inductor_calls(kernels) -> None:
    (silu,) = [c for n, c in dump_kernels().items() if n.endswith("mul_silu_10")]
    assert silu == ["libdevice.exp", "/"]  # x / (exp(-x) + 1), Triton's own division
    assert math_calls(kernels["model.layers.*.mlp.act_fn"]) == silu


def test_pow_is_expanded_and_mean_divides_by_the_row_size(kernels) -> None:
    """pow(x, 2) is Inductor's x * x (no libdevice.pow), mean is the FP32 sum divided by the row size, and the
    reduction is persistent (no loop) for these rows, as in the dump."""
    src = DUMP.read_text()
    assert "libdevice.pow" not in src and re.search(r"(tmp\d+) = (tmp\d+) \* \2\n.*\n.*\n.*tl\.sum", src)
    assert "tl.full([1, 1], 256.0, tl.float32)" in src and "tl.full([1, 1], 64.0, tl.float32)" in src
    for key in ("model.norm", "model.layers.*.self_attn.q_norm"):
        k = kernels[key]
        assert "libdevice.pow" not in k and re.search(r"(\w+) = (\w+) \* \2  # aten.pow", k), k
        assert re.search(r"tl\.full\(\[\], (256|64)\.0, tl\.float32\)", k)
        assert "tl.float64" not in k and "for " not in k  # FP32, one block: Inductor's persistent reduction
    assert inductor_lowering.persistent_limit() >= 256


def test_forms_are_read_from_the_installed_inductor() -> None:
    """Inductor is asked (no fallback), and its configuration changes the forms: exp under use_fast_math, the
    division under eager_numerics.division_rounding."""
    import torch._inductor.config as config

    # asked: Inductor imports (an op it cannot lower, as tanh in an earlier test's patch, adds its own fallback note)
    assert inductor_lowering.source().startswith(f"Inductor of torch {torch.__version__}")
    frags, nodes = fragments(QWEN3)
    frag = frags["model.layers.*.mlp.act_fn"]
    _, core = split(frag)
    (silu,) = [n for n in core if n.target == "aten.silu.default"]
    var = {n: f"v_{n}" for n in nodes}

    def exprs() -> list[str]:
        return [s.expr for s in inductor_lowering.lower(silu, nodes, var, "y")]

    assert exprs()[1] == "libdevice.exp(y_0)"
    with config.patch(use_fast_math=True):
        assert exprs()[1] == "tl_math.exp(y_0)"
    with config.patch({"eager_numerics.division_rounding": True}):
        assert exprs()[-1].startswith("triton.language.div_rn(")
    assert exprs()[-1] == f"({var[silu.inputs[0]]} / y_3)"


def test_fallback_forms_equal_inductor_on_this_torch() -> None:
    """The fallback (used only where Inductor cannot be asked) is what Inductor gives here, step for step."""
    frags, nodes = fragments(QWEN3)
    var = {n: f"v_{n}" for n in nodes}
    seen = 0
    for frag in frags.values():
        if frag.target == "carry" or frag.problems:
            continue
        _, core = split(frag)
        for n in core:
            if n.target.split(".")[1] in inductor_lowering.IDENTITY or "attention" in n.target:
                continue
            ours = [(s.op, s.expr, s.value) for s in inductor_lowering.lower(n, nodes, var, "y")]
            assert ours == [(s.op, s.expr, s.value) for s in inductor_lowering._fallback(n, nodes, var, "y")], n
            seen += 1
    assert seen > 20


def test_installed_inductor_emits_the_same_math_calls(kernels) -> None:
    """Inductor of the installed torch (2.13, the dump's was 2.11) writing Triton for CPU tensors: RMSNorm and
    SiLU get the calls the generated kernels make. Only the source is kept: this machine's Triton cannot compile
    for the CPU, and the backend hash (which needs a Triton driver) is replaced by a constant."""
    pytest.importorskip("triton")
    import torch._inductor.codegen.triton as triton_codegen
    import torch._inductor.config as config

    sources: list[str] = []
    original = triton_codegen.TritonKernel.codegen_kernel

    def record(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        sources.append(original(self, *args, **kwargs))
        return sources[-1]

    def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    def silu(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x)

    x = torch.randn(16, 256, dtype=torch.bfloat16)
    with config.patch(cpu_backend="triton", compile_threads=1), \
            mock.patch("torch.utils._triton.triton_hash_with_backend", lambda: "0" * 64), \
            mock.patch.object(triton_codegen.TritonKernel, "codegen_kernel", record):
        for fn, args in ((rmsnorm, (x, x[0])), (silu, (x,))):
            torch._dynamo.reset()
            with pytest.raises(Exception):  # noqa: B017, PT011 - compiling for the CPU fails after codegen
                torch.compile(fn)(*args)
    torch._dynamo.reset()
    assert len(sources) == 2, len(sources)
    assert math_calls(sources[0]) == math_calls(kernels["model.norm"]) == ["tl.sum", "/", "libdevice.rsqrt"]
    assert "triton_heuristics.persistent_reduction" in sources[0]
    assert math_calls(sources[1]) == math_calls(kernels["model.layers.*.mlp.act_fn"]) == ["libdevice.exp", "/"]


def test_a_condition_is_lowered_as_a_bool_mask() -> None:
    """`where`'s condition (xIELU's `x > 0`) reaches Inductor as a bool tensor: Inductor lowers it, no fallback."""
    from graphdiff.records import Node

    def value(name: str, dtype: str) -> Node:
        return Node(name=name, op="placeholder", target="", dtype=dtype, shape=[4, 8])

    where = Node(name="w", op="call_function", target="aten.where.self", inputs=["cond", "a", "b"], dtype="float32",
                 shape=[4, 8], call=[[{"node": "cond"}, {"node": "a"}, {"node": "b"}], {}])
    nodes = {n.name: n for n in (value("cond", "bool"), value("a", "float32"), value("b", "float32"), where)}
    before = list(inductor_lowering._reason)
    steps = inductor_lowering.lower(where, nodes, {k: f"v_{k}" for k in nodes}, "y")
    assert inductor_lowering._reason == before
    assert any("where" in s.expr and "v_cond" in s.expr for s in steps), [s.expr for s in steps]
