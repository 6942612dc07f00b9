"""The benchmark scripts import: each runs as `python benchmarks/X.py` with its own folder on the path, and a name
one of them takes from another or from graphdiff that moved would only show when someone next measures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPORT_EACH = """
import importlib, sys, traceback
sys.path.insert(0, sys.argv[1])
failed = 0
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except Exception:
        failed += 1
        print(f"{name}: {traceback.format_exc(limit=1).strip()}")
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_script_imports() -> None:
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    assert "patch_step_benchmark" in scripts
    proc = subprocess.run([sys.executable, "-c", IMPORT_EACH, str(ROOT / "benchmarks"), *scripts], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
