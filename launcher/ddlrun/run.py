"""Act: start the backend, wait for the first failure (or the end, the timeout, a signal),
tear everything down, report, and return ddlrun's exit code.

The first failure is the earliest by the time it happened, not the first one heard of:
after hearing of one, the supervisor listens ``Backend.settle`` seconds more. Before the
teardown it asks which running ranks are stopped (``Backend.stuck``): such a rank is named
first, since its peers only failed waiting for it. The survivors' follow-on errors are
named, not repeated. (``fail_fast=False`` is for ``ddl.perf.spawn``'s test jobs only: no
teardown until every rank has ended; ddlrun itself always fails fast.)

Exit codes: the failing rank's code (128+N when killed by signal N); 124 when --timeout
ran out; 130/143 on SIGINT/SIGTERM; 2 usage errors; 3 preflight failures.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .backends import Backend
from .events import Event, HostLost, JobExit, RankExit, Stuck
from .output import OutputSink
from .plan import JobPlan
from .procs import STUCK_STATES

TIMEOUT_EXIT = 124


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_raise(sigs=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Turn signals into ``Interrupted`` in the main thread, so ``finally`` tears down."""

    def handler(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def exit_code(code: int) -> int:
    return 128 + (-code) if code < 0 else code


def describe_code(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class Outcome:
    code: int
    failure: Event | None = None
    still_running: tuple[int, ...] = ()
    stuck: tuple[Stuck, ...] = ()


OUTPUT_DRAIN = 0.5  # seconds the report waits for the failing rank's last lines
STUCK_ASK = 1.0  # seconds to ask the hosts which ranks are stopped


def _failed(ev: Event) -> bool:
    """Stopped ranks, lost hosts and non-zero exits; a launcher (mpirun, srun) that exits 0
    ended the job well."""
    return not isinstance(ev, (RankExit, JobExit)) or ev.code != 0


def _code(ev: Event) -> int:
    if isinstance(ev, HostLost):
        return 255 if ev.code in (0, 255) else exit_code(ev.code)
    return exit_code(ev.code)


def supervise(
    plan: JobPlan,
    backend: Backend,
    sink: OutputSink,
    timeout: float | None = None,
    grace: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    fail_fast: bool = True,
    events: queue.Queue[Event] | None = None,
) -> Outcome:
    """Run the job to its end, its first failure (by the time it happened), its --timeout
    or a signal; tear it down; report; return the outcome. Without ``fail_fast`` (tests
    whose ranks must each report how they saw a peer fail) a failure stops nothing: the
    job runs until every rank has exited or the timeout, and the outcome is still the
    earliest failure. ``clock`` and ``events`` (the channel the backend reports on, read
    with a timeout) are the seams of the fake-clock tests, whose queue moves their clock."""
    events = queue.Queue() if events is None else events
    remaining = {r.rank for r in plan.ranks}
    deadline = clock() + timeout if timeout else None
    outcome: Outcome | None = None
    seen: list[Event] = []  # failures so far, without fail_fast
    try:
        backend.start(plan, sink, events.put)
        while remaining and outcome is None:
            wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - clock()))
            try:
                ev = events.get(timeout=wait)
            except queue.Empty:
                if deadline is not None and clock() >= deadline:
                    stuck = tuple(backend.stuck(STUCK_ASK))
                    outcome = Outcome(TIMEOUT_EXIT, None, tuple(sorted(remaining)), stuck)
                    _report_stuck(plan, sink, stuck, None)
                    _report_timeout(plan, sink, timeout, outcome.still_running)
                continue
            _account(ev, remaining)
            if _failed(ev) and not fail_fast:
                seen.append(ev)
            elif _failed(ev):
                failures = [ev, *_settle(events, remaining, clock() + backend.settle, clock)]
                failures.sort(key=lambda e: e.time)
                stuck = tuple(s for s in backend.stuck(STUCK_ASK) if s.rank in remaining)
                outcome = Outcome(_code(failures[0]), failures[0], tuple(sorted(remaining)),
                                  stuck)
                _report_failure(plan, backend, sink, failures, stuck)
        if outcome is None and seen:
            first = min(seen, key=lambda e: e.time)
            outcome = Outcome(_code(first), first)
    except OSError as exc:  # the program could not be started at all
        sink.note(f"cannot start {exc.filename or plan.program[0]!r}: {exc.strerror}")
        outcome = Outcome(127)
    except Interrupted as exc:
        sink.note(f"{exc}: stopping all ranks")
        outcome = Outcome(128 + exc.signum)
    finally:
        with signals_raise_ignored():
            backend.close(grace)
    if outcome is not None and outcome.code not in (0, 127):
        sink.note(f"job {plan.job_id} ended with exit code {outcome.code}; if a host kept its "
                  f"shared memory: ddlrun --cleanup --job-id {plan.job_id} there")
    return outcome or Outcome(0)


