"""The layers (pyproject.toml's import-linter contracts: the core's, ddl-perf's, ddlrun's)
hold, imports inside functions included: the contracts are checked here so that CI fails
when one breaks. ddlrun and ddl (ddl.perf and the adapters too) also have no import cycle
at all, a module the contracts do not name included (``test_no_import_cycle``); deptry
checks the declared dependencies against the imports."""

import ast
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lint_imports() -> str:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.fail("lint-imports is missing: make install puts import-linter into .venv")
    return exe


def test_the_import_contracts_hold():
    out = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_a_broken_layer_is_reported(tmp_path):
    """The check can fail: a copy of the core whose timeline imports api breaks it."""
    src = os.path.join(ROOT, "ddl-core", "ddl")
    pkg = tmp_path / "ddl"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__", "perf", "torch",
                                                             "tensorflow", "keras", "hvd"))
    with open(pkg / "timeline.py", "a") as f:
        f.write("\n\ndef _upward():\n    from . import api  # noqa: F401\n")
    (tmp_path / "setup.cfg").write_text(
        "[importlinter]\nroot_package = ddl\n\n[importlinter:contract:1]\nname = layers\n"
        "type = layers\nlayers =\n    ddl.api\n    ddl.runtime\n    ddl.timeline\n")
    out = subprocess.run([_lint_imports(), "--no-cache", "--config", "setup.cfg"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode != 0, out.stdout
    assert "ddl.timeline is not allowed to import ddl.api" in out.stdout, out.stdout


# ------------------------------------------------------------------------ import cycles
def import_graph(root: str, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from every import statement in the file
    (inside functions and ``if TYPE_CHECKING`` too); a package's own ``__init__`` imported
    by its submodules is no edge (Python runs it first anyway)."""
    files = {}
    for folder, _, names in os.walk(os.path.join(root, package.replace(".", os.sep))):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                files[module.removesuffix(".__init__")] = path

    def targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            if not files[module].endswith("__init__.py"):
                parts = parts[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, base] if base else parts)
        return [base, *(f"{base}.{a.name}" for a in node.names)]

    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= {t for t in targets(module, node) if t in files
                                  and t != module and not module.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("root,package", [("launcher", "ddlrun"), ("ddl-core", "ddl")])
def test_no_import_cycle(root, package):
    graph = import_graph(os.path.join(ROOT, root), package)
    assert len(graph) > 5, graph  # the package was found
    assert cycles(graph) == []


def test_a_cycle_through_a_function_level_import_is_reported(tmp_path):
    """The check can fail: two modules that import each other, one of them at call time."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n\n\ndef f():\n    return g\n")
    (pkg / "b.py").write_text("def g():\n    from . import a\n    return a.f\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    assert cycles(import_graph(str(tmp_path), "pkg")) == [["pkg.a", "pkg.b"]]


# ------------------------------------------------------------------------ dependencies
def test_declared_dependencies_match_the_imports():
    """deptry ([tool.deptry] in pyproject.toml): no declared dependency unused, no import
    undeclared, no dev tool imported by the library."""
    exe = shutil.which("deptry", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.fail("deptry is missing: make install puts it into .venv (the dev extra)")
    out = subprocess.run([exe, ".", "--no-ansi"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def test_an_undeclared_import_is_reported(tmp_path):
    """The check can fail: a project that imports a module it does not declare."""
    exe = shutil.which("deptry", path=os.path.dirname(sys.executable))
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "0"\ndependencies = ["numpy"]\n')
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("import numpy\nimport rich\n")
    out = subprocess.run([exe, ".", "--no-ansi"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0
    assert "DEP003 'rich'" in out.stdout + out.stderr or "DEP001 'rich'" in out.stdout + out.stderr
