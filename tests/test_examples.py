"""The training-repo workflow of examples/, each script run as a user runs it: scan (engine), commit patches/ into a
git repo, `graphdiff check` as its CI gate, and the patch applied inside TRL's GRPOTrainer and an FSDP2 loop."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from graphdiff import runtime
from graphdiff.codegen import generate

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
QWEN3_SCAN = ROOT / "fixtures" / "scans" / "tiny-qwen3"
GIT_USER = {f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")
            for what, value in (("NAME", "graphdiff test"), ("EMAIL", "test@example.invalid"))}


def run_example(name: str, *args: str, cwd: Path, timeout: int = 300,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """examples/NAME as a user runs it: scripts with bash, .py with this Python; `graphdiff` on PATH."""
    script = EXAMPLES / name
    cmd = [sys.executable, str(script)] if script.suffix == ".py" else ["bash", str(script)]
    env = {**os.environ, **GIT_USER, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           **(env or {})}
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env={**os.environ, **GIT_USER}, capture_output=True, text=True,
                          check=True).stdout


def new_train_repo(root: Path) -> Path:
    repo = root / "train-repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text("# the training code\n")
    git(repo, "add", "train.py")
    git(repo, "commit", "-q", "-m", "training code")
    return repo


def load_example(name: str) -> ModuleType:
    """examples/NAME imported (its `main` not run), to reuse what the script computes."""
    spec = importlib.util.spec_from_file_location(f"example_{Path(name).stem}", EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shipped_regions(manifest: Path) -> int:
    return sum(1 for r in json.loads(manifest.read_text())["regions"] if r["generated"] and r["enabled"])


@pytest.fixture(scope="module")
def scan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scan directory as step 1 leaves it (recorded scan; its patch generated without the engine)."""
    d = tmp_path_factory.mktemp("scan")
    for name in ("scan.json", "train.capture.json"):
        shutil.copy(QWEN3_SCAN / name, d / name)
    generate(QWEN3_SCAN, d / "patch")
    return d


