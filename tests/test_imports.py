"""The package's import graph: no cycles (module-level or inside functions), no private names across modules."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "graphdiff"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_modules(root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in root.rglob("*.py") if "forced_kind" not in p.parts}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every graphdiff import in the file, at any depth."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "graphdiff"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "graphdiff":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub, None) if sub in modules else (base, a.name))
    return found


def import_graph(root: Path = ROOT) -> tuple[nx.DiGraph, list[str]]:
    """The module import graph, and every `from graphdiff.X import _private` across modules."""
    modules = _package_modules(root)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    private = []
    for name, path in modules.items():
        for target, imported in _imports(path, name, modules):
            while target not in modules and "." in target:  # `import graphdiff.a.b` of a name: its module
                target = target.rpartition(".")[0]
            if target != name:
                graph.add_edge(name, target)
            if imported and imported.startswith("_") and not imported.startswith("__") and target != name:
                private.append(f"{name} imports {imported} from {target}")
    return graph, private


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    """Each strongly connected group of more than one module, with one cycle through it."""
    return [sorted(c)
            for c in nx.strongly_connected_components(graph) if len(c) > 1]


def test_no_import_cycles() -> None:
    graph, _ = import_graph()
    assert not cycles(graph), "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles(graph))


def test_no_private_names_across_modules() -> None:
    _, private = import_graph()
    assert not private, "\n".join(private)


def test_a_planted_cycle_and_private_import_are_found(tmp_path: Path) -> None:
    pkg = tmp_path / "graphdiff"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from graphdiff.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from graphdiff.a import _helper\n")
    (pkg / "c.py").write_text("from graphdiff import a\n")
    graph, private = import_graph(pkg)
    assert cycles(graph) == [["graphdiff.a", "graphdiff.sub.b"]]
    assert private == ["graphdiff.sub.b imports _helper from graphdiff.a"]


def test_the_runtime_reaches_only_the_data_model() -> None:
    """What a training repo imports (graphdiff.runtime) reaches the data model and errors, nothing of the scanner,
    counting imports inside functions too."""
    graph, _ = import_graph()
    runtime = {m for m in graph if m == "graphdiff.runtime" or m.startswith("graphdiff.runtime.")}
    reached = set().union(*(nx.descendants(graph, m) for m in runtime)) - runtime
    assert reached <= {"graphdiff", "graphdiff.records", "graphdiff.errors"}, sorted(reached)
