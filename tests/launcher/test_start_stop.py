"""A rank SIGSTOPped while it starts (issue 28): from its fork, while it is still ddlrun's
``pdeath.py`` wrapper, to its first collective. ddlrun must end within ``--timeout`` (or
sooner, when a peer gives up after ``DDL_TIMEOUT``), name the stopped rank, exit non-zero
and leave no process of the job: checked by the pids and sessions seen from the first fork
on, never by name. Signals to ddlrun during start-up tear everything down. The ssh path is
the agent protocol with agents on this host.

Run by hand for the issue's count (prints one line per trial and the figures)::

    .venv/bin/python tests/launcher/test_start_stop.py 50
"""

from __future__ import annotations

import io
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddlrun_testlib import PY, ddlrun_argv, shm_left  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

# every rank: ddl.init, one allreduce, then wait (the job ends by a failure or --timeout)
PROGRAM = ("import sys, time, numpy, ddl; ddl.init(); ddl.allreduce(numpy.ones(4)); "
           "print('first collective done', flush=True); time.sleep(60)")
TIMEOUT = 4.0  # ddlrun --timeout
GRACE = 1.0  # ddlrun --grace
DDL_TIMEOUT = 2  # the survivors give up waiting for the stopped rank after this
LIMIT = TIMEOUT + GRACE + 3.0  # seconds a trial may take, ddlrun's own start included
HANG = 40.0  # a trial still running after this is a hang: everything is killed
WINDOW = 0.35  # seconds after the fork in which random stops land (the first collective
#                comes about 0.25 s after the fork on the 2-core dev machine; the wrapper
#                execs the program about 15 ms after it is first seen: 40% of the stops
#                aim at those)
NAMED = re.compile(r"^ddlrun: rank (\d+) on host \S+ \(pid \d+\) is (stopped[^:]*):", re.M)


