"""A worker's link to ddlrun's elastic driver: a client of the driver's store (ddl's own
rendezvous store, guarded by the job's secret), named by ``DDL_ELASTIC_STORE``.

The keys, written by the driver unless said otherwise:

- ``world/<g>/<worker>``: this worker's place in world ``g``, JSON: ``{"env": {...}}``
  (the launch variables ``init()`` reads: rank, size, the world's job id and rendezvous)
  or ``{"leave": "why"}``;
- ``next/<g>``: the number of the world formed after world ``g`` (written after every
  ``world/...`` key of that world); ``gen``: the newest world's number;
- ``update``: ``"<g> <removed_only>"``, the newest change of hosts, announced while the
  workers run: world ``g`` is waiting for them at their next ``check_host_updates``;
- ``reset/<worker>`` (a worker): the world it left, once it has left it, and
  ``resets/<g>``, how many left world ``g`` (ddlrun re-forms a world its workers left on
  their own: a collective timed out, a worker is stuck);
- ``formed`` (rank 0 of a new world, once every worker joined it): ``"<g>"``; ddlrun
  replaces the new workers of a world superseded before it formed;
- ``restored`` (rank 0 of a new world): ``"<commit> <g>"``, which ddlrun prints.

Outside an elastic job (no ``DDL_ELASTIC_STORE``) nothing is linked: ``active()`` is false
and there is no next world.
"""

from __future__ import annotations

import json
import threading

from .. import config, identity
from ..errors import DDLConfigError, DDLError, DDLTimeoutError
from ..rendezvous import StoreClient

_lock = threading.Lock()
_client: StoreClient | None = None
_generation: int | None = None  # the world this worker is in (from the environment first)
_needs_sync = False


def active() -> bool:
    """Whether this process is a worker of an elastic job started by ddlrun."""
    return bool(config.get("DDL_ELASTIC_STORE"))


def worker() -> str:
    return config.get("DDL_ELASTIC_WORKER") or "?"


def generation() -> int:
    """The number of the world this worker is in."""
    return config.get("DDL_ELASTIC_GENERATION") if _generation is None else _generation


def _store() -> StoreClient:
    global _client
    with _lock:
        if _client is None:
            where = config.get("DDL_ELASTIC_STORE")
            host, sep, port = where.rpartition(":")
            if not sep or not port.isdigit():
                raise DDLConfigError(f"DDL_ELASTIC_STORE={where!r}: expected HOST:PORT")
            _client = StoreClient(host.strip("[]"), int(port), identity.job_secret(),
                                  rank=-1, timeout=config.get("DDL_ELASTIC_TIMEOUT"))
        return _client


def latest_update() -> tuple[int, bool] | None:
    """The newest change of hosts ddlrun announced: (the world that waits, whether hosts
    were only removed); None when there was none or the job is not elastic."""
    if not active():
        return None
    store = _store()
    if not store.check(["update"]):
        return None
    g, _, removed = store.get("update").decode().partition(" ")
    return int(g), removed == "1"


class NoNextWorld(DDLError):
    """No world came for this worker within ``DDL_ELASTIC_TIMEOUT``: ddlrun formed none
    (the job is ending, or it could not go on). Not a lost peer: nothing to wait for."""


def next_world(timeout: float | None = None) -> dict[str, str] | None:
    """Wait for the world formed after this one and return this worker's launch variables
    in it (None: it has no place there: a world since this one told it to leave, or the
    newest has no place for it). ``NoNextWorld`` when none came in ``timeout`` seconds
    (``DDL_ELASTIC_TIMEOUT``); DDLError when the job is not elastic."""
    global _generation, _needs_sync
    if not active():
        raise DDLError("ddl: no next world: this is not an elastic job (ddlrun --min-np/"
                       "--max-np or --host-discovery-script starts one)")
    timeout = config.get("DDL_ELASTIC_TIMEOUT") if timeout is None else timeout
    store, me, left = _store(), worker(), generation()
    store.set(f"reset/{me}", str(left).encode())
    store.add(f"resets/{left}", 1)  # ddlrun sees a reset it did not cause (a timeout)
    try:
        g = int(store.get(f"next/{left}", timeout))
        g = max(g, int(store.get("gen", timeout)))
    except DDLTimeoutError:
        g = None
    if g is None:  # raised here, not in the handler: no timeout chained to it
        raise NoNextWorld(f"ddl: worker {me} waited {timeout:g} s for ddlrun's next world "
                          f"after world {left}; none came (ddlrun --elastic-timeout)")
    _generation = g
    # every world's places are written before it is announced: one that has none for this
    # worker, or told it to leave on the way, is the end of it here
    for k in range(left + 1, g + 1):
        key = f"world/{k}/{me}"
        if not store.check([key]):
            if k == g:
                return None
            continue
        place = json.loads(store.get(key))
        if "leave" in place:
            return None
    _needs_sync = bool(place.get("sync", True))
    return {str(k): str(v) for k, v in place["env"].items()}


def needs_sync() -> bool:
    """Whether the world this worker last joined has workers new to it (their state must
    come from rank 0 even when only hosts were removed as far as this worker saw)."""
    return _needs_sync


def note_formed() -> None:
    """Rank 0 of a new world, once it is up (every worker joined it): tell ddlrun."""
    if active():
        _store().set("formed", str(generation()).encode())


def note_restored(commit: int) -> None:
    """Rank 0 of a new world: tell ddlrun which commit the world goes on from."""
    if active():
        _store().set("restored", f"{commit} {generation()}".encode())
