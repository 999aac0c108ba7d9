"""Exec a program that dies with its supervisor: ``PR_SET_PDEATHSIG=SIGKILL``, then exec.

``ProcessSet`` starts every child as ``python -I -S pdeath.py PARENT STATUS LC_CTYPE PROGRAM
ARGS...`` on Linux instead of setting the signal in a ``preexec_fn``: Python documents
``preexec_fn`` as unsafe in a process with threads (ddlrun's output readers run while it
forks), and ctypes loaded between fork and exec is exactly that. Here the prctl runs in a
fresh, single-threaded interpreter; the setting survives ``execve``, and the pid stays the
same, so the program is the child ddlrun sees. Cost: one interpreter start per rank (about
20 ms; ``-I -S``: no site, no user paths, no ``PYTHON*`` variables).

- ``PARENT``: the supervisor's pid. If it died before the prctl took effect, nobody would
  send the signal: the wrapper kills itself instead.
- ``STATUS``: a pipe's write end. When the exec fails, ``errno`` goes there and the
  wrapper exits 127; on success the exec closes it (close-on-exec), so the supervisor can
  report the same ``OSError`` as ``subprocess.Popen`` would have for a missing program
  (with the child's exit: it never blocks on this pipe, as a wrapper stopped before its
  exec would never close it).
- ``LC_CTYPE``: ``=`` and its value in the program's environment, empty when unset. Python coerces
  the C locale by setting ``LC_CTYPE`` in its own environment (PEP 538); the program gets
  the variable as it was given. Signal dispositions Python changes at start (SIGPIPE and
  SIGXFSZ ignored) are set back to their defaults, as ``subprocess`` does.

Standard library only, run by path: it must work where ``import ddlrun`` would not.
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    parent, status_fd, lc_ctype, program = int(argv[0]), int(argv[1]), argv[2], argv[3:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux's libc: the supervisor's own teardown still applies
    if os.getppid() != parent:  # the supervisor died before the prctl: do as it would have
        os.kill(os.getpid(), signal.SIGKILL)
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    if lc_ctype.startswith("="):
        os.environ["LC_CTYPE"] = lc_ctype[1:]
    else:
        os.environ.pop("LC_CTYPE", None)
    os.set_inheritable(status_fd, False)
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        os.write(status_fd, str(exc.errno).encode())
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
