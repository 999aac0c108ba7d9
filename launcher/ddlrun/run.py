"""Act: start the backend, wait for the first failure (or the end, the timeout, a signal),
tear everything down, report, and return ddlrun's exit code.

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
from .events import Event, HostLost, JobExit, RankExit
from .output import OutputSink
from .plan import JobPlan

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


def supervise(
    plan: JobPlan,
    backend: Backend,
    sink: OutputSink,
    timeout: float | None = None,
    grace: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
) -> Outcome:
    events: queue.Queue[Event] = queue.Queue()
    remaining = {r.rank for r in plan.ranks}
    host_of = {r.rank: r.host_index for r in plan.ranks}
    deadline = clock() + timeout if timeout else None
    outcome: Outcome | None = None
    try:
        backend.start(plan, sink, events.put)
        while remaining:
            wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - clock()))
            try:
                ev = events.get(timeout=wait)
            except queue.Empty:
                if deadline is not None and clock() >= deadline:
                    outcome = Outcome(TIMEOUT_EXIT, None, tuple(sorted(remaining)))
                    _report_timeout(plan, sink, timeout, outcome.still_running, host_of)
                    break
                continue
            if isinstance(ev, RankExit):
                remaining.discard(ev.rank)
                if ev.code != 0:
                    outcome = Outcome(exit_code(ev.code), ev)
                    _report_rank(plan, sink, ev)
                    break
            elif isinstance(ev, HostLost):
                outcome = Outcome(255 if ev.code in (0, 255) else exit_code(ev.code), ev)
                sink.note(f"{ev.message}; stopping the job")
                break
            elif isinstance(ev, JobExit):
                remaining.clear()
                if ev.code != 0:
                    outcome = Outcome(exit_code(ev.code), ev)
                    sink.note(f"{backend.name} {describe_code(ev.code)}")
                    for line in sink.tail(-1)[-10:]:
                        sink.note(f"  | {line}")
                break
    except OSError as exc:  # the program could not be started at all
        sink.note(f"cannot start {exc.filename or plan.program[0]!r}: {exc.strerror}")
        outcome = Outcome(127)
    except Interrupted as exc:
        sink.note(f"{exc}: stopping all ranks")
        outcome = Outcome(128 + exc.signum)
    finally:
        with signals_raise_ignored():
            backend.close(grace)
    return outcome or Outcome(0)


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


def _report_rank(plan: JobPlan, sink: OutputSink, ev: RankExit) -> None:
    host = plan.hosts[ev.host_index].host.name
    sink.note(f"rank {ev.rank} on host {host} (pid {ev.pid}) {describe_code(ev.code)}; "
              "stopping the other ranks")
    tail = sink.tail(ev.rank)
    if tail:
        sink.note(f"last {len(tail)} line(s) of rank {ev.rank}:")
        for line in tail:
            sink.note(f"  | {line}")
    logs = sink.logs.get(ev.rank)
    if logs:
        sink.note(f"logs: {logs.stdout} {logs.stderr}")


def _report_timeout(plan, sink, timeout, ranks, host_of) -> None:
    names = ", ".join(f"{r} ({plan.hosts[host_of[r]].host.name})" for r in ranks)
    sink.note(f"--timeout {timeout:g}s reached; ranks still running: {names}; stopping them")
