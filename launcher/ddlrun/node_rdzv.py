"""torchrun's dynamic rendezvous among ddlruns, one per node (``--nnodes MIN:MAX``,
``--max-restarts``): which nodes form each round of the job, and when a round ends.

The whole state is one JSON value under one key of a store (ddl's own, served by the
ddlrun on the ``--rdzv-endpoint`` host), changed only by compare-and-set, so every node
sees the same rounds in the same order:

- ``round``: the round's number (0 first); each round is a new start of every worker;
- ``phase``: ``joining`` (nodes add themselves, up to MAX), ``formed`` (the members run;
  nodes that come now wait in ``waiting`` for the next round) or ``closed`` (the job has
  ended; ``end`` says how);
- ``nodes``: the members (a member's index is its node rank): those of the last round in
  their order, then the newcomers in the order they joined;
- ``failures``: how many restarts failures have used, over the whole job (a membership
  change uses none, as in torchrun);
- ``end``: ``{"code": N, "why": "..."}`` once closed.

A round is formed when MAX nodes have joined, or MIN have and ``last_call`` seconds have
passed since this node saw MIN (torchrun's last call), measured on each node's own clock:
whichever node's timer ends first forms it for all. A member leaves its round when the round
moves on (a failure elsewhere, or a node waiting while the round has fewer than MAX nodes:
the member that sees it opens the next round) or is closed (:func:`watch`).

The store is an argument (``get``/``compare_set``/``check``/``add``/``set``), and the clock
and sleep too, so the tests drive it with a dict and a fake clock.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STATE = "state"
POLL = 0.1  # seconds between looks at the state while joining
STALE = 2.0  # seconds without a heartbeat after which a joined or waiting node is gone


class RendezvousClosed(Exception):
    """The job has ended (``end``: its exit code and why), so no round will come."""

    def __init__(self, end: dict[str, Any]) -> None:
        super().__init__(end.get("why", "the rendezvous is closed"))
        self.code = int(end.get("code", 1))
        self.why = str(end.get("why", "the rendezvous is closed"))


class RendezvousTimeout(Exception):
    """No round formed with this node within the join timeout."""


@dataclass(frozen=True)
class Round:
    """A formed round as one node sees it."""

    number: int
    node_rank: int
    nodes: tuple[str, ...]
    failures: int

    @property
    def nnodes(self) -> int:
        return len(self.nodes)


def read(store: Any) -> dict[str, Any] | None:
    """The state, or None before the first node has created it."""
    if not store.check([STATE]):
        return None
    return json.loads(store.get(STATE))


def _swap(store: Any, old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Replace ``old`` by ``new`` if nobody changed it since it was read."""
    expected = b"" if old is None else json.dumps(old, sort_keys=True).encode()
    desired = json.dumps(new, sort_keys=True).encode()
    return store.compare_set(STATE, expected, desired) == desired


def _fresh(number: int, failures: int, nodes: list[str], why: str = "") -> dict[str, Any]:
    return {"round": number, "phase": "joining", "nodes": nodes, "waiting": [],
            "failures": failures, "end": None, "why": why, "prev": []}


def join(store: Any, me: str, min_nodes: int, max_nodes: int, *, timeout: float,
         last_call: float, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep,
         after: int = -1) -> Round:
    """Take part in the next round that forms with this node (a round numbered above
    ``after``) and return it; ``RendezvousClosed`` when the job ended, ``RendezvousTimeout``
    after ``timeout`` seconds without a round."""
    deadline = clock() + timeout
    min_seen: tuple[int, float] | None = None  # (round, when this node saw MIN joined)
    beats: dict[str, tuple[int, float]] = {}  # node: (its beat count, when it last moved)
    checked = -STALE
    last_beat = -STALE
    while True:
        last_beat = beat_if_due(store, me, last_beat, clock)
        st = read(store)
        if st is None:
            if _swap(store, None, _fresh(0, 0, [me])):
                continue
            continue
        if st["phase"] == "closed":
            raise RendezvousClosed(st["end"] or {})
        nodes, number = st["nodes"], st["round"]
        if number <= after and st["phase"] == "formed" and me not in st["waiting"]:
            new = dict(st, waiting=[*st["waiting"], me])  # the old round still runs
            _swap(store, st, new)
        elif st["phase"] == "joining" and me not in nodes and number > after:
            if len(nodes) < max_nodes:
                _swap(store, st, dict(st, nodes=[*nodes, me],
                                      waiting=[w for w in st["waiting"] if w != me]))
                continue
            if me not in st["waiting"]:
                _swap(store, st, dict(st, waiting=[*st["waiting"], me]))
        elif st["phase"] == "joining" and me in nodes:
            gone: list[str] = []
            if clock() - checked >= STALE / 4:  # a look at each member's heartbeat
                checked = clock()
                gone = stale(store, [n for n in nodes if n != me], beats, clock)
            if gone:  # joined, then died (killed while waiting): not a member
                _swap(store, st, dict(st, nodes=[n for n in nodes if n not in gone]))
                continue
            if len(nodes) >= min_nodes:
                if min_seen is None or min_seen[0] != number:
                    min_seen = (number, clock())
                if len(nodes) >= max_nodes or clock() - min_seen[1] >= last_call:
                    _swap(store, st, dict(st, phase="formed", nodes=_ordered(st)))
                    continue
        elif st["phase"] == "formed" and me in nodes and number > after:
            return Round(number, nodes.index(me), tuple(nodes), int(st["failures"]))
        elif st["phase"] == "formed" and me not in nodes and me not in st["waiting"]:
            _swap(store, st, dict(st, waiting=[*st["waiting"], me]))
            continue
        if clock() >= deadline:
            have = len(nodes) if st["phase"] == "joining" else 0
            raise RendezvousTimeout(
                f"no round formed within {timeout:g}s (round {number}: {have} node(s) "
                f"joined, --nnodes needs at least {min_nodes}); the other nodes' ddlruns "
                "did not come (join_timeout in --rdzv-conf sets the limit)")
        sleep(POLL)


