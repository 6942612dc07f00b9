"""Recorded source locations travel: a scan made in another checkout (its absolute paths under a prefix that does not
exist here) patches, reports and explains as the original does, reading each forward from the installed package."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graphdiff import sources
from graphdiff.records import Source
from tests.conftest import FIXTURES

OLMO2 = FIXTURES / "scans" / "tiny-olmo2-3"
ELSEWHERE = "/nonexistent/graphdiff-checkout/.venv/lib/python3.11/site-packages/"


def _moved(src: Path, dst: Path, prefix: str) -> Path:
    """A copy of the recorded scan directory `src` whose every source file sits under `prefix` instead."""
    shutil.copytree(src, dst)
    for f in dst.rglob("*.json"):
        text = f.read_text()
        moved = text.replace('"file": "', f'"file": "{prefix}')  # recorded import paths, or old absolute ones
        f.write_text(moved.replace(f'"file": "{prefix}/', f'"file": "{prefix}'))
    return dst


def test_a_recorded_absolute_path_is_read_as_its_import_path() -> None:
    src = Source(file=ELSEWHERE + "transformers/models/olmo2/modeling_olmo2.py", line=64)
    assert src.file == "transformers/models/olmo2/modeling_olmo2.py"
    copied = Source(file="/nowhere/copy/transformers/models/olmo2/modeling_olmo2.py", line=1)  # no site-packages
    assert copied.file == src.file
    assert sources.dotted_module(src.file) == "transformers.models.olmo2.modeling_olmo2"
    installed = sources.installed_file(src.file)
    assert installed is not None and Path(installed).is_file() and not installed.startswith("/nonexistent")
    assert sources.installed_file("not_a_package/x.py") is None and sources.read_source("x.py") is None


def test_a_package_version_other_than_the_recorded_one_is_named() -> None:
    import transformers

    file = "transformers/models/olmo2/modeling_olmo2.py"
    assert sources.version_mismatch(file, {"transformers": transformers.__version__}) is None
    line = sources.version_mismatch(file, {"transformers": "0.0.1"})
    assert line is not None and "transformers 0.0.1" in line and transformers.__version__ in line
    assert sources.version_mismatch("script.py", {"transformers": "0.0.1"}) is None


def test_no_recorded_fixture_holds_an_absolute_source_path() -> None:
    """What the repository records was written as import paths: nothing ties it to the machine that recorded it."""
    absolute = [str(f.relative_to(FIXTURES)) for f in FIXTURES.rglob("*.json") if '"file": "/' in f.read_text()]
    assert not absolute, absolute


@pytest.mark.parametrize("prefix", [ELSEWHERE, "/nowhere/copied-tree/"])
def test_a_scan_moved_under_a_missing_prefix_generates_every_region(tmp_path: Path, prefix: str) -> None:
    from graphdiff_cli.main import app

    scan = _moved(OLMO2, tmp_path / "scan", prefix)
    assert prefix in (scan / "scan.json").read_text()
    res = CliRunner().invoke(app, ["patch", str(scan), "--out", str(tmp_path / "patch"), "--no-measure"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "patch" / "manifest.json").read_text())
    assert manifest["regions"] and all(r["generated"] for r in manifest["regions"]), \
        [(r["name"], r["reason"]) for r in manifest["regions"] if not r["generated"]]
    rope = next(s for s in manifest["splices"] if s["module_class"] == "Olmo2RotaryEmbedding")
    assert rope["outputs"] == [0, 1]  # cos and sin, read from the installed forward's `return cos, sin`
    assert not list(scan.rglob("*.py"))  # nothing written into the input directory
