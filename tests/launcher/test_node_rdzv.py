"""The rounds of one-ddlrun-per-node elastic jobs (ddlrun/node_rdzv.py), pure: a dict for
the store (torch's compare_set semantics) and a fake clock. Several nodes are interleaved
by running each one's ``join`` in its own thread against the same store."""

from __future__ import annotations

import threading
import time

import pytest

from ddlrun import node_rdzv as rdzv


class DictStore:
    """The four calls node_rdzv makes, with the real store's semantics, thread-safe."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def check(self, keys):
        with self.lock:
            return all(k in self.kv for k in keys)

    def get(self, key, timeout=None):
        with self.lock:
            return self.kv[key]

    def add(self, key, n):
        with self.lock:
            v = int(self.kv.get(key, b"0")) + n
            self.kv[key] = str(v).encode()
            return v

    def compare_set(self, key, expected, desired):
        with self.lock:
            cur = self.kv.get(key)
            if (cur is None and expected == b"") or cur == expected:
                self.kv[key] = desired
                return desired
            return cur if cur is not None else expected


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        time.sleep(0.002)  # the other nodes' threads get to run
        with self.lock:
            self.t += s


def join(store, me, lo, hi, clock, **kw):
    return rdzv.join(store, me, lo, hi, timeout=kw.pop("timeout", 60), last_call=kw.pop(
        "last_call", 1.0), clock=clock, sleep=clock.sleep, **kw)


def in_threads(fns):
    out, errors = {}, []

    def run(name, fn):
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(n, f)) for n, f in fns.items()]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errors, errors
    return out


def test_a_round_forms_at_once_when_max_nodes_have_joined():
    store, clock = DictStore(), Clock()
    out = in_threads({n: (lambda n=n: join(store, n, 1, 3, clock, last_call=1e9))
                      for n in ("a", "b", "c")})
    assert {r.number for r in out.values()} == {0}
    assert sorted(r.node_rank for r in out.values()) == [0, 1, 2]
    assert all(r.nnodes == 3 and r.failures == 0 for r in out.values())
    assert len({r.nodes for r in out.values()}) == 1  # one order for everyone


def test_with_min_nodes_the_round_forms_after_the_last_call():
    store, clock = DictStore(), Clock()
    r = join(store, "a", 1, 2, clock, last_call=5.0)
    assert (r.number, r.nodes, r.node_rank) == (0, ("a",), 0)
    assert clock() >= 5.0  # it waited for more nodes for the last call


def test_below_min_nodes_no_round_forms_and_the_join_times_out():
    store, clock = DictStore(), Clock()
    with pytest.raises(rdzv.RendezvousTimeout, match=r"1 node\(s\) joined, --nnodes needs "
                       "at least 2"):
        join(store, "a", 2, 3, clock, timeout=3.0)


def test_a_node_that_comes_late_waits_and_the_members_open_the_next_round():
    store, clock = DictStore(), Clock()
    first = join(store, "a", 1, 2, clock)
    done = {}
    t = threading.Thread(target=lambda: done.update(b=join(store, "b", 1, 2, clock)))
    t.start()
    while not (rdzv.read(store)["waiting"]):
        clock.sleep(0.01)
    why = rdzv.watch(store, first, max_nodes=2)
    assert why == "1 node(s) waiting to join (b)"
    again = join(store, "a", 1, 2, clock, after=first.number)
    t.join(10)
    assert again.number == done["b"].number == 1
    assert again.nodes == ("a", "b")  # the old member keeps node rank 0
    assert again.failures == 0  # joining uses no restart


def test_a_full_round_does_not_move_for_a_waiting_node():
    store, clock = DictStore(), Clock()
    r = in_threads({n: (lambda n=n: join(store, n, 2, 2, clock)) for n in ("a", "b")})["a"]
    st = rdzv.read(store)
    rdzv._swap(store, st, dict(st, waiting=["c"]))
    assert rdzv.watch(store, r, max_nodes=2) is None


def test_a_failure_opens_the_next_round_once_and_counts_one_restart():
    store, clock = DictStore(), Clock()
    out = in_threads({n: (lambda n=n: join(store, n, 2, 2, clock)) for n in ("a", "b")})
    st = rdzv.next_round(store, 0, failed=True, why="rank 3 on node 1 exited with code 3")
    assert (st["round"], st["failures"]) == (1, 1)
    assert rdzv.next_round(store, 0, failed=True)["failures"] == 1  # already moved on
    assert rdzv.watch(store, out["a"], 2) == \
        "round 1 began (rank 3 on node 1 exited with code 3)"
    again = in_threads({n: (lambda n=n: join(store, n, 2, 2, clock, after=0))
                        for n in ("b", "a")})
    assert again["a"].nodes == out["a"].nodes  # node ranks kept across the restart
    assert again["a"].failures == 1


def test_close_ends_every_join_and_the_first_close_is_kept():
    store, clock = DictStore(), Clock()
    r = join(store, "a", 1, 1, clock)
    rdzv.close(store, 3, "rank 3 failed")
    assert rdzv.close(store, 0, "every node finished")["end"] == {"code": 3,
                                                                  "why": "rank 3 failed"}
    assert rdzv.watch(store, r, 1) == "the job was ended: rank 3 failed"
    with pytest.raises(rdzv.RendezvousClosed) as exc:
        join(store, "b", 1, 2, clock)
    assert (exc.value.code, exc.value.why) == (3, "rank 3 failed")


def test_a_node_that_died_while_joining_is_dropped_before_the_round_forms():
    store, clock = DictStore(), Clock()
    # "c" joined (one heartbeat) and died: its beat never moves again
    rdzv.beat(store, "c")
    rdzv._swap(store, None, rdzv._fresh(0, 0, ["c"]))
    r = join(store, "a", 1, 3, clock, last_call=3.0)
    assert r.nodes == ("a",) and r.node_rank == 0
    assert clock() >= rdzv.STALE


def test_a_leaving_node_is_out_of_a_joining_round_and_of_the_waiting_list():
    store = DictStore()
    rdzv._swap(store, None, rdzv._fresh(0, 0, ["a", "b"]))
    rdzv.leave(store, "b")
    assert rdzv.read(store)["nodes"] == ["a"]
    st = rdzv.read(store)
    rdzv._swap(store, st, dict(st, phase="formed", waiting=["c"]))
    rdzv.leave(store, "c")
    rdzv.leave(store, "a")  # a formed round's member stays (its ranks' failure tells)
    assert rdzv.read(store)["nodes"] == ["a"] and rdzv.read(store)["waiting"] == []


def test_the_watcher_opens_no_round_for_a_dead_waiting_node_nor_after_a_node_finished():
    store, clock = DictStore(), Clock()
    r = join(store, "a", 1, 2, clock)
    st = rdzv.read(store)
    rdzv._swap(store, st, dict(st, waiting=["b"]))
    beats: dict = {}
    assert rdzv.watch(store, r, 2, beats, clock) is None  # first look: not yet alive
    assert rdzv.watch(store, r, 2, beats, clock) is None  # its beat did not move: dead
    rdzv.beat(store, "b")
    store.add("done/0", 1)
    assert rdzv.watch(store, r, 2, beats, clock) is None  # a node has finished
    del store.kv["done/0"]
    assert rdzv.watch(store, r, 2, beats, clock) == "1 node(s) waiting to join (b)"
    assert rdzv.read(store)["round"] == 1
