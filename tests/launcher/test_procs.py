"""``ProcessSet`` starts children through ``pdeath.py`` on Linux (no ``preexec_fn``): the
program gets its environment and signal dispositions as given, the parent-death signal is
set, and a program that cannot start raises what ``Popen`` would."""

import os
import signal
import sys
import threading

import pytest

from ddlrun.procs import ProcessSet, ProcSpec

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


def test_a_missing_program_raises_as_popen_does():
    procs = ProcessSet(lambda *a: None, lambda e: None)
    with pytest.raises(FileNotFoundError) as info:
        procs.start([ProcSpec(0, ("/nonexistent/prog",), {"PATH": "/usr/bin"})])
    assert info.value.filename == "/nonexistent/prog" and procs.procs == {}
    procs.close(timeout=1)
