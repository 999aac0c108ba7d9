"""Elastic hosts: the host discovery script (Horovod's ``--host-discovery-script``) and the
blacklist of failed hosts with its cooldown (``--blacklist-cooldown-range MIN MAX``).

The discovery script prints one host per line, ``host`` or ``host:slots``; a host without
slots takes ``--slots``. ddlrun runs it before the job and then periodically, without a
shell (argv ``[script]``), in a session of its own so a hang is ended with its whole
process group. Every host name passes ``hosts.validate_hostname`` (the one check against
shell characters and leading ``-``) before it can reach an ssh command line. Every error
is one line naming the script, and for output, the line number.

The blacklist follows Horovod's ``HostState``: without a cooldown range a failed host is
out for good; with one, each failure outside a cooldown starts a cooldown of
``MIN * 2**failures + uniform(0, MIN)`` seconds held within ``[MIN, MAX]``, after which
the host may come back. A failure reported during a cooldown neither extends it nor
counts again (the ranks of one host fail together).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import stat
import subprocess
import time
from collections.abc import Callable

from .errors import UsageError
from .hosts import parse_host_token

# Horovod's bounds on --blacklist-cooldown-range (seconds)
COOLDOWN_LOWER_LIMIT = 1.0
COOLDOWN_UPPER_LIMIT = 3600.0
_MAX_DOUBLINGS = 62  # 2**62 * MIN is past any MAX: no need for a larger exponent
_KILL_GRACE = 5.0  # seconds to collect a killed script's pipes


class DiscoveryError(UsageError):
    """The discovery script is missing, cannot run, fails, hangs, or prints bad lines."""


class NoHostsError(DiscoveryError):
    """The discovery script ran fine and printed no host (none available right now)."""


def parse_discovery(text: str, default_slots: int | None, script: str) -> dict[str, int]:
    """The hosts a discovery script printed, ``{host: slots}`` in order of first appearance.
    Blank lines and ``#`` comments are skipped; ``host`` alone takes ``default_slots``."""
    found: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"discovery script {script}:{lineno}"
        try:
            spec = parse_host_token(line, where)
        except UsageError as exc:
            raise DiscoveryError(str(exc)) from None
        if spec.user is not None:
            raise DiscoveryError(f"{where}: {line!r}: print 'host' or 'host:slots' (no "
                                 "user@: ssh's user comes from ddlrun's own options)")
        if spec.name in found:
            raise DiscoveryError(f"{where}: host {spec.name!r} is printed twice: print it "
                                 "once as host:slots")
        slots = spec.slots if spec.slots is not None else default_slots
        if slots is None:
            raise DiscoveryError(f"{where}: {line!r} has no slot count: print "
                                 f"{spec.name}:N or give ddlrun --slots N")
        found[spec.name] = slots
    return found


