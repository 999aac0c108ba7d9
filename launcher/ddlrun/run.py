"""Act: start the backend, wait for the first failure (or the end, the timeout, a signal),
tear everything down, report, and return ddlrun's exit code.

The failure blamed is the earliest root cause, not the first exit and not the first one
heard of (failures.py): each failed rank's record says why it failed and whether a peer's
failure caused it; root causes (and ranks that failed without a record: killed, lost) come
before such consequences, and among equals the earliest by the record's time, then the
exit's. After hearing of a failure the supervisor listens ``Backend.settle`` seconds more,
and while every failure heard of is a consequence, up to ``CAUSE_WAIT`` more for the rank
that caused them (its interpreter may still be dying). Before the teardown it asks which
running ranks are stopped (``Backend.stuck``): such a rank is named first, since its peers
only failed waiting for it. The others' follow-on errors are named, not repeated.
(``fail_fast=False`` is for ``ddl.perf.spawn``'s test jobs only: no teardown until every
rank has ended; ddlrun itself always fails fast.)

Exit codes: the blamed rank's code (128+N when killed by signal N); 124 when --timeout
ran out; 130/143 on SIGINT/SIGTERM; 2 usage errors; 3 preflight failures.

A signal that comes while the job is torn down does not abort the teardown: it is kept
(``Outcome.late_signal``) so that ``steps.act`` starts no restart after it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from . import diagnose, flight_report
from . import failures as blame
from .backends.base import Backend
from .events import (
    Event,
    HostLost,
    JobExit,
    RankExit,
    StartFailed,
    Stuck,
    Superseded,
    describe_code,
)
from .output import OutputSink
from .plan import JobPlan
from .procs import STARTING_STATES, STUCK_STATES

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


@dataclass(frozen=True)
class Outcome:
    code: int
    failure: Event | None = None
    still_running: tuple[int, ...] = ()
    stuck: tuple[Stuck, ...] = ()
    late_signal: int | None = None  # SIGINT/SIGTERM/SIGHUP that came during the teardown


OUTPUT_DRAIN = 0.5  # seconds the report waits for the failing rank's last lines
CAUSE_WAIT = 3.0  # seconds more to listen for a cause while every failure is a consequence
STUCK_ASK = 1.0  # seconds to ask the hosts which ranks are stopped


def _failed(ev: Event) -> bool:
    """Stopped ranks, lost hosts and non-zero exits; a launcher (mpirun, srun) that exits 0
    ended the job well. ``Superseded`` is no failure (the job moved on: nothing to blame)."""
    if isinstance(ev, Superseded):
        return False
    return not isinstance(ev, (RankExit, JobExit)) or ev.code != 0


def _code(ev: Event) -> int:
    if isinstance(ev, StartFailed):
        return 127  # the shell's "command not found"
    if isinstance(ev, HostLost):
        return 255 if ev.code in (0, 255) else exit_code(ev.code)
    return exit_code(ev.code)


def _record(ev: Event) -> blame.FailureRecord | None:
    return ev.record if isinstance(ev, RankExit) else None


def _tier(ev: Event) -> int:
    return blame.tier(_record(ev), ev.code if isinstance(ev, RankExit) else None)


def _blamed(found: list[Event], wall: Callable[[float], float]) -> list[Event]:
    """``found`` in the order of blame: the culprit first (failures.py)."""
    return sorted(found, key=lambda e: blame.blame_key(
        _record(e), e.code if isinstance(e, RankExit) else None, wall(e.time), e.time))


def supervise(
    plan: JobPlan,
    backend: Backend,
    sink: OutputSink,
    timeout: float | None = None,
    grace: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    fail_fast: bool = True,
    events: queue.Queue[Event] | None = None,
    end_note: bool = True,
    deadline: float | None = None,
) -> Outcome:
    """Run the job to its end, its first failure (by the time it happened), its --timeout
    or a signal; tear it down; report; return the outcome. Without ``fail_fast`` (tests
    whose ranks must each report how they saw a peer fail) a failure stops nothing: the
    job runs until every rank has exited or the timeout, and the outcome is still the
    earliest failure. ``clock`` and ``events`` (the channel the backend reports on, read
    with a timeout) are the seams of the fake-clock tests, whose queue moves their clock.
    Without ``end_note`` the caller says how the job ended (``report_end``): ``steps.act``,
    which may restart it, and gives the ``deadline`` (on ``clock``) of a --timeout that
    counts over every start of the job."""
    events = queue.Queue() if events is None else events
    wall = blame.wall_clock(clock, time.time)
    remaining = {r.rank for r in plan.ranks}
    if deadline is None and timeout:
        deadline = clock() + timeout
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
            if isinstance(ev, StartFailed):  # the same program everywhere: nothing runs
                _report_cannot_start(sink, ev.program, ev.reason)
                outcome = Outcome(127)
            elif isinstance(ev, Superseded):  # one ddlrun per node: the job moved on
                sink.note(f"{ev.reason}: stopping this node's ranks")
                outcome = Outcome(0, ev, tuple(sorted(remaining)))
            elif _failed(ev) and not fail_fast:
                seen.append(ev)
            elif _failed(ev):
                failures = [ev, *_settle(events, remaining, clock() + backend.settle, clock)]
                stuck = tuple(backend.stuck(STUCK_ASK))
                # a stopped rank is the cause its peers failed on: none to wait for
                if not stuck and all(_tier(e) != blame.ROOT for e in failures):
                    failures += _settle(events, remaining, clock() + CAUSE_WAIT, clock,
                                        until=lambda e: _tier(e) == blame.ROOT)
                failures = _blamed(failures, wall)
                stuck = tuple(s for s in stuck if s.rank in remaining)
                asked = _ask_flight(plan, backend, remaining)
                lagging = None if stuck else _lagging(failures, asked, sink)
                outcome = Outcome(_code(failures[0]), failures[0], tuple(sorted(remaining)),
                                  stuck)
                _report_failure(plan, backend, sink, failures, stuck, lagging)
                _report_flight(plan, backend, sink, {
                    e.rank: e.record.flight for e in failures
                    if isinstance(e, RankExit) and e.record is not None}, asked)
        if outcome is None and seen:
            first = _blamed(seen, wall)[0]
            outcome = Outcome(_code(first), first)
    except OSError as exc:  # the program could not be started at all (the fork failed)
        _report_cannot_start(sink, exc.filename or plan.program[0], exc.strerror)
        outcome = Outcome(127)
    except Interrupted as exc:
        sink.note(f"{exc}: stopping all ranks")
        outcome = Outcome(128 + exc.signum)
    finally:
        with signals_deferred() as late:
            backend.close(grace)
            diagnose.tidy(diagnose.flight_folder(plan.job_id))  # what killed ranks left
    outcome = outcome or Outcome(0)
    if late:
        outcome = replace(outcome, late_signal=late[0])
    if end_note:
        report_end(plan, sink, outcome)
    return outcome


def report_end(plan: JobPlan, sink: OutputSink, outcome: Outcome) -> None:
    if outcome.code not in (0, 127):
        sink.note(f"job {plan.job_id} ended with exit code {outcome.code}; if a host kept its "
                  "shared memory: ddlrun --cleanup there (it removes what no process maps)")


def _account(ev: Event, remaining: set[int]) -> None:
    if isinstance(ev, RankExit):
        remaining.discard(ev.rank)
    elif isinstance(ev, JobExit):
        remaining.clear()


def _settle(events: queue.Queue, remaining: set[int], end: float,
            clock: Callable[[], float], until: Callable[[Event], bool] | None = None
            ) -> list[Event]:
    """The failures heard of until ``end`` (or until every rank has exited, or one for
    which ``until`` is true has come)."""
    found = []
    while remaining and (left := end - clock()) > 0:
        try:
            ev = events.get(timeout=left)
        except queue.Empty:
            break
        _account(ev, remaining)
        if _failed(ev):
            found.append(ev)
            if until is not None and until(ev):
                break
    return found


@contextlib.contextmanager
def signals_deferred() -> Iterator[list[int]]:
    """While tearing down, a (second) Ctrl-C must not abort the teardown half way: the
    signals that come are kept in the list yielded, for the caller to act on after it."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    pending: list[int] = []

    def keep(signum, frame):
        pending.append(signum)

    try:
        old = {s: signal.signal(s, keep) for s in sigs}
    except ValueError:  # not the main thread
        yield pending
        return
    try:
        yield pending
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _report_cannot_start(sink: OutputSink, program: str, reason: str | None) -> None:
    sink.note(f"cannot start {program!r}: {reason}")


