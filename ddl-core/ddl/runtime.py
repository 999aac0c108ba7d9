"""Ordering and asynchrony: one background worker runs queued collectives in submission
order (every rank submits in the same order, so every rank runs them in the same order).
A blocking call made while nothing is queued runs on the caller's thread, which keeps small
messages free of a thread hand-off."""

from __future__ import annotations

import abc
import collections
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from . import flight as _fl
from . import timeline as _tl
from .errors import DDLError, DDLTimeoutError

_log = logging.getLogger("ddl")
_clock = _fl.clock
_DONE_UNTIMED = _fl.DONE_UNTIMED

_waiting = [0]  # threads blocked in QueuedHandle.wait(): their cores are idle
_waiting_lock = threading.Lock()


class Latch:
    """A one-shot ``threading.Event`` (``set``, ``is_set``, ``wait``) made of one lock, held
    from birth until ``set``: an Event builds a Condition, 2 us per handle, on every async
    call; this costs a lock. A waiter that gets the lock hands it straight back, so every
    waiter passes."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            try:
                self._lock.release()
            except RuntimeError:  # a second set() racing the first: idempotent, as Event's
                pass

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        try:
            if not self._lock.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
                return False
        except BaseException:
            # Ctrl-C between the acquire and here: hand the lock on all the same, or the
            # other threads waiting on this handle would wait forever
            if self._set:
                self._release()
            raise
        self._release()
        return True

    def _release(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # not held (a KeyboardInterrupt came before the acquire)
            pass


def callers_waiting() -> bool:
    """Whether some thread is blocked waiting for queued work (so the worker running it
    may spin on a core that would otherwise idle)."""
    return _waiting[0] > 0


class Handle(abc.ABC):
    """The one handle type of ddl: what every ``*_async`` call returns, in the core and in
    every adapter. ``wait(timeout)`` returns the result (or raises the call's error; a
    ``DDLTimeoutError`` after ``timeout`` seconds, forever by default), ``poll()`` says
    whether it is ready, so ``ddl.synchronize``/``ddl.poll`` and every adapter's
    ``hvd.synchronize``/``hvd.poll`` take any of them. The kinds: :class:`QueuedHandle`
    (queued work, ``ddl.*_async``), ``ddl.hvd.negotiate.Handle`` (a Horovod-level call, its
    result post-processed on ``wait()``), ``ddl.hvd.named.NamedHandle`` (a call matched by
    name) and torch's sparse allreduce handle."""

    __slots__ = ("name",)

    def __init__(self, name: str = "") -> None:
        self.name = name

    @abc.abstractmethod
    def poll(self) -> bool:
        """Whether the call has finished (``wait()`` would return at once)."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> Any:
        """The call's result, once it has finished; raises its error."""

    def __repr__(self) -> str:
        state = "done" if self.poll() else "pending"
        return f"<ddl.Handle {self.name or '?'} {state}>"