# ---------------------------------------------------------------------------- /proc
def stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: state, ppid, pgrp, session, ... (starttime is
    field 19); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def read(pid: int, what: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read()
    except OSError:
        return b""


def all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


class Tracker(threading.Thread):
    """Every process of a job from its first fork: the children of ``roots`` (and theirs),
    and every process of their sessions. Stops rank ``rank`` (the session leader whose
    environment says ``RANK=rank``) ``delay`` seconds after it is first seen, unless
    ``rank`` is None. ``where``: what the rank was when stopped (``wrapper``: still
    ``pdeath.py``; ``program``)."""

    def __init__(self, roots: set[int], marker: str, rank: int | None, delay: float) -> None:
        super().__init__(daemon=True)
        self.roots, self.marker, self.rank, self.delay = set(roots), marker.encode(), rank, delay
        self.seen: dict[int, str] = {}  # pid -> starttime
        self.sessions: set[int] = set()
        self.target: int | None = None
        self.where = ""
        self.stopped_at: float | None = None  # seconds after the rank was first seen
        self._done = threading.Event()
        self._lock = threading.Lock()

    def scan(self) -> None:
        for pid in all_pids():
            st = stat(pid)
            if st is None or len(st) < 20:
                continue
            ppid, sid = int(st[1]), int(st[3])
            with self._lock:
                if (self.seen.get(pid) == st[19] or ppid in self.roots or ppid in self.seen
                        or sid in self.sessions):
                    self.seen[pid] = st[19]
                    if pid == sid:  # (a child seen before its setsid is looked at again)
                        self.sessions.add(sid)

    def find_target(self) -> int | None:
        want = f"RANK={self.rank}".encode()
        for pid in sorted(self.sessions):
            if (self.marker in read(pid, "cmdline")
                    and want in read(pid, "environ").split(b"\0")):
                return pid
        return None

    def run(self) -> None:
        first = None
        while not self._done.is_set():
            self.scan()
            if self.rank is not None and self.target is None:
                pid = self.find_target()
                if pid is not None:
                    first = time.monotonic()
                    self.target = pid
                    time.sleep(max(0.0, first + self.delay - time.monotonic()))
                    os.kill(pid, signal.SIGSTOP)
                    self.stopped_at = time.monotonic() - first
                    self.where = self.what_is(pid)
                    continue
            self._done.wait(0.001 if self.target is None and self.rank is not None else 0.02)

    @staticmethod
    def what_is(pid: int) -> str:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            st = stat(pid)
            if st is None or st[0] in ("T", "t", "Z"):
                break
            time.sleep(0.001)
        return "wrapper" if b"pdeath.py" in read(pid, "cmdline") else "program"

    def finish(self) -> None:
        self.scan()
        self._done.set()
        self.join(5.0)
        self.scan()

    def left(self, within: float = 5.0) -> list[int]:
        """Processes of the job still alive (pid and start time as seen, or in one of its
        sessions), after waiting ``within`` seconds for them to go; all are SIGKILLed."""
        deadline = time.monotonic() + within
        while True:
            left = []
            for pid in all_pids():
                st = stat(pid)
                if st is None or st[0] == "Z" or len(st) < 20:
                    continue
                if self.seen.get(pid) == st[19] or int(st[3]) in self.sessions:
                    left.append(pid)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for pid in left:  # never leave them behind, even when the test fails
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        return left


# ---------------------------------------------------------------------------- one trial
@dataclass
class Trial:
    rank: int
    delay: float
    code: int | None = None  # None: a hang (killed after HANG seconds)
    took: float = 0.0
    where: str = ""  # wrapper, program, program+collective (it had done its first one)
    named: str = ""  # what ddlrun said about the stopped rank ("" when it did not name it)
    left: list[int] = field(default_factory=list)
    shm: list[str] = field(default_factory=list)
    stderr: str = ""

    def problems(self) -> list[str]:
        out = []
        if not self.where:
            out.append(f"rank {self.rank} was never seen, so never stopped")
        if self.code is None:
            out.append(f"hang: no end within {HANG:g}s")
        elif self.took > LIMIT:
            out.append(f"took {self.took:.1f}s (limit {LIMIT:g}s)")
        if self.code == 0:
            out.append("exit code 0")
        if not self.named:
            out.append(f"rank {self.rank} not named as stopped")
        if self.left:
            out.append(f"processes left: {self.left}")
        if self.shm:
            out.append(f"shared memory left: {self.shm}")
        return out

    def line(self) -> str:
        code = "hang" if self.code is None else str(self.code)
        return (f"rank {self.rank} stopped {self.delay * 1000:4.0f} ms after fork "
                f"({self.where or '?'}): exit {code} in {self.took:.1f}s; "
                f"{self.named or 'not named'}")


def run_trial(rank: int, delay: float, sig_after: tuple[int, float] | None = None,
              nranks: int = 2) -> Trial:
    """``ddlrun -n 2 --timeout 4`` of PROGRAM; rank ``rank`` SIGSTOPped ``delay`` s after
    its fork. ``sig_after``: (signal, seconds): send ddlrun that signal that long after
    the stop."""
    marker = f"ddlstart-{uuid.uuid4().hex[:12]}"
    job = f"ss_{marker[-10:]}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["DDL_TIMEOUT"] = str(DDL_TIMEOUT)
    argv = ddlrun_argv("-n", str(nranks), "--timeout", f"{TIMEOUT:g}", "--grace", f"{GRACE:g}",
                       "--job-id", job, PY, "-c", PROGRAM, marker)
    trial = Trial(rank, delay)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, start_new_session=True)
        tracker = Tracker({proc.pid}, marker, rank, delay)
        tracker.seen[proc.pid] = (stat(proc.pid) or [""] * 20)[19]
        tracker.sessions.add(proc.pid)
        tracker.start()
        try:
            if sig_after is not None:
                while tracker.stopped_at is None and proc.poll() is None:
                    time.sleep(0.005)
                time.sleep(sig_after[1])
                proc.send_signal(sig_after[0])
            trial.code = proc.wait(timeout=HANG)
        except subprocess.TimeoutExpired:
            pass
        finally:
            trial.took = time.monotonic() - t0
            tracker.finish()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            trial.left = tracker.left()
        out.seek(0)
        err.seek(0)
        stdout, trial.stderr = out.read().decode(), err.read().decode()
    trial.where = tracker.where
    if f"[{rank}] first collective done" in stdout:
        trial.where += "+collective"
    m = NAMED.search(trial.stderr)
    if m and int(m.group(1)) == rank:
        trial.named = m.group(0)[len("ddlrun: "):-1]
    trial.shm = shm_left(job)
    return trial


def draw(rng: random.Random) -> tuple[int, float]:
    """A rank and a moment after its fork to stop it."""
    rank = rng.randrange(2)
    return rank, rng.uniform(0.0, 0.012) if rng.random() < 0.4 else rng.uniform(0.0, WINDOW)


