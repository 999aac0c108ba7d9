"""Supervision on a fake clock: the --timeout deadline, the grace between SIGTERM and
SIGKILL, and the first failure by the time it happened. Nothing is started and nothing
sleeps: fake processes obey (or ignore) the signals ``ProcessSet`` sends, and a fake event
queue moves the clock as the supervisor waits on it. (test_supervise.py and test_procs.py
do the same with real processes and real time.)"""

import io
import queue
import signal
import subprocess
import sys
import time

from ddlrun.backends import Backend, LaunchOptions
from ddlrun.events import RankExit
from ddlrun.hosts import HostSpec
from ddlrun.output import OutputSink
from ddlrun.plan import Request, make_plan
from ddlrun.procs import ProcessSet, ProcSpec
from ddlrun.run import TIMEOUT_EXIT, supervise


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeQueue(queue.Queue):
    """Events the test schedules at fake times (when they are heard of); ``get`` moves the
    clock to the next one, or by its whole timeout when none is due."""

    def __init__(self, clock: FakeClock, schedule=()) -> None:
        super().__init__()
        self.clock = clock
        self.due = sorted(schedule, key=lambda item: item[0])

    def get(self, block=True, timeout=None):
        if self.due and self.due[0][0] <= self.clock.now + (timeout or 0.0):
            when, ev = self.due.pop(0)
            self.clock.now = max(self.clock.now, when)
            return ev
        self.clock.now += timeout or 0.0
        raise queue.Empty


class FakeProc:
    """What ProcessSet needs of a Popen: pid, poll, wait, stdin."""

    def __init__(self, pid: int, obeys_sigterm: bool = True) -> None:
        self.pid, self.obeys, self.returncode, self.stdin = pid, obeys_sigterm, None, None

    def signal(self, sig: int) -> None:
        if self.returncode is None and (sig == signal.SIGKILL or
                                        (sig == signal.SIGTERM and self.obeys)):
            self.returncode = -sig

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            raise subprocess.TimeoutExpired("fake", timeout)
        return self.returncode


class FakeBackend(Backend):
    """A local job of fake processes under a real ProcessSet on the fake clock."""

    name = "fake"

    def __init__(self, clock: FakeClock, procs: dict[int, FakeProc]) -> None:
        super().__init__(LaunchOptions())
        self.clock, self.sent = clock, []  # (time, pid, signal)
        by_pid = {p.pid: p for p in procs.values()}

        def signal_group(pid: int, sig: int) -> None:
            self.sent.append((clock.now, pid, sig))
            by_pid[pid].signal(sig)

        self.procs = ProcessSet(lambda *a: None, lambda ex: None, clock=clock,
                                sleep=clock.sleep, signal_group=signal_group)
        self.procs.procs.update(procs)

    def start(self, plan, sink, emit):
        pass

    def close(self, timeout):
        self.procs.close(timeout=timeout)

    def times(self, sig: int, pid: int | None = None) -> list[float]:
        return [t for t, p, s in self.sent if s == sig and pid in (None, p)]


def plan_of(nranks: int):
    return make_plan(Request(("prog",), (HostSpec("localhost", nranks),)), {}, "jclock",
                     29500, {})


def sink() -> OutputSink:
    return OutputSink(stdout=io.StringIO(), stderr=io.StringIO())


def test_a_rank_that_never_exits_is_stopped_at_the_deadline_then_killed_after_grace():
    clock = FakeClock()
    procs = {0: FakeProc(100, obeys_sigterm=False), 1: FakeProc(101)}
    backend = FakeBackend(clock, procs)
    t = time.monotonic()
    out = supervise(plan_of(2), backend, sink(), timeout=30, grace=5, clock=clock,
                    events=FakeQueue(clock))
    assert out.code == TIMEOUT_EXIT and out.failure is None and out.still_running == (0, 1)
    term = backend.times(signal.SIGTERM)
    assert len(term) == 2 and 30 <= term[0] < 30.5  # at the deadline, not before
    assert procs[1].returncode == -signal.SIGTERM  # rank 1 obeyed SIGTERM
    kill = backend.times(signal.SIGKILL, pid=100)
    assert len(kill) == 1 and kill[0] - term[0] >= 5 and kill[0] - term[0] < 5.1
    assert procs[0].returncode == -signal.SIGKILL
    assert time.monotonic() - t < 1.0  # fake time: nothing waited for real


