"""The user docs match the tree: paths they name exist, the module table is the package, the README starts with the
commands `.ci/run` runs. Reads files only (no engine, no torch)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphdiff"
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
README_MAX_LINES = 250
# Where a repository path starts; ARCHITECTURE.md also names modules relative to graphdiff/ (`engines/vllm/capture.py`).
ROOTS = ("graphdiff", "cli", "tests", "benchmarks", "scripts", "examples", "fixtures", "docs")
SUBPACKAGES = tuple(sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(ROOTS + SUBPACKAGES) + r")/[\w./-]*)")
PLACEHOLDER = re.compile(r"[A-Z]{2,}")  # `tests/test_X.py`-style stand-ins: ARCH, DIR, SCAN
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
TICKS = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def fenced_blocks(text: str) -> list[str]:
    return [m.group(0).split("\n", 1)[1].rsplit("```", 1)[0] for m in FENCE.finditer(text)]


def named_paths(text: str) -> set[str]:
    """Repository paths a document names: inside backticks and fenced blocks (`pytest tests/test_x.py`, too)."""
    chunks = TICKS.findall(FENCE.sub("", text)) + fenced_blocks(text)
    found = set()
    for chunk in chunks:
        for p in PATH.findall(chunk):
            p = p.rstrip(".,:;").split("::")[0]
            if "/" in p.rstrip("/") and not PLACEHOLDER.search(p):
                found.add(p)
    return found


def exists(path: str) -> bool:
    return (ROOT / path).exists() or (PACKAGE / path).exists()


def module_table() -> list[str]:
    """The backticked entries of the first column of ARCHITECTURE.md's module table (paths under graphdiff/)."""
    section = ARCHITECTURE.read_text().split("\n## Modules", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [name for row in rows for name in TICKS.findall(row.split(" | ")[0])]


def package_modules() -> set[str]:
    """Every module of graphdiff/; an `__init__.py` counts where it holds code (a def or class)."""
    out = set()
    for f in PACKAGE.rglob("*.py"):
        if "__pycache__" in f.parts:
            continue
        if f.name == "__init__.py" and not re.search(r"^(def|class|async def) ", f.read_text(), re.M):
            continue
        out.add(f.relative_to(PACKAGE).as_posix())
    return out


@pytest.mark.parametrize("doc", docs(), ids=lambda p: p.name)
def test_every_named_path_exists(doc: Path) -> None:
    missing = sorted(p for p in named_paths(doc.read_text()) if not exists(p))
    assert not missing, f"{doc.relative_to(ROOT)} names paths that are not in the repository: {missing}"


@pytest.mark.parametrize("doc", docs(), ids=lambda p: p.name)
def test_every_link_resolves(doc: Path) -> None:
    links = [t for t in LINK.findall(doc.read_text()) if "://" not in t]
    missing = [t for t in links if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that are not in the repository: {missing}"


def test_path_check_catches_a_bad_path() -> None:
    text = "see `graphdiff/analysis/no_such_module.py` and\n```\npython benchmarks/nothing_here.py\n```\n"
    assert {p for p in named_paths(text) if not exists(p)} == {"graphdiff/analysis/no_such_module.py",
                                                               "benchmarks/nothing_here.py"}


def test_module_table_is_the_package() -> None:
    named = module_table()
    absent = [n for n in named if not (PACKAGE / n).exists()]
    assert not absent, f"ARCHITECTURE.md's module table names modules that do not exist: {absent}"
    unlisted = sorted(package_modules() - set(named))
    assert not unlisted, f"modules missing from ARCHITECTURE.md's module table: {unlisted}"


def test_first_picture_is_the_package_listing() -> None:
    picture = fenced_blocks(ARCHITECTURE.read_text())[0]
    entries = [p.name + "/" if p.is_dir() else p.name for p in sorted(PACKAGE.iterdir())
               if p.name not in ("__init__.py", "__pycache__")]
    missing = [e for e in entries if e not in picture]
    assert not missing, f"`ls graphdiff/` entries missing from ARCHITECTURE.md's first picture: {missing}"
    stages = ["models/", "capture/", "replay/", "analysis/", "codegen/", "measure/", "report/"]
    starts = [re.search(rf"^\s*{s}", picture, re.M) for s in stages]
    assert all(starts), "each stage starts a line of the picture"
    assert [m.start() for m in starts] == sorted(m.start() for m in starts), f"stages in pipeline order: {stages}"


def test_architecture_names_no_file_outside_the_repository() -> None:
    text = ARCHITECTURE.read_text()
    assert not re.search(r"\.\./|/work/|\bshared/", text)
    outside = {name for name in re.findall(r"\b([\w-]+\.md)\b", text) if not list(ROOT.rglob(name))}
    assert not outside, f"ARCHITECTURE.md names documents that are not in the repository: {sorted(outside)}"


def test_readme_is_short_and_starts_with_the_ci_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    setup = next(line for line in ci if line.startswith("bash scripts/"))
    tests = next(line for line in ci if line.endswith("-m pytest"))
    first, second = (b.strip() for b in fenced_blocks(text)[:2])
    assert first.startswith(f"{setup} && .venv/bin/graphdiff scan ") and "\n" not in first, first
    assert second == tests, f"the README's second command is not .ci/run's test command {tests!r}: {second!r}"