# ---------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_rank_stopped_at_random_moments_of_its_start():
    """12 trials: each ends in time, names the stopped rank, exits non-zero, leaves nothing."""
    rng = random.Random(int(os.environ.get("DDLRUN_FAULT_SEED", "28")))
    trials = [run_trial(*draw(rng)) for _ in range(12)]
    problems = [f"{t.line()}: {'; '.join(t.problems())}\n{t.stderr[-800:]}"
                for t in trials if t.problems()]
    assert problems == []


def aimed(**kw) -> Trial:
    """Rank 1 stopped the moment it is seen: still the wrapper, before its program's exec
    (and before its parent-death signal is set). Retried when the stop came too late."""
    for _ in range(5):
        trial = run_trial(1, 0.0, **kw)
        if trial.where.startswith("wrapper"):
            return trial
    pytest.skip("could not stop the wrapper before its exec in 5 tries")


def test_wrapper_stopped_before_its_exec_is_named_and_killed():
    trial = aimed()
    assert trial.problems() == [], f"{trial.line()}\n{trial.stderr}"
    assert "stopped while starting" in trial.named, trial.stderr


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_start_up_tears_everything_down(sig, code):
    trial = aimed(sig_after=(sig, 0.2))
    assert trial.code == code, trial.stderr
    assert trial.took < 5, trial.stderr
    assert "stopping all ranks" in trial.stderr
    assert trial.left == [] and trial.shm == []


# ---------------------------------------------------------------------------- agents
def test_agent_path_names_and_kills_a_rank_stopped_while_starting(monkeypatch):
    """The ssh backend's agents on this host: host 1's rank stopped as its wrapper; the
    other rank waits, so --timeout ends the job."""
    from ddlrun.backends import LaunchOptions
    from ddlrun.backends.ssh import AgentBackend
    from ddlrun.hosts import HostSpec
    from ddlrun.output import OutputSink
    from ddlrun.plan import Request, make_plan
    from ddlrun.run import TIMEOUT_EXIT, supervise

    class AgentsHere(AgentBackend):
        name = "agents-here"

        def transport(self, host, connect_timeout=None):
            return []

    marker = f"ddlstart-{uuid.uuid4().hex[:12]}"
    program = (PY, "-c", "import time; time.sleep(60)", marker)
    plan = make_plan(Request(program, (HostSpec("h0", 1), HostSpec("h1", 1))), {},
                     f"sa_{marker[-10:]}", 29500, {}, {"DDL_JOB_SECRET": marker})
    monkeypatch.delenv("RANK", raising=False)
    err = io.StringIO()
    tracker = Tracker({os.getpid()}, marker, 1, 0.0)
    tracker.start()
    t0 = time.monotonic()
    try:
        outcome = supervise(plan, AgentsHere(LaunchOptions(grace=GRACE)),
                            OutputSink(stdout=io.StringIO(), stderr=err), timeout=3.0)
    finally:
        took = time.monotonic() - t0
        tracker.finish()
        left = tracker.left()
    assert tracker.target is not None, f"rank 1 never seen: {err.getvalue()}"
    if tracker.where != "wrapper":
        pytest.skip(f"the stop came too late ({tracker.where})")
    assert outcome.code == TIMEOUT_EXIT, err.getvalue()
    assert took < 3.0 + GRACE + 4.0, err.getvalue()
    m = NAMED.search(err.getvalue())
    assert m and m.group(1) == "1" and "while starting" in m.group(2), err.getvalue()
    assert left == []


# ---------------------------------------------------------------------------- by hand
def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 50
    seed = int(argv[1]) if len(argv) > 1 else 28
    rng = random.Random(seed)
    trials = []
    for i in range(n):
        trial = run_trial(*draw(rng))
        trials.append(trial)
        bad = trial.problems()
        print(f"{i + 1:3d} {trial.line()}" + (f"  PROBLEMS: {'; '.join(bad)}" if bad else ""),
              flush=True)
    ended = [t for t in trials if t.code is not None]
    good = [t for t in trials if not t.problems()]
    where: dict[str, int] = {}
    for t in trials:
        where[t.where] = where.get(t.where, 0) + 1
    print(f"\n{n} trials (seed {seed}): {len(ended)} ended, {len(good)} without a problem; "
          f"worst {max(t.took for t in trials):.1f}s (limit {LIMIT:g}s); exit codes "
          f"{sorted({t.code for t in trials}, key=str)}; stopped as {where}")
    return 0 if len(good) == n else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
