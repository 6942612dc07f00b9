"""The command line's informational commands."""

import re
from pathlib import Path

from tests.test_cli_errors import run_cli


def test_configs_lists_the_bundled_ids():
    proc = run_cli("configs")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Qwen/Qwen3-8B" in proc.stdout and "meta-llama/Llama-3.1-8B" in proc.stdout


def test_help_names_every_command():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for cmd in ("scan", "capture", "report", "patch", "kl", "make-tiny", "configs", "explain", "replay"):
        assert cmd in proc.stdout


def test_patch_verify_checks_every_splice_and_refuses_a_missing_gpu(tmp_path):
    from tests.conftest import FIXTURES
    from tests.test_cli_errors import one_error_line

    scan = str(FIXTURES / "scans" / "tiny-qwen3")
    proc = run_cli("patch", scan, "--out", str(tmp_path / "p"), "--verify", "--no-measure")  # no engine here
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"all \d+ checks passed", proc.stdout) and "PyTorch path only" in proc.stdout
    assert not (Path(scan) / "engine_samples.json").exists()  # nothing written into the scan
    pre = "import torch; torch.cuda.is_available = lambda: False"
    msg = one_error_line(run_cli("patch", scan, "--out", str(tmp_path / "q"), "--verify", "--no-measure",
                                 "--device", "cuda", pre=pre))
    assert "no CUDA device" in msg
    assert (tmp_path / "q" / "manifest.json").is_file()  # what was generated before the check stays
