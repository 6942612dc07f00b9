"""Function size in graphdiff/: at most 60 lines and 20 branches, unless a comment at the def says why.

Branches are counted as ruff's PLR0912 counts them (pyproject selects it with max-branches = 20, so `ruff check`
enforces the branch part too; an exempted function there also carries `# noqa: PLR0912`). The exemption is a
`# size: <why>` comment on the def line or the line just above the def (or above its decorators).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "graphdiff"
MAX_LINES = 60
MAX_BRANCHES = 20
WHY = re.compile(r"#.*\bsize: *\S")

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _is_elif(stmt: ast.If, source_lines: list[str]) -> bool:
    return source_lines[stmt.lineno - 1][stmt.col_offset:].startswith("elif")


def branches(body: list[ast.stmt], source_lines: list[str]) -> int:
    """Branches as ruff's PLR0912 counts them: each if/elif/else, for/while (and their else), except handler,
    try's else and finally, match case; `with` bodies counted, nested function and class bodies not."""
    n = 0
    for stmt in body:
        if isinstance(stmt, ast.If):
            n += 1 + branches(stmt.body, source_lines)
            orelse = stmt.orelse
            while len(orelse) == 1 and isinstance(orelse[0], ast.If) and _is_elif(orelse[0], source_lines):
                n += 1 + branches(orelse[0].body, source_lines)
                orelse = orelse[0].orelse
            n += (1 + branches(orelse, source_lines)) if orelse else 0
        elif isinstance(stmt, ast.For | ast.AsyncFor | ast.While):
            n += 1 + branches(stmt.body, source_lines) + ((1 + branches(stmt.orelse, source_lines))
                                                           if stmt.orelse else 0)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            n += branches(stmt.body, source_lines)
            n += sum(1 + branches(h.body, source_lines) for h in stmt.handlers)
            n += (1 + branches(stmt.orelse, source_lines)) if stmt.orelse else 0
            n += (1 + branches(stmt.finalbody, source_lines)) if stmt.finalbody else 0
        elif isinstance(stmt, ast.With | ast.AsyncWith):
            n += branches(stmt.body, source_lines)
        elif isinstance(stmt, ast.Match):
            n += sum(1 + branches(c.body, source_lines) for c in stmt.cases)
    return n


def _length(fn: Function) -> int:
    return (fn.end_lineno or fn.lineno) - fn.lineno + 1


def _exempt(fn: Function, source_lines: list[str]) -> bool:
    first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    return any(WHY.search(source_lines[i - 1]) for i in {fn.lineno, first - 1} if i >= 1)


def functions(path: Path) -> Iterator[tuple[Function, list[str]]]:
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node, lines


def oversized(root: Path) -> list[str]:
    """`path:line name: N lines, M branches` for every function over the limits without a `# size:` reason."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for fn, lines in functions(path):
            n_lines, n_branches = _length(fn), branches(fn.body, lines)
            if (n_lines > MAX_LINES or n_branches > MAX_BRANCHES) and not _exempt(fn, lines):
                found.append(f"{path.relative_to(root.parent)}:{fn.lineno} {fn.name}: {n_lines} lines, "
                             f"{n_branches} branches")
    return found


def test_no_function_in_graphdiff_is_over_the_limits_without_a_reason() -> None:
    found = oversized(ROOT)
    assert not found, f"over {MAX_LINES} lines or {MAX_BRANCHES} branches (split, or say why with `# size:`):\n" + \
        "\n".join(found)


LONG = "def long(x):\n" + "".join(f"    x = x + {i}\n" for i in range(60)) + "    return x\n"
BRANCHY = "def branchy(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(21)) + "    return x\n"


@pytest.mark.parametrize("code", [LONG, BRANCHY], ids=["61-lines", "21-branches"])
def test_a_planted_function_over_the_limits_fails_unless_a_comment_says_why(code: str, tmp_path: Path) -> None:
    pkg = tmp_path / "graphdiff"
    pkg.mkdir()
    (pkg / "ok.py").write_text("def short(x):\n    return x\n")
    (pkg / "big.py").write_text(code)
    assert [f.split(":")[0] for f in oversized(pkg)] == ["graphdiff/big.py"]
    (pkg / "big.py").write_text("# size: one table, read top to bottom\n" + code)
    assert oversized(pkg) == []
    (pkg / "big.py").write_text("# one table\n" + code)  # a comment that does not say it is about size
    assert len(oversized(pkg)) == 1


@pytest.mark.parametrize(("code", "want"), [
    ("if a:\n    pass\nelif b:\n    pass\nelse:\n    pass\n", 3),
    ("if a:\n    pass\nelse:\n    if b:\n        pass\n", 3),
    ("for x in y:\n    if x:\n        pass\nelse:\n    pass\n", 3),
    ("while a:\n    pass\n", 1),
    ("try:\n    if a:\n        pass\nexcept A:\n    pass\nexcept B:\n    pass\nelse:\n    pass\n"
     "finally:\n    pass\n", 5),
    ("with a:\n    if b:\n        pass\n", 1),
    ("match a:\n    case 1:\n        pass\n    case _:\n        if b:\n            pass\n", 3),
    ("def inner():\n    if a:\n        pass\n", 0),
    ("x = [i for i in y if i]\nz = a if b else c\n", 0),
])
def test_branches_are_counted_as_ruff_counts_them(code: str, want: int) -> None:
    lines = code.splitlines()
    assert branches(ast.parse(code).body, lines) == want
