"""The package's shape: no import cycles among autoshard's modules (counting imports inside functions, which
only defer a cycle, and ``if TYPE_CHECKING:`` imports, which tie the modules all the same), no long modules."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"autoshard": ROOT / "autoshard"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _runtime_imports(tree: ast.AST) -> list[str]:
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
            found.extend(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        for target in _runtime_imports(ast.parse(path.read_text())):
            if target in mods and target not in (name, "autoshard"):
                g.add_edge(name, target)
    return g


def test_the_checker_sees_a_cycle() -> None:
    g = import_graph()
    assert g.number_of_edges() > 50
    g.add_edge("autoshard.ir", "autoshard.api")  # api imports (through others) ir
    assert list(nx.simple_cycles(g))


def test_no_import_cycles() -> None:
    cycles = [" -> ".join(c + [c[0]]) for c in nx.simple_cycles(import_graph())]
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles, key=len)[:10])


def test_every_module_reads_in_one_sitting() -> None:
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_every_benchmark_and_test_file_reads_in_one_sitting() -> None:
    files = [p for folder in ("benchmarks", "tests") for p in (ROOT / folder).rglob("*.py")]
    assert len(files) > 20
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"benchmark and test files over 400 lines: {long}"


# lower layers never call up: the runtime runs a program and imports no pass; the solver, the cost model, the op
# rules, the shared IR and where weights come from (weights/) know nothing of the passes, the planner, pipelines or
# the runtime
LAYERS = {
    "autoshard.runtime": ("autoshard.compiler", "autoshard.planner", "autoshard.api", "autoshard.solver"),
    "autoshard.solver": ("autoshard.compiler", "autoshard.planner", "autoshard.api", "autoshard.pipeline",
                         "autoshard.runtime"),
    "autoshard.cost": ("autoshard.compiler", "autoshard.planner", "autoshard.api", "autoshard.pipeline",
                       "autoshard.runtime", "autoshard.solver"),
    "autoshard.rules": ("autoshard.compiler", "autoshard.planner", "autoshard.api", "autoshard.pipeline",
                        "autoshard.runtime", "autoshard.solver"),
    "autoshard.weights": ("autoshard.compiler", "autoshard.planner", "autoshard.api", "autoshard.pipeline",
                          "autoshard.runtime", "autoshard.solver"),
    "autoshard.ir": ("autoshard.compiler", "autoshard.planner", "autoshard.api", "autoshard.pipeline",
                     "autoshard.runtime", "autoshard.solver"),
}


def test_no_up_calls() -> None:
    g = import_graph()
    bad = [f"{a} -> {b}" for a, b in g.edges for low, banned in LAYERS.items()
           if (a == low or a.startswith(low + ".")) and any(b == x or b.startswith(x + ".") for x in banned)]
    assert not bad, "imports from a lower layer up:\n" + "\n".join(sorted(bad))


def test_bad_input_errors_share_the_base_class() -> None:
    """Bad input is an ``autoshard.InputError`` (a ValueError and an ``AutoshardError``), never a bare ValueError;
    the public error types are exported at the top level."""
    import autoshard
    from autoshard.errors import AutoshardError

    bare = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in _modules().values()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
            and isinstance(node.exc.func, ast.Name) and node.exc.func.id == "ValueError"]
    assert not bare, "raise autoshard.errors.InputError instead of ValueError at:\n" + "\n".join(bare)
    for name in ("InputError", "InfeasibleBudget", "SolverTimeout", "DataDependentError", "LaunchError"):
        assert issubclass(getattr(autoshard, name), AutoshardError), name
    assert issubclass(autoshard.InputError, ValueError) and issubclass(autoshard.InfeasibleBudget, ValueError)
    assert issubclass(autoshard.SolverTimeout, RuntimeError) and issubclass(autoshard.LaunchError, RuntimeError)
