"""The package's shape, checked for intent rather than counts:

- no import cycles among autoshard's modules (imports inside functions count: they only defer a cycle; imports
  under ``if TYPE_CHECKING:`` do not: they name a type for an annotation, which is how a value's module and its
  renderer refer to each other without erasing the type), and none among its packages (``runtime`` and
  ``pipeline`` may not import each other even through different modules);
- lower layers never import upper ones;
- no re-export shims (a module listing in ``__all__`` a name it imports from another autoshard module; the
  package root, the public API, and ``_torch_compat``, the one door to torch's private APIs, are the two
  facades), no private name imported across modules, no ``Any`` alias standing for a type;
- modules read in one sitting: at most ``CODE_LINES`` lines of code, docstrings, comments and blank lines not
  counted, so that the limit never argues against explaining.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"autoshard": ROOT / "autoshard"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> list[str]:
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
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


def _package(module: str) -> str:
    """The unit of the package-level graph: a subpackage (``autoshard.runtime``) or a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_no_import_cycles_between_packages() -> None:
    g = nx.DiGraph()
    for a, b in import_graph().edges:
        if _package(a) != _package(b) and "autoshard" not in (_package(a), _package(b)):
            g.add_edge(_package(a), _package(b))
    assert g.number_of_edges() > 30
    cycles = [" -> ".join(c + [c[0]]) for c in nx.simple_cycles(g)]
    assert not cycles, "package import cycles:\n" + "\n".join(sorted(cycles, key=len)[:10])


FACADES = ("autoshard", "autoshard._torch_compat")  # the public API; the one door to torch's private APIs


def _imported_names(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Local name -> (autoshard module, imported name), for every ``from autoshard... import`` in the module."""
    return {
        a.asname or a.name: (node.module, a.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autoshard")
        for a in node.names
    }


def _all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def test_no_reexport_shims() -> None:
    """A name is imported from the module that defines it: no module passes on another's names."""
    bad = []
    for name, path in _modules().items():
        if name in FACADES:
            continue
        tree = ast.parse(path.read_text())
        imported = _imported_names(tree)
        bad += [f"{name}: __all__ lists {n}, imported from {imported[n][0]}" for n in _all(tree) if n in imported]
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        if body and all(isinstance(n, (ast.Import, ast.ImportFrom)) or "__all__" in ast.unparse(n) for n in body):
            bad.append(f"{name}: only imports (a shim)")
    assert not bad, "re-exports:\n" + "\n".join(bad)


def test_no_private_names_across_modules() -> None:
    bad = [
        f"{name}: {n} from {mod}"
        for name, path in _modules().items()
        for _, (mod, n) in _imported_names(ast.parse(path.read_text())).items()
        if n.startswith("_") and not n.startswith("__") and n != "_torch_compat" and mod != name
    ]
    assert not bad, "private names imported from another module (make them public or move them):\n" + "\n".join(bad)


def test_no_any_aliases() -> None:
    """``Plan = Any`` erases a type: an annotation names the type (under ``TYPE_CHECKING`` if need be)."""
    bad = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _modules().values()
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Name) and node.value.id == "Any"
    ]
    assert not bad, "module-level aliases of Any:\n" + "\n".join(bad)


# a parameter named for one of the project's types is annotated with that type, never ``Any``: the reader goes by
# the name, and the runtime's program is typed by the protocols it owns (``autoshard/runtime/program.py``)
PROJECT_TYPES = {
    "plan": "Plan",
    "program": "Program",
    "planned": "Planned",
    "solution": "Solution",
    "cluster": "ClusterProfile",
    "config": "PlanConfig",
    "ctx": "PassContext",
    "req": "PlanRequest",
}


def _any_for_project_types(tree: ast.Module, path: str) -> list[str]:
    bad = []

    def visit(node: ast.AST, autograd: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, any("Function" in ast.unparse(b) for b in child.bases))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args.posonlyargs + child.args.args + child.args.kwonlyargs
                for a in args:
                    if a.arg not in PROJECT_TYPES or a.annotation is None:
                        continue
                    if (a.arg == "ctx" and autograd) or (a.arg == "config" and "/models/" in path):
                        continue  # (autograd's context; a Hugging Face model's config)
                    if "Any" in ast.unparse(a.annotation).replace("|", " ").split():
                        bad.append(f"{path}:{child.lineno} {child.name}({a.arg}: {ast.unparse(a.annotation)})")
                if child.name in PROJECT_TYPES and child.returns is not None and ast.unparse(child.returns) == "Any":
                    bad.append(f"{path}:{child.lineno} {child.name}() -> Any")
                visit(child, False)

    visit(tree, False)
    return bad