def test_after_the_first_failure_survivors_get_sigterm_then_sigkill_after_grace():
    clock = FakeClock()
    procs = {0: FakeProc(100, obeys_sigterm=False), 1: FakeProc(101), 2: FakeProc(102)}
    procs[1].returncode = 3  # the failure: heard of at t=2
    backend = FakeBackend(clock, procs)
    events = FakeQueue(clock, [(2.0, RankExit(1, 0, 3, 101, 2.0))])
    out = supervise(plan_of(3), backend, sink(), timeout=None, grace=7, clock=clock,
                    events=events)
    assert out.code == 3 and out.failure.rank == 1 and out.still_running == (0, 2)
    term = backend.times(signal.SIGTERM)
    # the supervisor listens Backend.settle seconds for an earlier failure, then stops all
    assert term and term[0] == 2.0 + backend.settle
    kill = backend.times(signal.SIGKILL, pid=100)
    assert kill[0] - term[0] >= 7 and kill[0] - term[0] < 7.1
    assert procs[2].returncode == -signal.SIGTERM and procs[0].returncode == -signal.SIGKILL


def test_no_grace_is_waited_when_every_survivor_obeys_sigterm():
    clock = FakeClock()
    procs = {0: FakeProc(100), 1: FakeProc(101)}
    procs[0].returncode = 1
    backend = FakeBackend(clock, procs)
    supervise(plan_of(2), backend, sink(), grace=60, clock=clock,
              events=FakeQueue(clock, [(1.0, RankExit(0, 0, 1, 100, 1.0))]))
    # SIGKILL still goes to every group (what the ranks forked), but at once
    assert backend.times(signal.SIGKILL) and backend.times(signal.SIGKILL)[0] < 1.5


def test_the_earliest_failure_by_its_time_wins_not_the_first_heard_of():
    clock = FakeClock()
    procs = {r: FakeProc(100 + r) for r in range(3)}
    events = FakeQueue(clock, [
        (5.10, RankExit(0, 0, 1, 100, 5.0)),  # heard of first
        (5.20, RankExit(1, 0, 4, 101, 4.0)),  # heard of later, within settle: happened first
    ])
    err = io.StringIO()
    out = supervise(plan_of(3), FakeBackend(clock, procs),
                    OutputSink(stdout=io.StringIO(), stderr=err), clock=clock, events=events)
    assert out.code == 4 and out.failure.rank == 1
    assert "rank 1 on host localhost (pid 101) exited with code 4" in err.getvalue()
    assert "then rank 0 (exited with code 1): follow-on failures of rank 1" in err.getvalue()


def test_a_failure_heard_of_after_the_settle_window_does_not_count():
    clock = FakeClock()
    procs = {r: FakeProc(100 + r) for r in range(2)}
    backend = FakeBackend(clock, procs)
    events = FakeQueue(clock, [
        (5.0, RankExit(0, 0, 1, 100, 5.0)),
        (5.0 + backend.settle + 1, RankExit(1, 0, 4, 101, 1.0)),  # too late to be heard
    ])
    out = supervise(plan_of(2), backend, sink(), clock=clock, events=events)
    assert out.code == 1 and out.failure.rank == 0


def test_without_fail_fast_the_job_runs_on_and_the_earliest_failure_is_the_code():
    clock = FakeClock()
    procs = {r: FakeProc(100 + r) for r in range(3)}
    backend = FakeBackend(clock, procs)
    events = FakeQueue(clock, [(1.0, RankExit(2, 0, 5, 102, 1.0)),
                               (9.0, RankExit(0, 0, 6, 100, 0.5)),
                               (20.0, RankExit(1, 0, 0, 101, 20.0))])
    out = supervise(plan_of(3), backend, sink(), clock=clock, events=events, fail_fast=False)
    assert out.code == 6 and out.failure.rank == 0 and out.still_running == ()
    # nobody was stopped before the last rank's end (the teardown after it finds fakes
    # that never "exited": they stand for what the ranks forked)
    assert clock.now >= 20.0 and min(backend.times(signal.SIGTERM)) >= 20.0


def test_exit_times_come_from_the_injected_clock():
    exits = []
    procs = ProcessSet(lambda *a: None, exits.append, clock=lambda: 42.0)
    procs.start([ProcSpec(0, (sys.executable, "-c", "raise SystemExit(3)"), {})])
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    procs.close(timeout=1)
    assert [(e.key, e.code, e.time) for e in exits] == [(0, 3, 42.0)]
