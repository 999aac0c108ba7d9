"""``ddl-perf --help`` and every subcommand's ``--help`` read as plain text: what the parser
prints carries none of the docstrings' reStructuredText (literal quotes, roles, ``::``)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddl.perf import cli

MARKUP = re.compile(r"``|`|::$|:(func|class|meth|mod|attr|data|ref|doc):", re.MULTILINE)
SUBCOMMANDS = next(a.choices for a in cli.build_parser()._actions
                   if isinstance(a, argparse._SubParsersAction))


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return out.getvalue()


def _markup(text: str) -> list[str]:
    return [line for line in text.splitlines() if MARKUP.search(line)]


@pytest.mark.parametrize("cmd", ["", *SUBCOMMANDS])
def test_help_is_plain_text(cmd):
    text = _help([cmd] if cmd else [])
    assert text.startswith("usage: ddl-perf") and _markup(text) == []


def test_the_installed_command_prints_the_same_plain_help():
    ddl_perf = Path(sys.executable).parent / "ddl-perf"
    argv = [str(ddl_perf)] if ddl_perf.exists() else [sys.executable, "-m", "ddl.perf.cli"]
    res = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "measure collectives" in res.stdout
    assert _markup(res.stdout) == []


def test_plain_drops_roles_literals_and_block_colons_keeping_the_words():
    doc = "``ddl-perf train`` calls :func:`ddl.allreduce` on `x`, alone::\n\n    cmd"
    assert cli.plain(doc) == "ddl-perf train calls ddl.allreduce on x, alone:\n\n    cmd"