def _host(plan: JobPlan, index: int) -> str:
    return plan.hosts[index].host.name


def _report_stuck(plan: JobPlan, sink: OutputSink, stuck: tuple[Stuck, ...],
                  failed: RankExit | None) -> None:
    """Stopped ranks first: their peers' errors are only the consequence."""
    for i, s in enumerate(stuck):
        states = STARTING_STATES if s.starting else STUCK_STATES
        what = (f"rank {s.rank} on host {_host(plan, s.host_index)} (pid {s.pid}) is "
                f"{states.get(s.state, f'in state {s.state}')}")
        if i:
            sink.note(f"{what} too")
        elif failed is not None:
            sink.note(f"{what}: it is the likely cause; rank {failed.rank} failed waiting for "
                      "it")
        else:
            sink.note(f"{what}: it is the likely cause")


def _lagging(failures: list[Event], asked: Asked, sink: OutputSink
             ) -> tuple[int, dict, str] | None:
    """A rank still running that the flight recorders show as the one the others wait on,
    when no failed rank reported a cause of its own: the likely cause (a rank stuck in
    I/O, a debugger or a deadlock raises nothing; one stuck outside Python answers with its
    C-level stack only). With its dump ({} when it did not answer) and why it is named."""
    if any(_tier(e) == blame.ROOT for e in failures):
        return None
    try:
        dumps, signalled = asked
        flights = {e.rank: e.record.flight for e in failures
                   if isinstance(e, RankExit) and e.record is not None}
        flights.update(dumps)
        waited = flight_report.waited_on(flights)
        late = flight_report.behind(flights)
        for rank in (*waited, *late, *sorted(signalled - set(dumps))):
            if rank not in signalled:
                continue
            if rank not in dumps:
                why = "did not answer the flight recorder (stuck outside Python?)"
            elif rank in late:
                why = "is behind on the job's collectives"
            else:
                why = "is the rank the others waited on"
            return rank, dumps.get(rank, {}), why
    except Exception as exc:  # noqa: BLE001 - a diagnosis must not break the report
        sink.note(f"(the flight recorders' diagnosis failed: {exc!r})")
    return None