def test_project_types_are_not_any() -> None:
    bad = [
        b
        for name, path in _modules().items()
        for b in _any_for_project_types(ast.parse(path.read_text()), str(path.relative_to(ROOT)))
    ]
    assert not bad, "project types annotated Any (name the type; under TYPE_CHECKING if need be):\n" + "\n".join(bad)
    probe = ast.parse("def f(plan: Any, program: Any | None = None) -> None: ...")
    assert len(_any_for_project_types(probe, "x.py")) == 2  # (the check sees what it is for)


# At most this many lines of code per file: beyond it, in this code base, a module has been doing two jobs.
# Docstrings, comments and blank lines are not counted: the limit never argues against explaining. Lines as ruff
# format writes them (a call that does not fit in one line takes one line per argument): 350 lines before the
# code was formatted, whose 29,500 lines of code became 34,500.
CODE_LINES = 400


def code_lines(text: str) -> int:
    """Lines holding code: not blank, not a comment, not inside a module's, class's or function's docstring."""
    tree = ast.parse(text)
    doc: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                doc.update(range(first.lineno, first.end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    return len(
        {
            line
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type not in skip
            for line in range(tok.start[0], tok.end[0] + 1)
            if line not in doc
        }
    )


def test_code_lines_counts_code_only() -> None:
    text = '"""Doc.\n\nMore."""\n\n# a comment\nx = 1\n\n\ndef f(a):\n    """Doc."""\n    return (a +\n            1)\n'
    assert code_lines(text) == 4  # x = 1, def, and the two lines of the return


def test_every_file_reads_in_one_sitting() -> None:
    files = [
        *(ROOT / "autoshard").rglob("*.py"),
        *(p for d in ("benchmarks", "tests") for p in (ROOT / d).rglob("*.py")),
    ]
    assert len(files) > 100
    long = {str(p.relative_to(ROOT)): n for p in files if (n := code_lines(p.read_text())) > CODE_LINES}
    assert not long, f"files over {CODE_LINES} lines of code: {long}"


# lower layers never call up: the runtime runs a program and imports no pass; the solver, the cost model, the op
# rules, the shared IR and where weights come from (weights/) know nothing of the passes, the searches, pipelines
# or the runtime
_ABOVE_RUNTIME = ("autoshard.compiler", "autoshard.search", "autoshard.api", "autoshard.dispatch", "autoshard.pipeline")
_ABOVE_SOLVER = (*_ABOVE_RUNTIME, "autoshard.runtime")
_ABOVE_COST = (*_ABOVE_SOLVER, "autoshard.solver")
LAYERS = {
    "autoshard.runtime": (*_ABOVE_RUNTIME, "autoshard.solver"),
    "autoshard.solver": _ABOVE_SOLVER,
    "autoshard.cost": _ABOVE_COST,
    "autoshard.rules": _ABOVE_COST,
    "autoshard.weights": _ABOVE_COST,
    "autoshard.ir": _ABOVE_COST,
}


def test_no_up_calls() -> None:
    g = import_graph()
    bad = [
        f"{a} -> {b}"
        for a, b in g.edges
        for low, banned in LAYERS.items()
        if (a == low or a.startswith(low + ".")) and any(b == x or b.startswith(x + ".") for x in banned)
    ]
    assert not bad, "imports from a lower layer up:\n" + "\n".join(sorted(bad))


def test_bad_input_errors_share_the_base_class() -> None:
    """Bad input is an ``autoshard.InputError`` (a ValueError and an ``AutoshardError``), a call that does not match
    the traced program an ``autoshard.CallError`` (a TypeError), never a bare ValueError or TypeError; the public
    error types are exported at the top level."""
    import autoshard
    from autoshard.errors import AutoshardError

    bare = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name)
        and node.exc.func.id in ("ValueError", "TypeError")
    ]
    assert not bare, (
        "raise InputError or CallError (autoshard.errors) instead of ValueError or TypeError at:\n" + "\n".join(bare)
    )
    runtime = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _modules().values()
        if "_torch_compat" not in path.parts
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name)
        and node.exc.func.id == "RuntimeError"
    ]
    assert not runtime, (
        "raise UsageError, InternalError, LaunchError or RankFailed (autoshard.errors) instead of a "
        "bare RuntimeError at:\n" + "\n".join(runtime)
    )
    for name in (
        "InputError",
        "CallError",
        "InfeasibleBudget",
        "SolverTimeout",
        "DataDependentError",
        "LaunchError",
        "UsageError",
        "InternalError",
    ):
        assert issubclass(getattr(autoshard, name), AutoshardError), name
    assert issubclass(autoshard.InputError, ValueError) and issubclass(autoshard.InfeasibleBudget, ValueError)
    assert issubclass(autoshard.CallError, TypeError)
    assert issubclass(autoshard.SolverTimeout, RuntimeError) and issubclass(autoshard.LaunchError, RuntimeError)


