"""``ProcessSet`` starts children through ``pdeath.py`` on Linux (no ``preexec_fn``): the
program gets its environment and signal dispositions as given, the parent-death signal is
set, and a program that cannot start is reported with its exit as what ``Popen`` would
have raised."""

import os
import signal
import sys
import threading
import time

import pytest

from ddlrun.procs import ProcessSet, ProcSpec, Stopped, proc_state

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

PROBE = ("import ctypes, os, signal; c = ctypes.c_int(); "
         "ctypes.CDLL(None).prctl(2, ctypes.byref(c)); "  # PR_GET_PDEATHSIG
         "print(c.value, os.getppid(), flush=True)")


def run(env, argv=(sys.executable, "-c", PROBE)):
    lines, done = [], threading.Event()
    procs = ProcessSet(lambda key, stream, line: lines.append(line.rstrip("\n")),
                       lambda exit_: done.set())
    try:
        procs.start([ProcSpec(0, tuple(argv), env)])
        assert done.wait(30)
        assert procs.wait_output(0, 10)
        return lines, procs.procs[0]
    finally:
        procs.close(timeout=5)


@pytest.mark.parametrize("lc_ctype", [None, "C", ""])
def test_child_has_its_lc_ctype_as_given(lc_ctype):
    """Not the one Python's C-locale coercion puts into the wrapper's environment."""
    env = {"PATH": os.environ.get("PATH", ""), "LC_ALL": ""}
    if lc_ctype is not None:
        env["LC_CTYPE"] = lc_ctype
    lines, _ = run(env, ("sh", "-c", 'echo "${LC_CTYPE-unset}"'))
    assert lines == ["unset" if lc_ctype is None else lc_ctype]


def test_child_has_the_parent_death_signal_and_is_our_child():
    lines, _ = run({"PATH": os.environ.get("PATH", "")})
    sig, ppid = lines[0].split(" ")
    assert int(sig) == signal.SIGKILL and int(ppid) == os.getpid()


def test_child_does_not_inherit_pythons_ignored_signals():
    lines, _ = run({"PATH": os.environ.get("PATH", "")}, ("cat", "/proc/self/status"))
    ignored = int(next(v for v in lines if v.startswith("SigIgn:")).split()[1], 16)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        assert not ignored & (1 << (sig - 1)), f"{sig.name} is ignored in the child"


def test_a_missing_program_is_reported_with_its_exit_as_popen_would_raise_it():
    exits, done = [], threading.Event()
    procs = ProcessSet(lambda *a: None, lambda e: (exits.append(e), done.set()))
    try:
        procs.start([ProcSpec(0, ("/nonexistent/prog",), {"PATH": "/usr/bin"})])
        assert done.wait(30)
    finally:
        procs.close(timeout=1)
    [ex] = exits
    assert isinstance(ex.error, FileNotFoundError) and ex.code == 127
    assert ex.error.filename == "/nonexistent/prog"


def test_a_child_stopped_before_its_exec_is_stuck_starting_and_closed():
    """Nothing waits on a wrapper that never execs: ``stuck`` says it is starting, and
    ``close`` ends it. (Stopped the moment ``start`` returns: the wrapper's interpreter is
    still starting then, almost always; a later stop finds ``sleep`` stopped instead.)"""
    procs = ProcessSet(lambda *a: None, lambda e: None)
    try:
        procs.start([ProcSpec(0, ("sleep", "30"), {"PATH": os.environ.get("PATH", "")})])
        pid = procs.procs[0].pid
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while proc_state(pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # a program exec'd before the stop: its watcher has heard of it
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            wrapper = b"pdeath.py" in f.read()
        assert procs.stuck() == {0: Stopped(pid, "T", wrapper)}
    finally:
        t0 = time.monotonic()
        procs.close(timeout=2)
    assert time.monotonic() - t0 < 5
    assert procs.codes[0] in (-signal.SIGTERM, -signal.SIGKILL)


def test_a_write_to_a_child_that_never_reads_ends_at_its_deadline():
    """A stopped agent never drains its stdin: the write gives up, and closes the pipe it
    left half a message in."""
    procs = ProcessSet(lambda *a: None, lambda e: None)
    try:
        procs.start([ProcSpec(0, ("sleep", "30"), {"PATH": os.environ.get("PATH", "")},
                              stdin_pipe=True)])
        assert procs.write(0, b"{}\n", timeout=1.0)
        t0 = time.monotonic()
        assert not procs.write(0, b"x" * 2**20, timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 3
        assert procs.procs[0].stdin.closed and not procs.write(0, b"{}\n")
    finally:
        procs.close(timeout=2)