def _ordered(st: dict[str, Any]) -> list[str]:
    """The members in node-rank order: the last round's in their old order (their ranks
    move only to close a gap), then the newcomers as they joined."""
    prev, nodes = st.get("prev") or [], st["nodes"]
    return sorted(nodes, key=lambda n: (prev.index(n) if n in prev else len(prev),
                                        nodes.index(n)))


def beat(store: Any, me: str) -> None:
    """This node is alive: its beat counter moves while it joins or waits, while its ranks
    run, while it waits on a failed round and at the exit barrier (no clock is shared
    between hosts, so liveness is a counter that moves, not a time)."""
    store.add(f"beat/{me}", 1)


def beat_if_due(store: Any, me: str, last: float,
                clock: Callable[[], float] = time.monotonic) -> float:
    """Beat when ``STALE / 8`` seconds have passed since ``last`` (this node's last beat);
    returns the time of its last beat."""
    now = clock()
    if now - last < STALE / 8:
        return last
    beat(store, me)
    return now


def stale(store: Any, nodes: list[str], beats: dict[str, tuple[int, float]],
          clock: Callable[[], float]) -> list[str]:
    """The ``nodes`` whose beat has not moved for ``STALE`` seconds of this node's clock
    (``beats`` remembers what this node saw, between calls)."""
    now, gone = clock(), []
    for n in nodes:
        count = store.add(f"beat/{n}", 0)
        if n not in beats or beats[n][0] != count:
            beats[n] = (count, now)
        elif now - beats[n][1] >= STALE:
            gone.append(n)
    return gone


def leave(store: Any, me: str) -> None:
    """This node goes (its ddlrun stops): out of a round still joining, and out of the
    waiting list, so that no round forms with it. A formed round's members find out by
    their ranks' failure."""
    while True:
        st = read(store)
        if st is None or st["phase"] == "closed":
            return
        nodes = st["nodes"] if st["phase"] == "formed" else [n for n in st["nodes"] if n != me]
        waiting = [w for w in st["waiting"] if w != me]
        if nodes == st["nodes"] and waiting == st["waiting"]:
            return
        if _swap(store, st, dict(st, nodes=nodes, waiting=waiting)):
            return


def next_round(store: Any, number: int, *, failed: bool, why: str = "") -> dict[str, Any]:
    """Open round ``number + 1`` (its members join anew; a ``failed`` round uses one
    restart; ``why`` is for the other nodes to say), unless another node already moved past
    ``number`` or closed the job. Returns the state after."""
    while True:
        st = read(store)
        if st is None or st["round"] != number or st["phase"] == "closed":
            return st or {}
        new = dict(_fresh(number + 1, int(st["failures"]) + int(failed), [], why),
                   prev=st["nodes"])
        if _swap(store, st, new):
            return new


def close(store: Any, code: int, why: str, number: int | None = None) -> dict[str, Any]:
    """End the job for every node: no round forms again. The first close is kept; with
    ``number``, only while round ``number`` is the current one (a node that decided to end
    the job from what it saw of that round yields to one that moved it on meanwhile)."""
    while True:
        st = read(store)
        if st is not None and st["phase"] == "closed":
            return st
        if st is not None and number is not None and st["round"] != number:
            return st
        new = dict(st or _fresh(0, 0, []), phase="closed", end={"code": code, "why": why})
        if _swap(store, st, new):
            return new


def watch(store: Any, rnd: Round, max_nodes: int,
          beats: dict[str, tuple[int, float]] | None = None,
          clock: Callable[[], float] = time.monotonic) -> str | None:
    """Why this node's round is over, or None while it runs: the round moved on, the job
    was closed, or live nodes wait to join while the round has room and no node has
    finished (this node then opens the next round, as torchrun's agents do when
    ``num_nodes_waiting`` is above 0). ``beats``: what this watcher saw of the waiting
    nodes' heartbeats, between calls (a waiting node that died opens no round)."""
    st = read(store)
    if st is None:
        return "the rendezvous state is gone"
    if st["phase"] == "closed":
        return f"the job was ended: {(st['end'] or {}).get('why', 'closed')}"
    if st["round"] != rnd.number:
        return f"round {st['round']} began" + (f" ({st['why']})" if st.get("why") else "")
    if st["waiting"] and len(st["nodes"]) < max_nodes:
        if store.check([f"done/{rnd.number}"]):
            return None  # a node has finished: the job ends as it is
        alive = st["waiting"]
        if beats is not None:  # only those whose heartbeat moved since this watcher saw them
            alive = []
            for w in st["waiting"]:
                count = store.add(f"beat/{w}", 0)
                if count > beats.setdefault(w, (count, clock()))[0]:
                    alive.append(w)
        if not alive:
            return None
        why = f"{len(alive)} node(s) waiting to join ({', '.join(alive)})"
        next_round(store, rnd.number, failed=False, why=why)
        return why
    return None