def _report_failure(plan: JobPlan, backend: Backend, sink: OutputSink, failures: list[Event],
                    stuck: tuple[Stuck, ...], lagging: tuple[int, dict, str] | None = None
                    ) -> None:
    """``failures`` in the order of blame: the culprit first; ``lagging``: a running rank
    the flight recorders show behind (the likely cause when no rank reported one)."""
    first = failures[0]
    if isinstance(first, StartFailed):
        _report_cannot_start(sink, first.program, first.reason)
        return
    if isinstance(first, JobExit):
        sink.note(f"{backend.name} {describe_code(first.code)}")
        for line in sink.tail(-1)[-10:]:
            sink.note(f"  | {line}")
        _report_records(plan, backend, sink)
        return
    _report_stuck(plan, sink, stuck, first if isinstance(first, RankExit) else None)
    cwd = backend.opts.cwd or os.getcwd()
    if lagging is not None:
        rank, dump, why = lagging
        host = next((_host(plan, r.host_index) for r in plan.ranks if r.rank == rank), "?")
        at = flight_report.where(dump or {"at": diagnose.read_stacks_frame(
            diagnose.flight_folder(plan.job_id), rank)}, cwd)
        pid = dump.get("pid") or backend.pids().get(rank, "?")
        waiting = f"; rank {first.rank} failed waiting for it" if isinstance(
            first, RankExit) else ""
        sink.note(f"rank {rank} on host {host} (pid {pid}) {why} and still running"
                  f"{', at ' + at if at else ''}: it is the likely cause{waiting}")
    if isinstance(first, HostLost):
        sink.note(f"{first.message}; stopping the job")
    else:
        _report_rank(plan, backend, sink, first, explained=bool(stuck) or lagging is not None)
    # SIGTERM is what teardowns send (an agent stops its host's ranks on a failure there)
    later = [e for e in failures[1:] if isinstance(e, RankExit)
             and (e.code != -signal.SIGTERM or e.record is not None)]
    for e in later:
        if e.record is not None and not e.record.after_peer:
            sink.note(f"rank {e.rank} on host {_host(plan, e.host_index)} (pid {e.pid}) failed "
                      f"too, later: {e.record.summary(cwd)} ({describe_code(e.code)})")
    later = [e for e in later if e.record is None or e.record.after_peer]
    if later:
        if stuck:
            cause = f"rank {stuck[0].rank}"
        elif lagging is not None:
            cause = f"rank {lagging[0]}"
        elif isinstance(first, RankExit):
            cause = f"rank {first.rank}"
        else:
            cause = f"host {_host(plan, first.host_index)}"
        names = ", ".join(f"rank {e.rank} ({describe_code(e.code)})" for e in later)
        sink.note(f"then {names}: follow-on failures of {cause} (their output is above)")


