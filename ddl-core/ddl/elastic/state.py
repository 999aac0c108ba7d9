"""What elastic training keeps across a change of the world: ``State`` (commit, restore,
sync, the host-update check every rank agrees on, reset callbacks) and ``ObjectState``
(plain Python values). The framework adapters add handlers for their objects (a torch
model and optimizer, Keras weights) over ``ObjectState``; Horovod's ``horovod.common.
elastic`` documents the behaviour these classes keep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .. import session as _session
from ..errors import DDLConfigError, HostsUpdatedInterrupt
from ..hvd import objects as _objects
from . import link as _link


class State:
    """Training state kept in host memory, committed by the program and restored when a
    collective fails because a peer was lost.

    ``bcast_object(obj, root_rank=0)`` sends rank 0's object to every rank (the adapter's
    ``broadcast_object``); ``get_rank()`` is this rank now (it changes when the world is
    re-formed)."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or _objects.broadcast_object
        self._rank = get_rank or _session.rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._commits = 0  # commit() calls so far: the number ddlrun reports when one is restored
        self._restored_commit: int | None = None

    @property
    def commits(self) -> int:
        """How many times ``commit()`` ran here (ddlrun says which one a world goes on
        from)."""
        return self._commits

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Functions to call after every reset (a rank lost or added), once the new world
        is up: for instance to scale the learning rate to the new number of ranks."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """The world was re-formed: run the reset callbacks, in the order registered."""
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: Any = None) -> None:
        """Horovod's listener hook: kept for code that calls it; the update itself is read
        from ddlrun by ``check_host_updates``."""

    def commit(self) -> None:
        """Save the state in host memory (what ``restore`` brings back), then check for
        added or removed hosts (``check_host_updates``). A commit copies the state (from a
        GPU too), so commit every few batches rather than every one: what a lost rank
        costs is the steps since the last commit."""
        self.save()
        self._commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank together when ddlrun announced a
        change of hosts (a world formed after this one waits): rank 0's view is
        broadcast, so no rank goes on alone. Outside an elastic job nothing changes."""
        pending, removed_only = False, True
        if self._rank() == 0:
            update = _link.latest_update()
            if update is not None and update[0] > _link.generation():
                pending, removed_only = True, update[1]
        pending, removed_only = self._bcast_object((pending, removed_only))
        if pending:
            raise HostsUpdatedInterrupt(skip_sync=removed_only)

    def restored(self) -> None:
        """``restore`` brought back the last commit: say so to ddlrun (rank 0, after the
        world is re-formed), which prints one line."""
        self._restored_commit = self._commits

    def announce(self) -> None:
        """After a reset: rank 0 tells ddlrun which commit the new world goes on from."""
        if self._restored_commit is not None and self._rank() == 0:
            _link.note_restored(self._restored_commit)
        self._restored_commit = None

    def save(self) -> None:
        """Copy the state to host memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Bring back the last commit, undoing what changed since."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's (new ranks get it this way)."""
        raise NotImplementedError


class ObjectState(State):
    """State of plain Python values, given as keyword arguments and kept as attributes:
    ``ObjectState(epoch=0, batch=0)`` then ``state.epoch += 1``."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        taken = sorted(k for k in kwargs if hasattr(type(self), k))
        if taken:
            raise DDLConfigError(f"{type(self).__name__}: {', '.join(taken)} would hide the "
                                 "state's own method or attribute; give the value another name")
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)
