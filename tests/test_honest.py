"""Every test can fail: a test function must assert, expect an exception or a warning, skip
or fail explicitly, or call a helper of the tests tree that does.

An AST pass over every ``test_*.py`` under tests/: a test is a ``def test_*`` (top level or
a method of a class). A function *checks* when its body has an ``assert`` that can fail (not
``assert 1``, ``assert x or True``), a ``raise``, a
call of ``pytest.raises/warns/fail/skip/xfail/exit`` or of an ``assert*`` function or method
(``np.testing.assert_array_equal``, ``self.assertEqual``, ``m.assert_called_once()``), or
calls by name, up to ``DEPTH`` calls deep, a function that checks, defined in the same module
or imported from a module of the tests tree (``from .util import run``,
``from ddlrun_testlib import wait_gone``, ``import tests.core.util as u``). Fixtures do not
count: an autouse fixture's assert would make every test look honest.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent
DEPTH = 4
PYTEST_CHECKS = frozenset({"raises", "warns", "fail", "skip", "xfail", "exit",
                           "deprecated_call"})
Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Module:
    path: Path
    functions: dict[str, Function] = field(default_factory=dict)
    names: dict[str, tuple[Path, str]] = field(default_factory=dict)  # imported functions
    modules: dict[str, Path] = field(default_factory=dict)  # imported tests modules


def _always_true(test: ast.expr) -> bool:
    """``assert 1``, ``assert "why"``, ``assert x or True``: true whatever the code does."""
    if isinstance(test, ast.Constant):
        return bool(test.value)
    return (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or)
            and any(_always_true(v) for v in test.values))


def _direct_check(node: ast.AST) -> bool:
    if isinstance(node, ast.Assert):
        return not _always_true(node.test)
    if isinstance(node, ast.Raise):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name.startswith("assert"):
            return True
        return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                and func.value.id == "pytest" and func.attr in PYTEST_CHECKS)
    return False


class Scanner:
    def __init__(self, tests: Path = TESTS):
        self.tests = tests.resolve()
        self.root = self.tests.parent
        self.cache: dict[Path, Module] = {}

    def _resolve(self, dotted: str, here: Path, level: int) -> Path | None:
        """The file of the tests tree an import names, or None (not ours)."""
        parts = [p for p in dotted.split(".") if p]
        if not parts:
            return None
        if level:
            bases = [here.parents[level - 1]]
        else:  # tests.core.util from the repository root; ddlrun_testlib from its folder
            bases = [self.root, here.parent, self.tests]
        for base in bases:
            cand = base.joinpath(*parts)
            for path in (cand.with_suffix(".py"), cand / "__init__.py"):
                if path.is_file() and self.tests in path.resolve().parents:
                    return path.resolve()
        return None

    def load(self, path: Path) -> Module:
        path = path.resolve()
        if path in self.cache:
            return self.cache[path]
        mod = self.cache[path] = Module(path)
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, Function):
                mod.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, Function):
                        mod.functions.setdefault(f"{node.name}.{sub.name}", sub)
            elif isinstance(node, ast.ImportFrom):
                src = self._resolve(node.module or "", path, node.level)
                for alias in node.names:
                    local = alias.asname or alias.name
                    sub = self._resolve(f"{node.module or ''}.{alias.name}", path, node.level)
                    if sub is not None:  # from . import util
                        mod.modules[local] = sub
                    elif src is not None:
                        mod.names[local] = (src, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    src = self._resolve(alias.name, path, 0)
                    if src is not None and alias.asname:
                        mod.modules[alias.asname] = src
        return mod

    def _callees(self, mod: Module, fn: Function) -> list[tuple[Module, str]]:
        out = []
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name):
                if func.id in mod.functions:
                    out.append((mod, func.id))
                elif func.id in mod.names:
                    src, name = mod.names[func.id]
                    out.append((self.load(src), name))
            elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                  and func.value.id in mod.modules):
                out.append((self.load(mod.modules[func.value.id]), func.attr))
        return out

    def checks(self, mod: Module, fn: Function, depth: int = DEPTH,
               seen: set | None = None) -> bool:
        if any(_direct_check(node) for node in ast.walk(fn)):
            return True
        seen = set() if seen is None else seen
        for callee_mod, name in self._callees(mod, fn) if depth else ():
            if (callee_mod.path, name) in seen or name not in callee_mod.functions:
                continue
            seen.add((callee_mod.path, name))
            if self.checks(callee_mod, callee_mod.functions[name], depth - 1, seen):
                return True
        return False

    def offenders(self) -> list[str]:
        found = []
        for path in sorted(self.tests.rglob("test_*.py")):
            mod = self.load(path)
            for qual, fn in mod.functions.items():
                if fn.name.startswith("test") and not self.checks(mod, fn):
                    found.append(f"{path.relative_to(self.root)}:{fn.lineno}: {qual} "
                                 "checks nothing")
        return found


def test_every_test_function_can_fail():
    bad = Scanner().offenders()
    for line in bad:
        print(line)
    assert not bad, ("tests that pass whatever the code does (no assert, pytest.raises/warns/"
                     "skip/fail, nor a helper that checks):\n" + "\n".join(bad))


def test_the_check_tells_honest_tests_from_hollow_ones(tmp_path):
    tests = tmp_path / "tests"
    (tests / "sub").mkdir(parents=True)
    (tests / "sub" / "__init__.py").write_text("")
    (tests / "sub" / "util.py").write_text(
        "def check(x):\n    assert x\n\ndef deeper(x):\n    check(x)\n\n"
        "def quiet(x):\n    return x\n")
    (tests / "sub" / "test_x.py").write_text(
        "import pytest\n"
        "import numpy as np\n"
        "from .util import deeper, quiet\n"
        "from . import util\n"
        "def _mine(x):\n    deeper(x)\n"
        "def test_assert():\n    assert len('a') == 1\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
        "def test_skip():\n    pytest.skip('why')\n"
        "def test_helper_chain():\n    _mine(1)\n"
        "def test_module_alias():\n    util.check(1)\n"
        "def test_np():\n    np.testing.assert_array_equal(1, 1)\n"
        "def test_hollow():\n    quiet(1)\n"
        "def test_empty():\n    pass\n"
        "def test_alias_hollow():\n    util.quiet(1)\n"
        "def test_always_true():\n    assert quiet(1) or True\n    assert 'why'\n"
        "class TestK:\n    def test_m(self):\n        self.assertEqual(1, 1)\n"
        "    def test_n(self):\n        print(1)\n")
    bad = Scanner(tests).offenders()
    assert bad == [f"tests/sub/test_x.py:{n}: {q} checks nothing"
                   for n, q in [(20, "test_hollow"), (22, "test_empty"),
                                (24, "test_alias_hollow"), (26, "test_always_true"),
                                (32, "TestK.test_n")]]
