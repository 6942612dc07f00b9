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
    """What a training repo imports (graphdiff.runtime) reaches the data model (with its source locations) and
    errors, nothing of the scanner, counting imports inside functions too."""
    graph, _ = import_graph()
    runtime = {m for m in graph if m == "graphdiff.runtime" or m.startswith("graphdiff.runtime.")}
    reached = set().union(*(nx.descendants(graph, m) for m in runtime)) - runtime
    data_model = {m for m in reached if m == "graphdiff.records" or m.startswith("graphdiff.records.")}
    assert reached - data_model <= {"graphdiff", "graphdiff.sources", "graphdiff.errors"}, sorted(reached)


# graphdiff's packages, lowest first; an import may point down or within its layer, never up
LAYERS = (
    ("graphdiff", "records", "errors", "ops", "child", "sources"),  # the data model and the shared vocabulary
    ("runtime",),  # what a training repo imports
    ("models", "replay"),  # resolve a model; re-execute a kernel under a rounding plan
    ("capture",),  # both sides' graphs as records: Inductor's hooks, the trainer's trace
    ("engines",),  # the engine interface, vLLM and a recorded dump behind it
    ("analysis", "artifacts"),  # match, decide, plan; scan directories
    ("codegen", "measure"),  # a patch from a plan; gaps, attribution, routing
    ("report", "pipeline", "check", "schemas"),  # what a person reads; the whole scan composed once
)


def package_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """The module graph folded to graphdiff's packages (`graphdiff.engines.vllm.capture` -> `engines`)."""
    def package(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    packages = nx.DiGraph()
    packages.add_nodes_from(package(m) for m in graph)
    packages.add_edges_from((package(a), package(b)) for a, b in graph.edges if package(a) != package(b))
    return packages


def test_packages_form_layers_with_no_cycle() -> None:
    """Every import, also one inside a function, points down a layer or within it, and the packages have no cycle."""
    packages = package_graph(import_graph()[0])
    layer = {p: i for i, names in enumerate(LAYERS) for p in names}
    assert set(packages) <= set(layer), f"packages with no layer: {sorted(set(packages) - set(layer))}"
    up = sorted(f"{a} -> {b}" for a, b in packages.edges if layer[b] > layer[a])
    assert not up, "imports pointing up a layer: " + ", ".join(up)
    assert nx.is_directed_acyclic_graph(packages), list(nx.simple_cycles(packages))


def test_a_planted_upward_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "graphdiff"
    for sub in ("capture", "analysis"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "capture" / "vllm.py").write_text("def f():\n    from graphdiff.analysis import moe\n")
    (pkg / "analysis" / "moe.py").write_text("from graphdiff.capture import vllm\n")
    packages = package_graph(import_graph(pkg)[0])
    assert ("capture", "analysis") in packages.edges and not nx.is_directed_acyclic_graph(packages)


def test_the_capture_names_the_collectives_the_registry_describes() -> None:
    from graphdiff.analysis.opaque import EXTERNS
    from graphdiff.capture.collectives import ALLREDUCE_EXTERNS, MATMUL_EXTERNS

    # the collectives analysed are vLLM CPU's (tensor parallelism on CUDA is not analysed yet)
    assert {r.op for r in EXTERNS if r.kind == "allreduce" and "cpu" in r.devices} == set(ALLREDUCE_EXTERNS)
    assert {r.op for r in EXTERNS if r.kind == "matmul" and "cpu" in r.devices} == set(MATMUL_EXTERNS)


def engine_of(module: str) -> str | None:
    """The engine a module belongs to (`graphdiff.engines.vllm.tp` -> vllm), from the registry's names; None for
    the modules every engine shares (base, store, samples, saved) and for everything outside engines/."""
    from graphdiff.engines import ENGINES

    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["graphdiff", "engines"] and parts[2] in ENGINES else None


def test_engines_are_reached_through_the_registry() -> None:
    """Outside engines/ (the CLI included), nothing imports an engine's own modules (`engines.vllm.*`,
    `engines.inductor`): callers go through `graphdiff.engines` (`kind`, `start`) and `engines/base.py`; and no engine
    imports another."""
    graph, _ = import_graph()
    modules = _package_modules(ROOT)
    cli = [(f"cli.{p.stem}", target) for p in sorted((ROOT.parent / "cli").glob("*.py"))
           for target, _ in _imports(p, f"cli.{p.stem}", modules)]
    around = sorted(f"{a} -> {b}" for a, b in [*graph.edges, *cli]
                    if not a.startswith("graphdiff.engines") and engine_of(b) is not None)
    assert not around, "imports around the engine registry: " + ", ".join(around)
    across = sorted(f"{a} -> {b}" for a, b in graph.edges
                    if engine_of(a) is not None and engine_of(b) is not None and engine_of(a) != engine_of(b))
    assert not across, "an engine importing another: " + ", ".join(across)
