"""The command line's informational commands."""

from tests.test_cli_errors import run_cli


def test_configs_lists_the_bundled_ids():
    proc = run_cli("configs")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Qwen/Qwen3-8B" in proc.stdout and "meta-llama/Llama-3.1-8B" in proc.stdout


def test_help_names_every_command():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for cmd in ("scan", "capture", "report", "patch", "kl", "make-tiny", "configs"):
        assert cmd in proc.stdout
