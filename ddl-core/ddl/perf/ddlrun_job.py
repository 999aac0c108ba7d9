"""ddl-perf's own jobs (``allreduce --ranks``, ``scale``) as ddlrun subprocesses, their
output streamed line by line as rank 0 prints it.

ddlrun gets the deadline itself (``--timeout``), so a job that overruns is taken down by
ddlrun's own teardown (SIGTERM to every rank, grace, SIGKILL, its shared memory removed)
and ddlrun names the ranks still running. A ddlrun that does not end by then either (it is
stuck itself) gets SIGTERM, then SIGKILL: reading the job's output never outlives the
deadline, even when the job prints nothing.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

TIMEOUT_EXIT = 124  # ddlrun's exit code when --timeout ran out
# How long after its own deadline ddlrun may take to tear the job down (its grace is 5 s)
# before it counts as stuck.
_TEARDOWN_S = 30.0
_KILL_AFTER_S = 10.0


def ddlrun_argv(ranks: int, program: Sequence[str], timeout: float,
                ddlrun_args: Sequence[str] = ()) -> list[str]:
    """``python -m ddlrun -n N --timeout T ... python -m ddl.perf.cli PROGRAM...`` as argv
    (never a shell line)."""
    return [sys.executable, "-m", "ddlrun", "-n", str(ranks), "--no-tag-output",
            "--timeout", f"{timeout:g}", *ddlrun_args,
            sys.executable, "-m", "ddl.perf.cli", *program]


def stream(argv: Sequence[str], timeout: float, on_line: Callable[[str], None], *,
           merge_stderr: bool = False, start: Callable[..., Any] = subprocess.Popen,
           teardown: float = _TEARDOWN_S, kill_after: float = _KILL_AFTER_S) -> int:
    """Run ``argv`` (a ddlrun command made by :func:`ddlrun_argv`), calling ``on_line`` for
    every line it prints; its exit code, or TIMEOUT_EXIT when it had to be stopped from here
    (SIGTERM ``teardown`` seconds after ``timeout``, SIGKILL ``kill_after`` seconds later).
    ``start``: the process starter (a seam for tests)."""
    stopped = threading.Event()
    with start(argv, stdout=subprocess.PIPE,
               stderr=subprocess.STDOUT if merge_stderr else None, text=True,
               bufsize=1) as proc:

        def stop(sig_kill: bool) -> None:
            if proc.poll() is None:
                stopped.set()
                proc.kill() if sig_kill else proc.terminate()

        term = threading.Timer(timeout + teardown, stop, (False,))
        kill = threading.Timer(timeout + teardown + kill_after, stop, (True,))
        for t in (term, kill):
            t.daemon = True
            t.start()
        try:
            for line in proc.stdout:
                on_line(line)
            code = proc.wait()
        finally:
            term.cancel()
            kill.cancel()
    return TIMEOUT_EXIT if stopped.is_set() else code
