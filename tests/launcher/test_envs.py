"""The launcher's env registry (``ddlrun.envs``) is the one place its variable names are
written: no literal of a registered name elsewhere in the launcher or in ddl.perf.spawn,
every variable of the rank contract documented in docs/launcher.md, and the default mode
one value for ddlrun and the core."""

import ast
import re
from pathlib import Path

from ddlrun_testlib import REPO

from ddlrun import envs, plan

SOURCES = [*sorted((REPO / "launcher" / "ddlrun").rglob("*.py")),
           REPO / "ddl-core" / "ddl" / "perf" / "spawn.py"]


def literals(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every string constant or keyword argument that is a registered name
    (``"RANK"``, ``env.update(RANK=...)``)."""
    names = set(envs.registry())
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value in names:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.keyword) and node.arg in names:
            found.append((node.value.lineno, node.arg))
    return found


def test_no_registered_name_is_written_outside_the_registry():
    assert len(SOURCES) > 10
    stray = [f"{p.relative_to(REPO)}:{line}: {name}" for p in SOURCES
             if p.name != "envs.py" for line, name in literals(p)]
    assert stray == [], "use ddlrun.envs.NAME instead:\n" + "\n".join(stray)


def test_the_scan_finds_literals(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('env = {"RANK": "0"}\nenv.update(MASTER_PORT="1")\nx = "RANKS"\n')
    assert literals(probe) == [(1, "RANK"), (2, "MASTER_PORT")]


def test_every_rank_variable_is_documented():
    doc = (REPO / "docs" / "launcher.md").read_text()
    missing = [n for n in envs.of_kind("rank", "torchrun", "horovodrun", "option", "layout")
               if not re.search(rf"\b{n}\b", doc)]
    assert missing == []


def test_registry_entries_are_whole_and_secret_is_masked():
    reg = envs.registry()
    kinds = {"rank", "torchrun", "horovodrun", "option", "layout", "read"}
    assert all(v.name == k and v.doc and v.kind in kinds for k, v in reg.items())
    assert [n for n, v in reg.items() if v.secret] == [envs.DDL_JOB_SECRET]
    assert plan.masked(envs.DDL_JOB_SECRET, "hush") == f"{envs.DDL_JOB_SECRET}=<secret>"


def test_ddlrun_and_the_core_share_one_default_mode():
    from ddl import options

    assert plan.default_mode() is options.DEFAULT_MODE
    assert options.parse("").mode == options.DEFAULT_MODE
    assert options.Options().mode == options.DEFAULT_MODE
    req = plan.Request(("prog",), (plan.HostSpec("a", 2), plan.HostSpec("b", 2)))
    job = plan.make_plan(req, {}, "jmode", 29500, {})
    assert job.ddl_options == f"-mode {options.DEFAULT_MODE}:2x2"
