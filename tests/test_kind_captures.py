"""Every CPU kind's engine, without the engine: the tiny Qwen3 capture recorded as each kind
(fixtures/captures/tiny-qwen3-KIND, scripts/record_kind_captures.sh) analysed as `scan --engine-dump` does.

A machine can pose only as kinds below its own (`GRAPHDIFF_CPU_KIND`); these recordings keep the analysis honest for
the kinds above it: vLLM CPU's kernels (attention ISA, packed GEMMs, the ops build that stores BF16), Inductor's
vector width, and the fusions they lead to all differ by kind, and the scan must prove every kernel of each."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphdiff.analysis.opaque import attention_rule, truncates_output
from graphdiff.capture.cpu_kind import KERNEL_BUILD, KINDS
from tests.conftest import FIXTURES


def _recorded(kind: str) -> Path:
    return FIXTURES / "captures" / f"tiny-qwen3-{kind}"


@pytest.fixture(scope="module", params=KINDS)
def kind_scan(request: pytest.FixtureRequest, tiny_models: dict[str, Path]):  # noqa: ANN201 - (kind, outcome)
    from graphdiff.pipeline import scan

    kind = request.param
    return kind, scan(str(tiny_models["qwen3"]), engine_dump=_recorded(kind))


def test_the_capture_says_which_kind_recorded_it(kind_scan) -> None:
    kind, outcome = kind_scan
    info = outcome.engine.attention
    assert info["cpu"] == kind and info["build"] == KERNEL_BUILD[kind], info
    assert (info["isa"] == "amx") == (kind == "amx"), info  # AMX tiles decide vLLM CPU's attention kernel
    handles = [name for g in outcome.engine.graphs for name in g.inputs.values() if "#" in name]
    assert bool(handles) == (kind != "avx2")  # oneDNN has no BF16 GEMM below AVX-512: linears run as F.linear


def test_every_kernel_of_every_kind_replays_bit_exactly(kind_scan) -> None:
    kind, outcome = kind_scan
    result = outcome.result
    generated = [r for r in result.replay if not r.kernel.startswith("torch.ops")]
    assert generated and all(r.predicted_bitexact >= 0.999 for r in generated), \
        [(r.kernel, r.predicted_bitexact) for r in generated if r.predicted_bitexact < 0.999]
    assert not result.not_replayed and not result.unexplained and not result.unregistered_externs, kind


def test_every_kind_has_the_papers_regions_and_its_attention_decision(kind_scan) -> None:
    """The engine keeps rope, the q/k norms, SiLU*up and the residual sum in FP32 on every kind; attention is a site
    where the kind's attention kernel keeps the probabilities FP32 (vec), none where it rounds them itself (amx), and
    the decision says where the kind's ops build truncates the output."""
    kind, outcome = kind_scan
    result = outcome.result
    regions = {r.kind: r for r in result.regions}
    assert {"rope", "qk_norm", "gated_act", "residual_norm", "norm_weight"} <= set(regions), kind
    for name in ("rope", "qk_norm", "gated_act", "residual_norm"):
        assert regions[name].layers == [0, 1] and regions[name].rounded_on == ["train"], (kind, regions[name])
    rule = attention_rule(outcome.engine.attention)
    assert rule is not None
    assert ("attention" in regions) == rule.probabilities_fp32, kind
    assert truncates_output(outcome.engine.attention) == (kind in ("avx512", "avx2"))
