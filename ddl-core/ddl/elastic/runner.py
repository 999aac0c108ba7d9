"""The elastic training loop (``@hvd.elastic.run``): run the program's function with its
state; when a collective fails because a peer was lost, restore the last commit; when
hosts were added or removed, keep the state; either way re-form the world in place (leave
the old one, take this worker's place in ddlrun's next world, join it) and call the
function again from the state. The same loop serves every framework: the adapters only
say how to save and restore their objects (``State`` subclasses).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .. import config, failures
from .. import session as _session
from ..errors import HorovodInternalError, HostsUpdatedInterrupt
from ..hvd import lifecycle as _lifecycle
from . import link as _link
from .state import State

_log = logging.getLogger("ddl")
F = TypeVar("F", bound=Callable[..., Any])


def _lost_peer(exc: BaseException) -> bool:
    """A collective failed because a peer was lost: ddl's own error, or a framework's
    error that carries one on (TensorFlow re-raises ops' errors as its own types). Never
    the end of the waiting for a next world."""
    if isinstance(exc, _link.NoNextWorld):
        return False
    return isinstance(exc, HorovodInternalError) or failures.after_peer(exc)


def reset() -> None:
    """Leave this world and join the next one ddlrun forms: its place (rank, size, the
    job's new id and rendezvous) comes as environment variables, which ``init()`` reads.
    A worker that has no place in it (its host was removed) leaves with exit code 0."""
    _lifecycle.shutdown()
    env = _link.next_world()
    if env is None:
        _log.warning("ddl: worker %s has no place in the new world: leaving", _link.worker())
        raise SystemExit(0)
    os.environ.update(env)
    _lifecycle.init()


def run_fn(func: F, reset: Callable[[], None]) -> F:
    """Horovod's loop, with ``reset`` as the way to the next world."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except Exception as exc:
                if not _lost_peer(exc) or not _link.active():
                    raise  # a bug of the program, or no ddlrun to re-form the world
                _log.warning("ddl: a peer was lost (%s); restoring the last commit",
                             failures.reason(exc))
                state.restore()
                state.restored()
                skip_sync = False
            _reset_until_joined(reset)
            if _link.needs_sync():  # new workers came into this world: they need the state
                skip_sync = False
            if _session.rank() == 0:
                _link.note_formed()
            state.on_reset()
            state.announce()

    return wrapper  # type: ignore[return-value]


def _reset_until_joined(reset: Callable[[], None]) -> None:
    """A new world can fail to form (another worker was lost while it met): then wait for
    the next one, as long as ddlrun forms them, and for ``DDL_ELASTIC_TIMEOUT`` at most in
    all."""
    deadline = time.monotonic() + config.get("DDL_ELASTIC_TIMEOUT")
    while True:
        try:
            reset()
            return
        except Exception as exc:
            if not _lost_peer(exc) or not _link.active() or time.monotonic() > deadline:
                raise
            _log.warning("ddl: the new world did not form (%s); waiting for the next",
                         failures.reason(exc))


def run(func: F) -> F:
    """Decorator of the elastic training function ``func(state, ...)``: runs it on every
    worker, and after the loss of a peer (the last commit restored) or a change of hosts
    (the state kept) re-forms the world in place and runs it again from the state, which
    is first synchronised from rank 0 (so new workers get it). Collectives belong inside
    ``func``, not around the call: a new worker starts in ``func``'s sync."""
    return run_fn(func, reset)
