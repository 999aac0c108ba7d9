"""What a user sees when a collective fails: a traceback with at most two of ddl's frames
(the call into ddl, the line that raised), no internal exception chain, the message that
says what happened; the whole chain with ``DDL_DEBUG=1``. Real 2-rank jobs through ddlrun
(a mismatch, a peer that dies, a timeout; the core and the Horovod layer), and the
cutting itself in this process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from doc_blocks import normalized, shown_after

from ddl import failures
from ddl.errors import DDLMismatchError

DDL_FRAME = re.compile(r'^(?:\[\d\] )?  File "[^"]*/ddl/[^"]*\.py", line \d+')

PROGRAMS = {
    "mismatch": """
        import numpy as np
        import ddl
        ddl.init()
        ddl.allreduce(np.ones(3 if ddl.rank() == 0 else 4, np.float32))  # THE CALL
    """,
    "named_mismatch": """
        import torch
        import ddl.torch as hvd
        hvd.init()
        hvd.allreduce(torch.ones(3 if hvd.rank() == 0 else 4), name="x")  # THE CALL
    """,
    "peer_lost": """
        import numpy as np
        import ddl
        ddl.init()
        ddl.allreduce(np.ones(4, np.float32))
        if ddl.rank() == 1:
            raise ValueError("boom on rank 1")  # THE CALL
        ddl.allreduce(np.ones(4, np.float32))
    """,
    "timeout": """
        import time
        import numpy as np
        import ddl
        ddl.init()
        if ddl.rank() == 1:
            time.sleep(30)
        ddl.allreduce(np.ones(5, np.float32))  # THE CALL
    """,
}


def run_job(tmp_path: Path, case: str, **env: str) -> tuple[str, str, int]:
    """(the job's output, the program's path, the line marked THE CALL)."""
    program = tmp_path / f"{case}.py"
    program.write_text(textwrap.dedent(PROGRAMS[case]).lstrip())
    line = next(i for i, t in enumerate(program.read_text().splitlines(), 1) if "THE CALL" in t)
    cmd = [sys.executable, "-m", "ddlrun", "-n", "2", "-x", "DDL_TIMEOUT=3"]
    for k, v in env.items():
        cmd += ["-x", f"{k}={v}"]
    out = subprocess.run(cmd + [sys.executable, str(program)], capture_output=True,
                         text=True, timeout=180, env=dict(os.environ, DDL_TIMEOUT="3"))
    assert out.returncode != 0, out.stdout + out.stderr
    return out.stdout + out.stderr, str(program), line


def tracebacks(output: str) -> dict[str, list[str]]:
    """Each rank's printed traceback lines (``[r] `` prefixed lines from "Traceback" on)."""
    found: dict[str, list[str]] = {}
    for text in output.splitlines():
        m = re.match(r"^\[(\d)\] (.*)$", text)
        if not m:
            continue
        rank, body = m.groups()
        if body.startswith("Traceback (most recent call last)"):
            found[rank] = []
        if rank in found:
            found[rank].append(text)
    return found


@pytest.mark.parametrize("case", sorted(PROGRAMS))
def test_a_failed_collective_shows_two_frames_of_ddl_and_the_users_line(tmp_path, case):
    output, program, line = run_job(tmp_path, case)
    shown = tracebacks(output)
    assert shown, output
    for rank, lines in shown.items():
        ddl_frames = [t for t in lines if DDL_FRAME.match(t)]
        assert len(ddl_frames) <= 2, f"rank {rank}:\n" + "\n".join(lines)
        assert f'File "{program}", line ' in "\n".join(lines), "\n".join(lines)
    assert "During handling of the above exception" not in output, output
    assert "Unfolded" not in output and "Retry" not in output, output
    summary = [t for t in output.splitlines() if t.startswith("ddlrun:")]
    assert f"{program}:{line}" in "\n".join(summary), "\n".join(summary)


def test_ddl_debug_shows_the_whole_traceback(tmp_path):
    output, _, _ = run_job(tmp_path, "mismatch", DDL_DEBUG="1")
    frames = [t for lines in tracebacks(output).values() for t in lines if DDL_FRAME.match(t)]
    assert len(frames) > 4, output


# ------------------------------------------------------------------- in this process
def _deep(n: int):
    if n == 0:
        raise DDLMismatchError("rank 0: the message says it all")
    _deep(n - 1)


