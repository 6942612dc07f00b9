"""GRAPHDIFF_CPU_KIND: running as a lesser kind of CPU (vLLM CPU's other kernel path), in this process and in the
processes it starts; the BF16 store of a truncating ops build."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from graphdiff.capture.cpu_kind import FORCE_ENV, KINDS, forced_kind, native_kind, posable_kinds, store_like
from graphdiff.errors import GraphdiffError

PROBE = ("import os, torch; from graphdiff.capture.cpu_kind import apply_forced_kind; apply_forced_kind(); "
         "import subprocess, sys; print(torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported(), "
         "os.environ.get('ONEDNN_MAX_CPU_ISA')); sys.stdout.flush(); "
         "subprocess.run([sys.executable, '-c', 'import torch; print(torch.cpu._is_avx512_bf16_supported())'])")


def _env(kind: str) -> dict[str, str]:
    """This environment without any kind forced (this session may run forced), then `kind` asked for."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", FORCE_ENV, "PYTHONPATH")}
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and "forced_kind" not in p]
    return {**env, FORCE_ENV: kind, **({"PYTHONPATH": os.pathsep.join(path)} if path else {})}


def test_a_lesser_kind_reaches_this_process_and_the_ones_it_starts() -> None:
    if KINDS.index(native_kind()) < KINDS.index("avx512_bf16"):
        pytest.skip(f"this CPU ({native_kind()}) has no AVX-512 BF16 to hide")
    out = subprocess.run([sys.executable, "-c", PROBE], env=_env("avx512"), capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False", "False", "AVX512_CORE", "False"]  # the last line: a new process (vLLM's workers)


def test_the_cpus_own_kind_changes_nothing() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], env=_env(""), capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    bf16 = str(KINDS.index(native_kind()) >= KINDS.index("avx512_bf16"))  # the CPU's own, even in a forced session
    assert out == [bf16, str(native_kind() == "amx"), "None", bf16]


def test_unknown_and_higher_kinds_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_ENV, "sse2")
    with pytest.raises(GraphdiffError, match="not a CPU kind"):
        forced_kind()
    higher = KINDS[KINDS.index(native_kind()) + 1:]
    for kind in higher:
        monkeypatch.setenv(FORCE_ENV, kind)
        with pytest.raises(GraphdiffError, match="only be forced downwards"):
            forced_kind()
    monkeypatch.setenv(FORCE_ENV, native_kind())
    assert forced_kind() == native_kind()
    kinds = posable_kinds()  # what .ci/run runs the kind-dependent tests again as
    assert len(kinds) == KINDS.index(native_kind()) and kinds == sorted(kinds, key=KINDS.index, reverse=True)
    for kind in kinds:
        monkeypatch.setenv(FORCE_ENV, kind)
        assert forced_kind() == kind


def test_the_cli_says_so_in_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "graphdiff_cli.main", "configs"], env=_env("pentium"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "GRAPHDIFF_CPU_KIND=pentium" in lines[0] and "Traceback" not in proc.stderr


def test_a_truncating_build_stores_toward_zero() -> None:
    values = torch.tensor([1.0078125 + 0.006, -1.0078125 - 0.006, 3.0, -2.9999])  # BF16 steps: 2^-7 and 2^-6 here
    assert store_like(values, "_C_AVX512").tolist() == [1.0078125, -1.0078125, 3.0, -2.984375]
    assert store_like(values, "_C").tolist() == [1.015625, -1.015625, 3.0, -3.0]
    assert store_like(values, "_C_AVX512", torch.float32).tolist() == values.tolist()


def test_registry_claims_that_assume_rounding_to_nearest_hold_only_for_the_rounding_build() -> None:
    from graphdiff.analysis.opaque import extern_rule, truncates_output

    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "cpu_fused_moe"):
        assert extern_rule(f"torch.ops._C.{op}.default", "_C") is not None
        assert extern_rule(f"torch.ops._C.{op}.default", "_C_AVX512") is None, op
    assert extern_rule("torch.ops._C.onednn_mm.default", "_C_AVX512") is not None  # oneDNN rounds to nearest
    assert truncates_output({"backend": "CPU_ATTN", "isa": "vec", "build": "_C_AVX512"})
    assert not truncates_output({"backend": "CPU_ATTN", "isa": "vec", "build": "_C"})
    assert not truncates_output({"backend": "FLASH_ATTN"})
