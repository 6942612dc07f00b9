"""Bad input: one clear line on stderr, exit code 2, nothing written before is lost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES


def run_cli(*args: str, pre: str = "") -> subprocess.CompletedProcess:
    code = f"{pre}\nimport sys\nfrom graphdiff_cli.main import main\nsys.argv = ['graphdiff', *{list(args)!r}]\nmain()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]  # progress lines may precede it; one error line
    return errors[0]


def test_missing_model_dir(tmp_path):
    assert "does not exist" in one_error_line(run_cli("capture", str(tmp_path / "nope"), "--engine", "hf",
                                                      "--out", str(tmp_path / "o")))


def test_corrupt_config(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    assert "config.json" in one_error_line(run_cli("capture", str(tmp_path / "m"), "--engine", "hf",
                                                   "--out", str(tmp_path / "o")))


def test_unknown_engine(tmp_path):
    assert "unknown engine" in one_error_line(run_cli("capture", "x", "--engine", "tgi", "--out", str(tmp_path)))


def test_unknown_hf_id_for_scan(tmp_path):
    assert "graphdiff configs" in one_error_line(run_cli("scan", "nobody/NoSuchModel-1B", "--out", str(tmp_path)))


def test_partial_dump(tmp_path):
    d = tmp_path / "dump" / "torchinductor" / "g0"
    d.mkdir(parents=True)
    (d / "output_code.py").write_text("# nothing\n")
    assert "partial dump" in one_error_line(run_cli("capture", str(tmp_path / "dump"), "--engine", "dump",
                                                    "--out", str(tmp_path / "o")))


def test_not_a_dump(tmp_path):
    assert "no Inductor graphs" in one_error_line(run_cli("capture", str(tmp_path), "--engine", "dump",
                                                          "--out", str(tmp_path / "o")))


def test_engine_capture_without_vllm_says_so_and_hf_still_works(tiny_models, tmp_path):
    block = "import sys; sys.modules['vllm'] = None"
    msg = one_error_line(run_cli("capture", str(tiny_models["qwen3"]), "--engine", "vllm", "--out",
                                 str(tmp_path / "v"), pre=block))
    assert "vLLM is not installed" in msg
    ok = run_cli("capture", str(tiny_models["qwen3"]), "--engine", "hf", "--out", str(tmp_path / "h"), pre=block)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "h" / "capture.json").exists()


def test_a_failed_capture_keeps_the_previous_output(tiny_models, tmp_path):
    out = tmp_path / "o"
    assert run_cli("capture", str(tiny_models["qwen3"]), "--engine", "hf", "--out", str(out)).returncode == 0
    before = (out / "capture.json").read_text()
    one_error_line(run_cli("capture", str(tmp_path / "missing"), "--engine", "hf", "--out", str(out)))
    assert (out / "capture.json").read_text() == before


def test_dump_fixture_imports(tmp_path):
    proc = run_cli("capture", str(FIXTURES / "dumps" / "vllm-cpu-tiny-qwen3"), "--engine", "dump", "--out",
                   str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cpp_fused_mul_onednn_mm_silu_slice_3" in proc.stdout
    assert Path(tmp_path / "capture.json").exists()


def test_an_architecture_nobody_builds_is_refused_before_the_engine(tiny_models, tmp_path):
    """A config naming an architecture transformers does not build is refused by name before any engine
    starts, and nothing is written."""
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["qwen3"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    msg = one_error_line(run_cli("capture", str(bad), "--engine", "vllm", "--out", str(tmp_path / "o")))
    assert "NoSuchModelForCausalLM" in msg and "decoder-only causal language models" in msg
    assert not (tmp_path / "o" / "capture.json").exists()


def _bert(tmp_path: Path, arch: str) -> Path:
    from transformers import BertConfig

    d = tmp_path / arch
    BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, vocab_size=100,
               architectures=[arch], is_decoder=arch == "BertLMHeadModel").save_pretrained(d)
    return d


def test_a_non_decoder_checkpoint_is_refused_with_what_graphdiff_scans(tmp_path):
    msg = one_error_line(run_cli("scan", str(_bert(tmp_path, "BertForMaskedLM")), "--out", str(tmp_path / "o")))
    assert "BertForMaskedLM" in msg and "decoder-only causal language models" in msg


@pytest.mark.engine
def test_a_causal_lm_vllm_does_not_run_is_refused_by_name(tmp_path):
    """BertLMHeadModel is a transformers causal LM, but not a vLLM text-generation model: the engine's child
    process says so in one line (the engine is not started)."""
    pytest.importorskip("vllm")
    msg = one_error_line(run_cli("scan", str(_bert(tmp_path, "BertLMHeadModel")), "--random-weights", "--out",
                                 str(tmp_path / "o")))
    assert "does not run BertLMHeadModel" in msg