def _user_calls_ddl():
    # exec'd with a filename inside ddl's package: frames that count as ddl's own
    code = compile("def entry(fn, n):\n    fn(n)\n", os.path.join(
        os.path.dirname(failures.__file__), "fake_entry.py"), "exec")
    ns: dict = {}
    exec(code, ns)  # noqa: S102 - a frame with a filename of ddl's, for the test
    return ns["entry"]


def _ddls_deep():
    """A recursive function whose frames count as ddl's own (its file is in the package):
    ``deep(n)`` raises ValueError at line 3 after n calls of itself."""
    code = compile("def deep(n):\n    if n == 0:\n        raise ValueError('x')\n    "
                   "deep(n - 1)\n", os.path.join(os.path.dirname(failures.__file__),
                                                  "fake_deep.py"), "exec")
    ns: dict = {}
    exec(code, ns)  # noqa: S102 - frames with a filename of ddl's, for the test
    return ns["deep"]


def test_short_traceback_keeps_the_entry_and_the_raising_line_of_ddl():
    deep, entry = _ddls_deep(), _user_calls_ddl()
    try:
        entry(deep, 5)
    except ValueError as exc:
        before = [t.tb_frame.f_code.co_name for t in _entries(exc.__traceback__)]
        short = failures.short_traceback(exc.__traceback__)
    after = [t.tb_frame.f_code.co_name for t in _entries(short)]
    assert before == ["test_short_traceback_keeps_the_entry_and_the_raising_line_of_ddl",
                      "entry"] + ["deep"] * 6
    assert after == ["test_short_traceback_keeps_the_entry_and_the_raising_line_of_ddl",
                     "entry", "deep"]
    assert _entries(short)[-1].tb_lineno == 3  # the line that raised


def test_a_chain_of_ddls_internals_is_not_shown(monkeypatch):
    monkeypatch.delenv("DDL_DEBUG", raising=False)
    import numpy as np

    from ddl.engines.shm_meta import Unfolded

    try:
        try:
            raise Unfolded(np.zeros(1))
        except Unfolded:
            raise DDLMismatchError("rank 0: different calls") from None
    except DDLMismatchError as exc:
        caught = exc
    caught.__suppress_context__ = False  # as raised inside the handler without "from None"
    caught.__context__ = Unfolded(np.zeros(1))
    failures.for_user(caught)
    assert caught.__suppress_context__
    user = RuntimeError("mine")
    user.__cause__ = caught  # a program's own error raised from ddl's: the chain stays
    failures.for_user(user)
    assert user.__cause__ is caught


def test_ddl_debug_leaves_the_exception_as_it_was(monkeypatch):
    monkeypatch.setenv("DDL_DEBUG", "1")
    exc = DDLMismatchError("x")
    exc.__context__ = KeyError("k")
    failures.for_user(exc)
    assert not exc.__suppress_context__


def _entries(tb):
    out = []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def test_troubleshooting_shows_what_a_mismatch_prints(tmp_path):
    shown = shown_after("kept true by tests/core/test_short_tracebacks.py")
    program = tmp_path / "train.py"
    program.write_text("import numpy as np\nimport ddl\n\nddl.init()\n"
                       "n = 3 if ddl.rank() == 0 else 4\nddl.allreduce(np.ones(n, np.float32))\n")
    out = subprocess.run([sys.executable, "-m", "ddlrun", "-n", "2", sys.executable,
                          "train.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=180)
    summary = [t for t in (out.stdout + out.stderr).splitlines() if t.startswith("ddlrun:")]
    assert normalized(summary) == normalized(shown), "\n".join(summary)


def test_the_programs_own_callback_between_ddls_frames_stays():
    """ddl calling back into the program (a hook, a compressor) that calls ddl again: the
    program's frame in the middle stays, ddl's own between are cut."""
    deep, entry = _ddls_deep(), _user_calls_ddl()

    def callback(n):  # the program's own code, called by "ddl"
        entry(deep, n)

    try:
        entry(callback, 3)
    except ValueError as exc:
        short = failures.short_traceback(exc.__traceback__)
    names = [t.tb_frame.f_code.co_name for t in _entries(short)]
    assert names == ["test_the_programs_own_callback_between_ddls_frames_stays", "entry",
                     "callback", "deep"], names