@pytest.fixture(scope="module")
def train_repo(scan_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A training repo with the patch committed by step 2, and that step's output."""
    repo = new_train_repo(tmp_path_factory.mktemp("commit"))
    proc = run_example("2_commit_patch.sh", str(scan_dir), str(repo), cwd=repo.parent)
    assert proc.returncode == 0, proc.stderr
    return repo, proc.stdout


def test_commit_patch_checks_in_the_generated_files_once(scan_dir: Path, train_repo: tuple[Path, str]) -> None:
    repo, out = train_repo
    assert "committed" in out
    assert git(repo, "show", "--name-only", "--format=", "HEAD").split() == ["patches/graphdiff_patch.py",
                                                                           "patches/manifest.json"]
    message = git(repo, "log", "-1", "--format=%B")
    assert "graphdiff patch for tiny:qwen3" in message and "Regenerate: graphdiff scan tiny:qwen3" in message
    for name in ("graphdiff_patch.py", "manifest.json"):
        assert (repo / "patches" / name).read_bytes() == (scan_dir / "patch" / name).read_bytes()
    assert not git(repo, "status", "--porcelain")
    head = git(repo, "rev-parse", "HEAD")
    again = run_example("2_commit_patch.sh", str(scan_dir), str(repo), cwd=repo.parent)
    assert again.returncode == 0 and "patches/ unchanged" in again.stdout
    assert git(repo, "rev-parse", "HEAD") == head


def test_commit_patch_without_a_patch_says_which_step_is_missing(tmp_path: Path) -> None:
    repo = new_train_repo(tmp_path)
    proc = run_example("2_commit_patch.sh", str(tmp_path / "no-scan"), str(repo), cwd=tmp_path)
    assert proc.returncode == 2 and "run step 1" in proc.stderr
    assert not (repo / "patches").exists()


def test_ci_check_fails_when_the_model_config_changed(train_repo: tuple[Path, str], tiny_models: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """The gate refuses a patch for another model config before any engine starts."""
    repo, _ = train_repo
    changed = tmp_path / "changed"
    shutil.copytree(tiny_models["qwen3"], changed)
    config = json.loads((changed / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (changed / "config.json").write_text(json.dumps(config))
    summary = tmp_path / "summary.md"
    proc = run_example("3_ci_check.sh", "patches/manifest.json", "--model", str(changed), cwd=repo,
                       env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "must be regenerated" in proc.stdout and "| `rms_norm_eps` | 1e-06 | 1e-05 |" in proc.stdout
    assert summary.read_text() == proc.stdout  # the same report as the job's summary


def test_fsdp2_loop_trains_the_patched_model(train_repo: tuple[Path, str], tiny_models: dict[str, Path]) -> None:
    repo, _ = train_repo
    manifest = repo / "patches" / "manifest.json"
    proc = run_example("train_fsdp2.py", "--model", str(tiny_models["qwen3"]), "--patch", "patches/manifest.json",
                       "--steps", "2", "--batch", "2", "--seq-len", "16", cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"patched regions: {shipped_regions(manifest)}\n" in proc.stdout
    losses = re.findall(r"^step (\d+) loss (\S+)$", proc.stdout, re.M)
    assert [s for s, _ in losses] == ["1", "2"] and all(math.isfinite(float(v)) for _, v in losses)

    # Its first step ran the patched forward under fully_shard: the loss is the patched model's, not HF's.
    from transformers import AutoModelForCausalLM

    example = load_example("train_fsdp2.py")
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.bfloat16, attn_implementation="sdpa")
    ids = next(example.batches(model.config.vocab_size, 2, 16, example.SEED))
    with torch.no_grad():
        hf = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
        runtime.apply(model, manifest)
        patched = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    assert losses[0][1] == f"{patched:.6f}" != f"{hf:.6f}"


def test_grpo_trainer_trains_the_patched_model(train_repo: tuple[Path, str], tiny_models: dict[str, Path],
                                               tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[examples]' (scripts/setup.sh does)")
    repo, _ = train_repo
    proc = run_example("train_grpo.py", "--model", str(tiny_models["qwen3"]), "--patch", "patches/manifest.json",
                       "--out", str(tmp_path / "grpo"), "--steps", "2", "--completion-len", "4", cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"trained (\d+) steps; patched regions: (\d+); grad norms: \[(.*)\]", proc.stdout)
    assert found, proc.stdout[-2000:]
    assert int(found[1]) == 2 and int(found[2]) == shipped_regions(repo / "patches" / "manifest.json")
    norms = [float(x) for x in found[3].split(",")]
    assert len(norms) == 2 and all(math.isfinite(n) and n > 0 for n in norms)


@pytest.mark.engine
def test_scan_commit_and_check_with_the_real_engine(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The workflow end to end: step 1 scans against the engine (one start), step 2 commits its patch, step 3's CI
    gate re-scans the patched trainer (one start) and passes."""
    scans = tmp_path / "engine-machine"
    scans.mkdir()
    scan = run_example("1_scan.sh", str(tiny_models["qwen3"]), "scans/tiny-qwen3", "--shapes", "16", cwd=scans,
                       timeout=900)
    assert scan.returncode == 0, scan.stderr[-3000:]
    scan_dir = scans / "scans" / "tiny-qwen3"
    assert (scan_dir / "patch" / "manifest.json").is_file() and (scan_dir / "patch" / "graphdiff_patch.py").is_file()

    repo = new_train_repo(tmp_path)
    commit = run_example("2_commit_patch.sh", str(scan_dir), str(repo), cwd=tmp_path)
    assert commit.returncode == 0, commit.stderr

    check = run_example("3_ci_check.sh", cwd=repo, timeout=900)  # patches/manifest.json, the patch's shapes
    assert check.returncode == 0, (check.stdout + check.stderr)[-3000:]
    assert "the patch still holds" in check.stdout