def _account(ev: Event, remaining: set[int]) -> None:
    if isinstance(ev, RankExit):
        remaining.discard(ev.rank)
    elif isinstance(ev, JobExit):
        remaining.clear()


def _settle(events: queue.Queue, remaining: set[int], until: float,
            clock: Callable[[], float]) -> list[Event]:
    """The failures heard of until ``until`` (or until every rank has exited)."""
    found = []
    while remaining and (left := until - clock()) > 0:
        try:
            ev = events.get(timeout=left)
        except queue.Empty:
            break
        _account(ev, remaining)
        if _failed(ev):
            found.append(ev)
    return found


@contextlib.contextmanager
def signals_raise_ignored() -> Iterator[None]:
    """While tearing down, a second Ctrl-C must not abort the teardown half way."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    try:
        old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _host(plan: JobPlan, index: int) -> str:
    return plan.hosts[index].host.name


def _report_stuck(plan: JobPlan, sink: OutputSink, stuck: tuple[Stuck, ...],
                  failed: RankExit | None) -> None:
    """Stopped ranks first: their peers' errors are only the consequence."""
    for i, s in enumerate(stuck):
        what = (f"rank {s.rank} on host {_host(plan, s.host_index)} (pid {s.pid}) is "
                f"{STUCK_STATES.get(s.state, f'in state {s.state}')}")
        if i:
            sink.note(f"{what} too")
        elif failed is not None:
            sink.note(f"{what}: it is the likely cause; rank {failed.rank} failed waiting for "
                      "it")
        else:
            sink.note(f"{what}: it is the likely cause")


def _report_failure(plan: JobPlan, backend: Backend, sink: OutputSink, failures: list[Event],
                    stuck: tuple[Stuck, ...]) -> None:
    first = failures[0]
    if isinstance(first, JobExit):
        sink.note(f"{backend.name} {describe_code(first.code)}")
        for line in sink.tail(-1)[-10:]:
            sink.note(f"  | {line}")
        return
    _report_stuck(plan, sink, stuck, first if isinstance(first, RankExit) else None)
    if isinstance(first, HostLost):
        sink.note(f"{first.message}; stopping the job")
    else:
        _report_rank(plan, backend, sink, first)
    # SIGTERM is what teardowns send (an agent stops its host's ranks on a failure there)
    later = [e for e in failures[1:] if isinstance(e, RankExit) and e.code != -signal.SIGTERM]
    if later:
        if stuck:
            cause = f"rank {stuck[0].rank}"
        elif isinstance(first, RankExit):
            cause = f"rank {first.rank}"
        else:
            cause = f"host {_host(plan, first.host_index)}"
        names = ", ".join(f"rank {e.rank} ({describe_code(e.code)})" for e in later)
        sink.note(f"then {names}: follow-on failures of {cause} (their output is above)")


def _report_rank(plan: JobPlan, backend: Backend, sink: OutputSink, ev: RankExit) -> None:
    sink.note(f"rank {ev.rank} on host {_host(plan, ev.host_index)} (pid {ev.pid}) "
              f"{describe_code(ev.code)}; stopping the other ranks")
    backend.wait_output(ev.rank, OUTPUT_DRAIN)
    tail = sink.tail(ev.rank)
    if tail:
        sink.note(f"last {len(tail)} line(s) of rank {ev.rank}:")
        for line in tail:
            sink.note(f"  | {line}")
    logs = sink.logs.get(ev.rank)
    if logs:
        sink.note(f"logs: {logs.stdout} {logs.stderr}")


def _report_timeout(plan: JobPlan, sink: OutputSink, timeout: float | None,
                    ranks: tuple[int, ...]) -> None:
    host_of = {r.rank: r.host_index for r in plan.ranks}
    names = ", ".join(f"{r} ({_host(plan, host_of[r])})" for r in ranks)
    sink.note(f"--timeout {timeout:g}s reached; ranks still running: {names}; stopping them")
