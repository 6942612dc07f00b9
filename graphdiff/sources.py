"""Source locations that travel: a recorded op's file as an import path (`transformers/models/qwen3/modeling_qwen3.py`),
resolved through the installed package, never through the recording machine's absolute path.

Users capture on the engine's machine and patch elsewhere (another checkout, another Python): a recorded
`/home/a/.venv/lib/python3.11/site-packages/transformers/...` means nothing there, and the same file of the installed
package is what the trainer runs."""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import PurePath, PurePosixPath

PACKAGE_DIRS = ("site-packages", "dist-packages")  # where an installed package's import path starts


def import_path(file: str) -> str:
    """`file` as the path its module is imported by: the part after the last `site-packages/` (or `dist-packages/`),
    else relative to the longest `sys.path` entry holding it, else from its outermost installed package on; a file
    outside all three (a script) keeps its name."""
    path = PurePath(file)
    parts = path.parts
    if not path.is_absolute():  # already an import path, or one under a placeholder (`SITE/transformers/...`)
        start = next((i for i in range(len(parts) - 1) if _installed_package(parts[i])), 0)
        return PurePosixPath(*parts[start:]).as_posix() if parts else file
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in PACKAGE_DIRS and i + 1 < len(parts):
            return PurePosixPath(*parts[i + 1:]).as_posix()
    roots = sorted((PurePath(p) for p in sys.path if p and PurePath(p).is_absolute()),
                   key=lambda p: len(p.parts), reverse=True)
    for root in roots:
        if path.is_relative_to(root) and path != root:
            return PurePosixPath(*path.relative_to(root).parts).as_posix()
    for i in range(1, len(parts) - 1):  # a package tree copied elsewhere: from its outermost installed package
        if _installed_package(parts[i]):
            return PurePosixPath(*parts[i:]).as_posix()
    return path.name


@functools.cache
def _installed_package(name: str) -> bool:
    if not name.isidentifier():
        return False
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.submodule_search_locations is not None


def dotted_module(file: str) -> str | None:
    """The module a recorded source file is (`transformers.models.qwen3.modeling_qwen3`), or None for a non-Python
    file or one with no import path."""
    rel = PurePosixPath(import_path(file))
    if rel.suffix != ".py" or not rel.parts:
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) if parts and all(p.isidentifier() for p in parts) else None


def package(file: str) -> str:
    """The top-level package a recorded source file belongs to (`transformers`), "" for a bare name."""
    rel = PurePosixPath(import_path(file))
    return rel.parts[0] if len(rel.parts) > 1 else ""


def installed_file(file: str) -> str | None:
    """The installed file a recorded source location names, found by its module; None when no installed module is
    it. Nothing is imported: the module's spec gives its file."""
    module = dotted_module(file)
    if module is None:
        return None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def read_source(file: str) -> str | None:
    """The text of the installed file a recorded source location names; None when it cannot be found or read."""
    origin = installed_file(file)
    if origin is None:
        return None
    try:
        with open(origin, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def parse_source(file: str) -> ast.Module | None:
    """The syntax tree of the installed file a recorded source location names (read and parsed once per file: the
    codegen reads a module's forward for every splice); None when it cannot be found, read or parsed. Read only."""
    text = read_source(file)
    try:
        return ast.parse(text) if text is not None else None
    except (SyntaxError, ValueError):
        return None


def installed_version(name: str) -> str | None:
    """The installed version of distribution `name`, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def version_mismatch(file: str, recorded: dict[str, str]) -> str | None:
    """One line when the package `file` belongs to is installed at another version than the recording's
    (`recorded`: package -> version, as scans and captures keep them): its line numbers may then name other code."""
    name = package(file)
    want = recorded.get(name)
    if not name or not want:
        return None
    have = installed_version(name)
    if have is None or have.split("+")[0] == want.split("+")[0]:
        return None
    return (f"{import_path(file)} was recorded with {name} {want} and {name} {have} is installed: its source lines "
            f"may differ (install {name}=={want} or scan again with {have})")
