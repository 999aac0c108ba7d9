"""User docs stay in step with the code: every environment variable and public function is
documented (as a whole name, in code), and every ```python sample in README.md and docs/*.md
runs.

How a sample runs: one that imports ddl runs as 2 ranks, ``python -m ddlrun -n 2 python
sample.py``; any other as ``python sample.py``; each must exit 0. A sample preceded by an
HTML comment ``<!-- no-run: why -->`` is skipped with that reason (a fragment that uses
names it does not define). Samples that use torch or tensorflow are skipped where the
framework is not installed, and those on CUDA where fewer than 2 CUDA devices exist.
```sh blocks and unlabelled blocks are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import ddl
from ddl import config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run\s*:?\s*(?P<why>.*?)\s*-->\s*$")
SPAN = re.compile(r"`([^`\n]+)`")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    no_run: str | None  # the reason, when marked <!-- no-run -->

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent = i, m["indent"]
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path}:{start + 1}: code block never closed")
        prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        why = NO_RUN.match(prev)
        code = textwrap.dedent("\n".join(lines[start + 1 : i]))
        assert all(not ln.strip() or ln.startswith(indent) for ln in lines[start + 1 : i]), \
            f"{path}:{start + 1}: block less indented than its fence"
        blocks.append(Block(path, start + 1, m["lang"], code + "\n",
                            (why["why"] or "marked no-run") if why else None))
        i += 1
    return blocks


PYTHON_BLOCKS = [b for p in DOC_FILES for b in code_blocks(p) if b.lang == "python"]


def documented(name: str, spans: list[str], blocks: str) -> bool:
    """``name`` shown as code: ``ddl.name`` anywhere in code, or a span that is the name or
    starts with ``name(`` (the tables' ``allreduce_(t, op)``)."""
    word = re.compile(rf"(?<![\w.])ddl\.{re.escape(name)}(?!\w)")
    return (any(s == name or s.startswith(f"{name}(") or word.search(s) for s in spans)
            or bool(word.search(blocks)))


def test_every_environment_variable_is_documented():
    text = (DOCS / "tuning.md").read_text()
    missing = [row.name for row in config.describe() if f"`{row.name}`" not in text]
    assert not missing, f"add these to docs/tuning.md (ddl-perf env prints them): {missing}"


def test_every_public_function_is_in_the_api_doc():
    path = DOCS / "api.md"
    spans = SPAN.findall(path.read_text())
    blocks = "\n".join(b.code for b in code_blocks(path))
    public = [n for n in ddl.__all__ if callable(getattr(ddl, n)) and n[0].islower()]
    missing = [n for n in public if not documented(n, spans, blocks)]
    assert not missing, f"document in docs/api.md (as `ddl.{{name}}(...)`): {missing}"


def test_every_name_the_api_doc_shows_exists():
    """The converse: each ``ddl.name`` docs/api.md shows (in text or code) is a name of the
    ddl package, so a restructuring cannot drop one the page promises."""
    import importlib

    text = (DOCS / "api.md").read_text()
    shown = set(re.findall(r"(?<![\w.])ddl\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text))
    assert len(shown) > 20, shown
    missing = []
    for dotted in sorted(shown):
        obj, parts = ddl, dotted.split(".")
        for i, part in enumerate(parts):
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            try:  # a submodule not imported by ddl's __init__ (ddl.torch, ddl.engines.shm)
                obj = importlib.import_module("ddl." + ".".join(parts[: i + 1]))
            except ImportError:
                missing.append(dotted)
                break
    assert not missing, f"docs/api.md shows names ddl does not have: {missing}"


def test_names_are_matched_whole_not_as_substrings():
    spans = ["ddl.allreduce_(t)", "g.size", "ddl.initialize()", "broadcast_(t, root)", "poll"]
    assert documented("allreduce_", spans, "")
    assert documented("broadcast_", spans, "")
    assert documented("poll", spans, "")
    assert not documented("allreduce", spans, "")  # only allreduce_ is there
    assert not documented("size", spans, "")  # a group's attribute, not ddl.size
    assert not documented("init", spans, "ddl.init_x()\nmyddl.init()")
    assert documented("init", [], "ddl.init()\n")


def _needs(code: str) -> str | None:
    """Why this sample cannot run here, or None."""
    for mod in ("torch", "tensorflow"):
        if re.search(rf"^\s*(import|from)\s+{mod}\b", code, re.M) or f"import {mod}," in code:
            try:
                __import__(mod)
            except ImportError:
                return f"needs {mod}"
    if re.search(r"\bcuda\b", code):
        try:
            import torch
        except ImportError:
            return "needs torch with CUDA"
        if torch.cuda.device_count() < 2:
            return "needs 2 CUDA devices"
    return None


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where for b in PYTHON_BLOCKS])
def test_doc_sample_runs(block, tmp_path):
    if block.no_run:
        pytest.skip(f"{block.where}: {block.no_run}")
    if why := _needs(block.code):
        pytest.skip(f"{block.where}: {why}")
    script = tmp_path / "sample.py"
    script.write_text(block.code)
    argv = [sys.executable, str(script)]
    if re.search(r"^\s*(import|from)\s+ddl\b", block.code, re.M):
        argv = [sys.executable, "-m", "ddlrun", "-n", "2", "--timeout", "120", *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                         env=env)
    assert res.returncode == 0, f"{block.where} failed:\n{block.code}\n{res.stdout}{res.stderr}"


def test_samples_are_found_with_their_markers(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n\n```python\nprint(1)\n```\n<!-- no-run: a fragment -->\n\n"
                   "```python\nmodel()\n```\n- item:\n  ```python\n  x = 1\n  ```\n"
                   "```sh\nls\n```\n")
    got = [(b.line, b.lang, b.code, b.no_run) for b in code_blocks(doc)]
    assert got == [(3, "python", "print(1)\n", None), (8, "python", "model()\n", "a fragment"),
                   (12, "python", "x = 1\n", None), (15, "sh", "ls\n", None)]


MAP_ENTRY_INDENT = 24  # deeper lines of the map continue the entry above them
MAP_NAME = re.compile(r"(?<![\w/.])(?:[A-Za-z_]\w*\.py|__init__)\b")


def mapped_paths(text: str) -> set[str]:
    """Every module path the map (the first code block) names: a name counts under the
    folder heading (``engines/``) it is listed beneath, so ``shm.py`` under ``engines/``
    does not also stand for ``launcher/ddlrun/shm.py``; a name spelt with a folder
    (``hvd/fusion.py`` in a description) stands for nothing."""
    stack: list[tuple[int, str]] = []  # (indent, "folder/") of the open headings
    named, here = set(), ""
    for line in text.split("```", 2)[1].splitlines()[1:]:
        body = line.strip()
        if not body:
            continue
        indent, first = len(line) - len(line.lstrip()), body.split()[0]
        if indent < MAP_ENTRY_INDENT:
            stack = [(i, d) for i, d in stack if i < indent]
            if first.endswith("/"):
                stack.append((indent, first))
                named.add("".join(d for _, d in stack) + "__init__.py")
            here = "".join(d for _, d in stack)
        named |= {here + (n if n.endswith(".py") else "__init__.py")
                  for n in MAP_NAME.findall(body)}
    return named


def test_the_map_names_a_module_under_its_own_folder_only():
    text = ("```\nlib/\n  a.py  x\n  sub/  __init__ (y)\n    a.py b.py  z, not sub/c.py\n"
            "                        nor c.py (a continuation: still sub/)\n  d.py\n```\n")
    assert mapped_paths(text) == {"lib/__init__.py", "lib/a.py", "lib/sub/__init__.py",
                                  "lib/sub/a.py", "lib/sub/b.py", "lib/sub/c.py", "lib/d.py"}


def test_every_module_is_on_the_architecture_map():
    """docs/architecture.md names every module of the core and the launcher under its
    package's heading, so the map cannot silently fall behind (a second ``shm.py`` or
    ``mpi_ops.py`` is not covered by the first)."""
    named = mapped_paths((DOCS / "architecture.md").read_text())
    missing = [rel for base in ("ddl-core/ddl", "launcher/ddlrun")
               for path in sorted((ROOT / base).rglob("*.py"))
               if (rel := str(path.relative_to(ROOT))) not in named]
    assert not missing, f"modules missing from docs/architecture.md: {missing}"


def layer_blocks(text: str) -> list[list[frozenset[str]]]:
    """The code blocks of docs/architecture.md's "Layers" section, each a list of layers
    top to bottom; a layer is a set of modules. ``a.b.c | d | e`` abbreviates siblings of
    ``a.b.c``; text after two spaces is commentary."""
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in section.split("```")[1::2]:
        layers = []
        for line in block.splitlines()[1:]:
            body = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            if not body or not body.startswith(("ddl", "(")):
                continue
            if body.startswith("("):
                continue
            names = [n.strip() for n in body.split("|")]
            parent = names[0].rsplit(".", 1)[0]
            layers.append(frozenset(n if "." in n else f"{parent}.{n}" for n in names))
        blocks.append(layers)
    return blocks


def contract_layers() -> list[list[frozenset[str]]]:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [[frozenset(n.strip() for n in layer.split("|")) for layer in c["layers"]]
            for c in contracts["contracts"] if c["type"] == "layers"]


def test_the_layers_on_the_architecture_page_are_the_contracts():
    """Every layers contract in pyproject.toml is drawn on docs/architecture.md, layer by
    layer, and the page draws no layer the contracts do not hold."""
    drawn = layer_blocks((DOCS / "architecture.md").read_text())
    declared = contract_layers()
    assert len(declared) >= 3
    assert drawn == declared, f"drawn: {drawn}\ndeclared: {declared}"


def test_a_layer_drawn_wrong_is_found():
    page = ("\n## Layers\n\n```\nddl.a\nddl.b.c | d            note\n(aside)\nddl.e\n```\n"
            "\n## Next\n```\nddl.z\n```\n")
    assert layer_blocks(page) == [[frozenset({"ddl.a"}), frozenset({"ddl.b.c", "ddl.b.d"}),
                                   frozenset({"ddl.e"})]]


def test_every_test_folder_is_on_the_architecture_page():
    """The page's test map names every folder of tests/ that holds tests."""
    page = (DOCS / "architecture.md").read_text()
    folders = sorted({p.parent.relative_to(ROOT).as_posix() + "/"
                      for p in (ROOT / "tests").rglob("test_*.py")})
    missing = [f for f in folders if f not in page]
    assert not missing, f"test folders missing from docs/architecture.md: {missing}"


def test_every_function_the_architecture_page_names_exists():
    """Each ``file.py: name`` on docs/architecture.md (the path of one allreduce) is a real
    function or class of that module, so the page cannot point at code that moved."""
    import ast

    refs = re.findall(r"`([\w/]+\.py): ([\w.]+)`", (DOCS / "architecture.md").read_text())
    assert len(refs) >= 10, refs
    wrong = []
    for path, name in refs:
        tree = ast.parse((ROOT / "ddl-core" / "ddl" / path).read_text())
        scope: list[ast.stmt] = tree.body
        for part in name.split("."):
            found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                     and n.name == part]
            if not found:
                wrong.append(f"{path}: {name}")
                break
            scope = found[0].body
    assert not wrong, f"docs/architecture.md names what is not there: {wrong}"