def check_script(script: str, cwd: str | None = None) -> str:
    """The absolute path of ``script`` (relative to ``cwd``, else the current directory)
    when it is an executable regular file, else one-line DiscoveryError."""
    path = os.path.abspath(os.path.join(cwd or os.getcwd(), script))
    what = f"discovery script {script}"
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise DiscoveryError(f"{what}: no such file ({path})") from None
    except OSError as exc:
        raise DiscoveryError(f"{what}: cannot read it: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise DiscoveryError(f"{what}: not a regular file ({path})")
    if not os.access(path, os.X_OK):
        raise DiscoveryError(f"{what}: not executable: chmod +x {path}")
    return path


def run_discovery(script: str, timeout: float, default_slots: int | None,
                  cwd: str | None = None) -> dict[str, int]:
    """Run the discovery script once (no shell, stdin empty) and parse what it printed.
    A script that runs past ``timeout`` seconds is killed with its process group."""
    path = check_script(script, cwd)
    what = f"discovery script {script}"
    try:
        proc = subprocess.Popen([path], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=cwd, start_new_session=True)
    except OSError as exc:
        raise DiscoveryError(f"{what}: cannot run it: {exc.strerror} (does it start with "
                             "a #! line?)") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise DiscoveryError(f"{what} did not finish in {timeout:g} s: it was killed "
                             "(it must print the hosts and exit)") from None
    except BaseException:  # KeyboardInterrupt, a signal turned exception: no orphan
        _kill_group(proc)
        raise
    if proc.returncode != 0:
        raise DiscoveryError(f"{what} {_exit_words(proc.returncode)}{_last_line(err)}")
    try:
        text = out.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = out.count(b"\n", 0, exc.start) + 1
        raise DiscoveryError(f"discovery script {script}:{lineno}: byte "
                             f"{out[exc.start:exc.start + 1]!r} is not UTF-8 text") from None
    hosts = parse_discovery(text, default_slots, script)
    if not hosts:
        raise NoHostsError(f"{what} printed no host (expected lines 'host' or 'host:slots')")
    return hosts


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the script's process group and collect it. The group id is the script's pid,
    safe to signal while the script is not reaped; pipes a helper outside the group still
    holds are closed after a grace period rather than waited on forever."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.communicate(timeout=_KILL_GRACE)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _last_line(err: bytes | None) -> str:
    lines = (err or b"").decode("utf-8", "replace").strip().splitlines()
    return f": {lines[-1].strip()}" if lines else ""


# ---------------------------------------------------------------------------- blacklist
def check_cooldown_range(cooldown_range: tuple[float, float]) -> tuple[float, float]:
    """``(MIN, MAX)`` when ``1 <= MIN <= MAX <= 3600`` (Horovod's bounds), else UsageError."""
    low, high = cooldown_range
    if not COOLDOWN_LOWER_LIMIT <= low <= high <= COOLDOWN_UPPER_LIMIT:
        raise UsageError(f"--blacklist-cooldown-range {low:g} {high:g}: need "
                         f"{COOLDOWN_LOWER_LIMIT:g} <= MIN <= MAX <= "
                         f"{COOLDOWN_UPPER_LIMIT:g} seconds")
    return float(low), float(high)


class Blacklist:
    """Hosts taken out of the job after a failure; with a cooldown range they come back
    once their cooldown ends. ``clock`` and ``rng`` are the seams for tests."""

    def __init__(self, cooldown_range: tuple[float, float] | None,
                 clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self._range = check_cooldown_range(cooldown_range) if cooldown_range else None
        self._clock = clock
        self._rng = rng or random.Random()
        self._failures: dict[str, int] = {}  # failures that started a cooldown
        self._until: dict[str, float] = {}  # host -> end of its cooldown (inf: for good)

    def add(self, host: str) -> float | None:
        """A failure on ``host``: take it out. Returns the seconds it stays out from now,
        None when it is out for good (no cooldown range)."""
        now = self._clock()
        if self._range is None:
            self._until[host] = float("inf")
            return None
        end = self._until.get(host)
        if end is not None and end > now:
            return end - now  # the same outage: its ranks fail one after another
        count = self._failures.get(host, 0) + 1
        self._failures[host] = count
        low, high = self._range
        delay = low * 2.0 ** min(count, _MAX_DOUBLINGS) + self._rng.uniform(0.0, low)
        delay = max(low, min(high, delay))
        self._until[host] = now + delay
        return delay

    def is_blacklisted(self, host: str) -> bool:
        """Whether ``host`` is out now."""
        end = self._until.get(host)
        return end is not None and end > self._clock()

    def failures(self, host: str) -> int:
        """How many cooldowns ``host`` has started (0 without a cooldown range)."""
        return self._failures.get(host, 0)

    def blacklisted(self) -> list[str]:
        """The hosts out now, in the order they were first taken out."""
        now = self._clock()
        return [host for host, end in self._until.items() if end > now]

    def filter(self, hosts: dict[str, int]) -> dict[str, int]:
        """``hosts`` without those out now (order kept)."""
        now = self._clock()
        return {host: slots for host, slots in hosts.items()
                if not self._until.get(host, now) > now}