# a path the docs name is a file of this repository (another project's path is named with its project just before)
DOC_PATH = re.compile(
    r"(?<![\w/.-])((?:autoshard|tests|benchmarks|examples|docs)/[\w./*-]*\w\.(?:py|md|json|toml|png|svg|html|sh))"
)
DOC_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
OTHER_PROJECT = re.compile(r"(torchtitan|pytorch/|Megatron|autoparallel|Alpa)[^.\n]{0,30}$")


def missing_doc_paths(doc: Path, text: str) -> list[str]:
    out = []
    for m in DOC_PATH.finditer(text):
        path = m.group(1)
        if OTHER_PROJECT.search(text[max(0, m.start() - 40) : m.start()]):
            continue
        found = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        if not found:
            out.append(f"{doc.relative_to(ROOT)}: {path}")
    for m in DOC_LINK.finditer(text):
        link = m.group(1)
        if not link.startswith(("http:", "https:", "mailto:")) and not (doc.parent / link).exists():
            out.append(f"{doc.relative_to(ROOT)}: link {link}")
    return out


def test_paths_named_in_the_docs_exist() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(docs) > 10
    bad = [b for doc in docs for b in missing_doc_paths(doc, doc.read_text())]
    assert not bad, "paths the docs name that are not in the repository:\n" + "\n".join(bad)
    assert missing_doc_paths(ROOT / "README.md", "see `autoshard/no_such.py` and [x](no/such.md)")  # (it sees them)


def docs_commands(text: str) -> list[str]:
    """The ``autoshard ...`` command lines of a doc's code (indented blocks and fenced shell), continuation lines
    joined, comments and ``[optional]`` parts dropped."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        if not s.startswith("autoshard ") or not (line.startswith("    ") or line.startswith("$")):
            continue
        while s.endswith("\\") and i + 1 < len(lines):
            i += 1
            s = s[:-1] + " " + lines[i].strip()
        s = re.sub(r"\s+#.*$", "", s)
        out.append(re.sub(r"\[[^\]]*\]", "", s).strip())
    return out


def test_every_docs_command_parses() -> None:
    """Each ``autoshard`` command the README and docs show is one the CLI takes (its flags and values parse), so a
    renamed or dropped flag cannot linger in the docs; the checker catches a bad one."""
    import shlex

    from autoshard.cli import build_parser

    def refused(command: str) -> bool:
        try:
            build_parser().parse_args(shlex.split(command)[1:])
        except SystemExit:
            return True
        return False

    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    commands = [(d.relative_to(ROOT), c) for d in docs for c in docs_commands(d.read_text())]
    assert len(commands) >= 10
    bad = [f"{d}: {c}" for d, c in commands if refused(c)]
    assert not bad, "commands in the docs the CLI refuses:\n" + "\n".join(bad)
    assert refused("autoshard plan --model llama3-8b --no-such-flag")


def test_every_image_in_the_docs_is_made_by_docs_regen() -> None:
    """Each picture under docs/img has its entry in ``docs/regen.py: IMAGES`` (the command it shows), and each
    entry's picture exists: a screenshot nobody can remake does not stay."""
    tree = ast.parse((ROOT / "docs" / "regen.py").read_text())
    made = {
        n.args[0].value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Image" and isinstance(n.args[0], ast.Constant)
    }
    have = {p.name for p in (ROOT / "docs" / "img").iterdir()}
    assert have == made, f"in docs/img but not made by docs/regen.py: {have - made}; made but missing: {made - have}"


def test_every_command_output_in_the_docs_is_made_by_docs_regen() -> None:
    """Each command output the docs print between ``<!--out:key-->`` markers is filled, and made by an entry of
    ``docs/regen.py: OUTPUTS`` (its command shown in the same doc); each entry has its place in a doc."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_regen", ROOT / "docs" / "regen.py")
    regen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = regen  # (its dataclasses look their module up)
    spec.loader.exec_module(regen)
    entries = {o.key: o for o in regen.OUTPUTS}
    placed = {}
    for rel in regen.DOCS:
        text = (ROOT / rel).read_text()
        for key, body in regen.BLOCK.findall(text):
            placed[key] = rel
            assert key in entries, f"{rel}: output block {key!r} has no entry in docs/regen.py: OUTPUTS"
            assert "```" in body and "by docs/regen.py" in body, f"{rel}: output block {key!r} is empty"
            assert entries[key].command.split(" --offload")[0] in text, f"{rel}: {key!r}: its command is not shown"
    assert set(entries) == set(placed), f"OUTPUTS with no place in the docs: {set(entries) - set(placed)}"
    assert not [
        p
        for p in (ROOT / "docs").rglob("*.md")
        if "<!--out:" in p.read_text() and str(p.relative_to(ROOT)) not in regen.DOCS
    ], "a doc with output blocks is not in docs/regen.py: DOCS"
