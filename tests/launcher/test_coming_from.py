"""The doc's "Coming from" table (docs/launcher.md), row by row: each tool's form, with
``ddlrun`` for the tool's name, plans exactly what ddlrun's own form plans (``--dry-run``),
and a ``rejected`` form fails in one line naming ddlrun's way. Then the habits that only a
real run proves: torchrun's ``-m``/``--no-python`` and the program checked before any rank
starts."""

import re
import shlex
import subprocess
import sys

import pytest
from ddlrun_testlib import REPO, run_ddlrun

DOC = REPO / "docs" / "launcher.md"
HEADING = "## Coming from torchrun / horovodrun / mpirun / DeepSpeed / IBM ddlrun"
TOOLS = {"torchrun", "horovodrun", "mpirun", "DeepSpeed", "IBM ddlrun"}


def table_rows() -> list[tuple[str, str, str, str]]:
    """(tool, their form, ddlrun's form, note) for each row of the table."""
    section = DOC.read_text().split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`") and cells[2].startswith("`"):
            rows.append((cells[0], cells[1].strip("`"), cells[2].strip("`"), cells[3]))
    return rows


ROWS = table_rows()


def test_the_table_covers_every_tool_and_habit():
    assert {tool for tool, *_ in ROWS} == TOOLS
    words = {w for _, theirs, _, _ in ROWS for w in shlex.split(theirs)}
    for habit in ("-m", "--module", "--no-python", "--max-restarts",  # torchrun
                  "--gloo", "--mpi", "-p",  # horovodrun
                  "-npernode", "--npernode", "-N", "--bind-to", "--map-by", "-x",  # mpirun
                  "--oversubscribe", "--num_gpus", "--include", "--exclude",  # DeepSpeed
                  "-mode", "--racks", "--ddloption", "--no_ddloptions"):  # IBM ddlrun
        assert habit in words, habit


def dry(words: list[str], cwd) -> subprocess.CompletedProcess:
    if not any(w.split("=")[0] in ("--job-id", "--rdzv-id") for w in words):
        words = ["--job-id", "docjob", *words]
    return run_ddlrun("--dry-run", *words, cwd=cwd)


def normal(out: str) -> str:
    out = re.sub(r"MASTER_PORT=\d+", "MASTER_PORT=N", out)  # a free port, picked per run
    return out.replace(sys.executable, "python")


@pytest.mark.parametrize("tool,theirs,ours,note", ROWS, ids=[r[1] for r in ROWS])
def test_coming_from_table_row(tool, theirs, ours, note, tmp_path):
    (tmp_path / "hosts").write_text("h1 slots=4\nh2 slots=4\n")
    their_words, our_words = shlex.split(theirs)[1:], shlex.split(ours)
    assert our_words[0] == "ddlrun"
    mine = dry(our_words[1:], tmp_path)
    assert mine.returncode == 0, mine.stderr
    got = dry(their_words, tmp_path)
    if note.startswith("rejected"):
        assert got.returncode == 2
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and "ddlrun" in lines[0], got.stderr
        return
    assert got.returncode == 0, got.stderr
    assert normal(got.stdout) == normal(mine.stdout)
    assert "job docjob" in got.stdout or "job exp1" in got.stdout


# ---------------------------------------------------------------------------- real runs
def test_module_runs_as_python_dash_m_on_every_rank(tmp_path):
    pkg = tmp_path / "h6pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("import os, sys\nprint(os.environ['RANK'], sys.argv[1:])\n")
    res = run_ddlrun("--nproc-per-node", "2", "--no-tag-output", "-m", "h6pkg.train",
                     "--epochs", "3", "-n", "1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["0 ['--epochs', '3', '-n', '1']",
                                               "1 ['--epochs', '3', '-n', '1']"]


def test_no_python_runs_the_program_as_it_is(tmp_path):
    script = tmp_path / "tool.py"  # a .py that python could not run: only --no-python can
    script.write_text("#!/bin/sh\necho shell $RANK\n")
    script.chmod(0o755)
    res = run_ddlrun("-n", "2", "--no-tag-output", "--no-python", str(script), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split("\n")[:2]) == ["shell 0", "shell 1"]
    res = run_ddlrun("-n", "2", "--no-python", "-m", "json.tool", "x")
    assert res.returncode == 2 and "not both" in res.stderr


@pytest.mark.parametrize("program,code,says", [
    # the ranks' python is ddlrun's own: a bare "python" on PATH may be another one, which
    # the preflight refuses first (it cannot import ddl)
    ([sys.executable, "nosuch.py"], 2, "can't open file"),
    (["-m", "h6_no_such_module"], 2, "No module named h6_no_such_module"),
    ([sys.executable, "-u", "-m", "h6_no_such_module.sub"], 2,
     "No module named h6_no_such_module"),
    (["--no-python", "h6-no-such-program"], 127, "cannot start 'h6-no-such-program'"),
])
def test_a_missing_program_fails_in_one_line_before_any_rank(tmp_path, program, code, says):
    res = run_ddlrun("-n", "2", *program, cwd=tmp_path)
    assert res.returncode == code, res.stderr
    assert res.stdout == "" and res.stderr.count("\n") == 1 and says in res.stderr, res.stderr
    assert "[0]" not in res.stderr and "[1]" not in res.stderr  # no rank said anything


def test_an_unknown_single_dash_word_is_not_a_glued_short_option():
    for word in ("-npernodes", "-mode_x", "-np2x"):
        res = run_ddlrun(word, "2", "true")
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert f"unknown option {word}" in res.stderr
    ok = run_ddlrun("--dry-run", "-n2", "-xH6=1", "true")  # a value glued on still works
    assert ok.returncode == 0 and "2 ranks" in ok.stdout, ok.stderr