class QueuedHandle(Handle):
    """The handle of work queued on the runtime: finished by the worker that runs it, which
    then runs its done-callbacks."""

    __slots__ = ("_done", "_result", "_error", "_callbacks", "_cb_lock")

    def __init__(self, name: str = ""):
        super().__init__(name)
        self._done = Latch()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[QueuedHandle], None]] = []
        self._cb_lock = threading.Lock()

    def poll(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done.is_set():
            with _waiting_lock:
                _waiting[0] += 1
            try:
                done = self._done.wait(timeout)
            finally:
                with _waiting_lock:
                    _waiting[0] -= 1
            if not done:
                raise DDLTimeoutError(
                    f"{self.name or 'operation'} did not finish within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[[QueuedHandle], None]) -> None:
        """Call ``fn(handle)`` once the operation has finished: at once if it has, else on
        the thread that finishes it (ddl's worker), so keep ``fn`` short."""
        with self._cb_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        with self._cb_lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a caller's callback must not kill the worker: say so, go on
                _log.exception("ddl: a done-callback of %s raised", self.name or "an operation")


# A flight recorder entry is ddl.flight's list [SEQ, NAME, WHAT, QUEUED, STARTED, ENDED,
# ERROR]; the hot path below writes it by literal index (4 started, 5 ended, 6 error), and
# a call run on the caller's thread ends with _fl.DONE_UNTIMED: one clock read a call.
def _fl_failed(e: list, exc: BaseException) -> None:
    e[5], e[6] = _clock(), type(exc).__name__
    _fl.on_failure(exc)


class Runtime:
    """``queue`` names this runtime's collectives in the flight recorder ("job", or the
    group's ranks): each queue numbers its own calls, the same way on every member."""

    def __init__(self, queue: str = "job") -> None:
        self._seq = itertools.count()  # the flight recorder's numbers of this queue's calls
        self._fr = _fl.slots(queue)
        self._engine_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[QueuedHandle, Callable[[], Any], list | None]] = \
            collections.deque()
        self._busy = 0  # queued or running
        self._finishing = 0  # done, its handle's callbacks running
        self._thread: threading.Thread | None = None
        self._closed = False

    def busy_when_settled(self, timeout: float = 0.01) -> int:
        """Jobs queued or running (a job counts until its handle's callbacks have run),
        once no job is between its handle being done and its callbacks having run: that is
        when a thread waiting for it wakes up, and the callbacks (a Work's result copies)
        may still touch its tensors. Waits up to ``timeout`` for that."""
        with self._cv:
            self._cv.wait_for(lambda: self._finishing == 0, timeout)
            return self._busy

    def run(self, fn: Callable[[], Any], name: str = "", what: Any = None) -> Any:
        """Run ``fn`` (a collective named ``name``; ``what`` describes its tensor for the
        flight recorder) behind the earlier queued work, on this thread when none is
        queued."""
        # An unlocked read is enough: only this thread's own earlier submits matter for
        # ordering, and those are counted before submit() returns.
        if self._busy == 0:
            with self._engine_lock:
                traced = _tl.recorder is not None or _tl.torch_profiler() is not None
                fr = self._fr
                if fr is None:
                    return _tl.inline(fn, name) if traced else fn()
                t = _clock()
                e = [next(self._seq), name, what, t, t, 0.0, None]
                fr.append(e)
                try:
                    out = _tl.inline(fn, name) if traced else fn()
                except BaseException as exc:
                    _fl_failed(e, exc)
                    raise
                e[5] = _DONE_UNTIMED
                return out
        return self.submit(fn, name, what).wait()

    def submit(self, fn: Callable[[], Any], name: str = "", what: Any = None) -> QueuedHandle:
        h = QueuedHandle(name)
        if _tl.recorder is not None or _tl.torch_profiler() is not None:
            fn = _tl.queued(fn, name, cycle=self._busy == 0)
        with self._cv:
            if self._closed:
                raise DDLError("ddl was shut down; call ddl.init() again")
            e = None
            if self._fr is not None:
                e = [next(self._seq), name, what, _clock(), 0.0, 0.0, None]
                self._fr.append(e)
            self._queue.append((h, fn, e))
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ddl-runtime", daemon=True)
                self._thread.start()
            self._cv.notify()
        return h

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                h, fn, e = self._queue.popleft()
            error = None
            try:
                with self._engine_lock:
                    if e is not None:
                        e[4] = _clock()
                    result = fn()
                if e is not None:
                    e[5] = _clock()
            except BaseException as exc:  # handed to whoever waits on the handle
                error, result = exc, None
                if e is not None:
                    _fl_failed(e, exc)
            with self._cv:
                self._finishing += 1
            h._finish(result, error)
            with self._cv:
                self._busy -= 1
                self._finishing -= 1
                self._cv.notify_all()

    def drain(self) -> None:
        with self._cv:
            while self._busy:
                self._cv.wait(0.1)

    def close(self) -> None:
        self.drain()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