def _report_rank(plan: JobPlan, backend: Backend, sink: OutputSink, ev: RankExit,
                 explained: bool = False) -> None:
    """``explained``: a stopped rank was named as the cause already."""
    where = f"rank {ev.rank} on host {_host(plan, ev.host_index)} (pid {ev.pid})"
    if ev.record is None:
        sink.note(f"{where} {describe_code(ev.code)}; stopping the other ranks")
    else:
        sink.note(f"{where} failed: {ev.record.summary(backend.opts.cwd or os.getcwd())} "
                  f"({describe_code(ev.code)}); stopping the other ranks")
        if ev.record.after_peer and not explained and plan.world_size > len(plan.ranks):
            # one ddlrun per node: the others' ranks are not this ddlrun's to hear of
            sink.note(f"rank {ev.rank} failed because another rank did, and no rank of this "
                      "node reported a cause: look at the other nodes' ddlrun")
        elif ev.record.after_peer and not explained:
            sink.note(f"rank {ev.rank} failed because another rank did, but no rank reported "
                      "a cause of its own (one that ran on without error, or was stopped?)")
    backend.wait_output(ev.rank, OUTPUT_DRAIN)
    tail = sink.tail(ev.rank)
    if tail:
        sink.note(f"last {len(tail)} line(s) of rank {ev.rank}:")
        for line in tail:
            sink.note(f"  | {line}")
    logs = sink.logs.get(ev.rank)
    if logs:
        sink.note(f"logs: {logs.stdout} {logs.stderr}")


Asked = tuple[dict[int, dict], set[int]]  # (dumps by rank, ranks signalled)


def _ask_flight(plan: JobPlan, backend: Backend, remaining: set[int]) -> Asked:
    """The flight recorders of the ranks still running on this host, asked before they
    are stopped: a rank that is stuck, not failed, says where it is."""
    pids = {r: p for r, p in backend.pids().items() if r in remaining}
    if not pids:
        return {}, set()
    return diagnose.ask(pids, diagnose.flight_folder(plan.job_id))


def _report_flight(plan: JobPlan, backend: Backend, sink: OutputSink,
                   flights: dict[int, dict | None], asked: Asked = ({}, set())) -> None:
    """What the ranks' flight recorders say: who is behind, at which collective."""
    if plan.world_size < 2:
        return
    dumps, signalled = asked
    try:
        local = diagnose.flight_folder(plan.job_id) if signalled else None
        lines = diagnose.report(flights, dumps, plan.world_size, local,
                                backend.opts.cwd or os.getcwd(), signalled)
    except Exception as exc:  # noqa: BLE001 - a diagnosis must not break the report
        lines = [f"(the diagnosis failed: {exc!r})"]
    if lines:
        sink.note("flight recorder: " + lines[0])
        for line in lines[1:]:
            sink.note(f"  {line}")


def _report_records(plan: JobPlan, backend: Backend, sink: OutputSink) -> None:
    """Under a launcher that is one process (mpirun, srun): the records its ranks left
    where ddlrun can read them (``Backend.records``) name the root cause."""
    found = backend.records()
    if not found:
        return
    ranks = sorted(found, key=lambda r: blame.blame_key(found[r], None, 0.0, 0.0))
    cwd = backend.opts.cwd or os.getcwd()
    host_of = {r.rank: r.host_index for r in plan.ranks}
    rank, record = ranks[0], found[ranks[0]]
    host = _host(plan, host_of[rank]) if rank in host_of else "?"
    note = (" (it failed because another rank did; no rank whose record ddlrun could read "
            "reported a cause of its own)" if record.after_peer else "")
    sink.note(f"rank {rank} on host {host} failed first: {record.summary(cwd)}{note}")
    after = sorted(r for r in ranks[1:] if found[r].after_peer)
    if after:
        names = ", ".join(f"rank {r}" for r in after)
        sink.note(f"then {names}: follow-on failures of rank {rank} (their output is above)")
    _report_flight(plan, backend, sink, {r: rec.flight for r, rec in found.items()})


def _report_timeout(plan: JobPlan, sink: OutputSink, timeout: float | None,
                    ranks: tuple[int, ...]) -> None:
    host_of = {r.rank: r.host_index for r in plan.ranks}
    names = ", ".join(f"{r} ({_host(plan, host_of[r])})" for r in ranks)
    sink.note(f"--timeout {timeout:g}s reached; ranks still running: {names}; stopping them")
