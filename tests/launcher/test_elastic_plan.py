"""Elastic world planning (pure): worked examples, then properties over 2,000 seeded
random cases and over random sequences of membership changes."""

from __future__ import annotations

import random

import pytest

from ddlrun.elastic_plan import Place, Worker, World, describe_world, plan_world


def W(name: str) -> Worker:  # noqa: N802 (reads like the names in ddlrun's output)
    host, _, slot = name.rpartition(":")
    return Worker(host, int(slot))


def ranks(world: World) -> list[str]:
    return [place.worker.name for place in world.places]


def first(hosts, alive=(), min_np=1, max_np=1000, order=(), previous=None):
    got = plan_world(dict(hosts), list(alive), min_np, max_np, list(order), previous)
    assert got is not None
    return got


# ---------------------------------------------------------------------------- examples
def test_first_world_starts_every_slot_in_host_order():
    world, start = first({"b": 2, "a": 2}, order=["a", "b"])
    assert ranks(world) == ["a:0", "a:1", "b:0", "b:1"]
    assert start == [W("a:0"), W("a:1"), W("b:0"), W("b:1")]
    assert world.hosts == ("a", "b") and world.size == 4
    assert world.places[3] == Place(W("b:1"), rank=3, local_rank=1, local_size=2,
                                    cross_rank=1, cross_size=2, host_index=1)


def test_lost_host_survivors_keep_slots_and_order():
    before, _ = first({"a": 2, "b": 2, "c": 2}, order=["a", "b", "c"])
    alive = [W("a:0"), W("a:1"), W("c:0"), W("c:1")]
    world, start = first({"a": 2, "c": 2}, alive, order=["a", "b", "c"], previous=before)
    assert ranks(world) == ["a:0", "a:1", "c:0", "c:1"]
    assert start == []
    assert [p.cross_rank for p in world.places] == [0, 0, 1, 1]
    assert world.places[2].cross_size == 2


def test_new_host_goes_after_and_its_workers_are_started():
    before, _ = first({"a": 2}, order=["a"])
    world, start = first({"z": 1, "a": 2}, ranks_alive(before), order=["a", "z"],
                         previous=before)
    assert ranks(world) == ["a:0", "a:1", "z:0"]
    assert start == [W("z:0")]


def ranks_alive(world: World) -> list[Worker]:
    return list(world.workers())


def test_host_seen_first_that_comes_back_goes_after_survivors():
    before, _ = first({"b": 1, "c": 1}, order=["a", "b", "c"])  # a was blacklisted
    world, start = first({"a": 2, "b": 1, "c": 1}, ranks_alive(before),
                         order=["a", "b", "c"], previous=before)
    assert ranks(world) == ["b:0", "c:0", "a:0", "a:1"]
    assert start == [W("a:0"), W("a:1")]


def test_refilled_slot_comes_after_the_host_survivors():
    before, _ = first({"a": 2, "b": 1}, order=["a", "b"])
    # a:0 (rank 0) died and its host stays: a:1 becomes rank 0, a new a:0 follows it
    world, start = first({"a": 2, "b": 1}, [W("a:1"), W("b:0")], order=["a", "b"],
                         previous=before)
    assert ranks(world) == ["a:1", "a:0", "b:0"]
    assert start == [W("a:0")]
    assert [p.local_rank for p in world.places] == [0, 1, 0]


def test_survivors_keep_their_previous_order_over_slot_order():
    previous = World(places=(
        Place(W("a:3"), 0, 0, 2, 0, 1, 0),
        Place(W("a:1"), 1, 1, 2, 0, 1, 0),
    ), hosts=("a",))
    world, start = first({"a": 4}, [W("a:1"), W("a:3")], order=["a"], previous=previous)
    assert ranks(world) == ["a:3", "a:1", "a:0", "a:2"]
    assert start == [W("a:0"), W("a:2")]


def test_without_previous_survivors_go_in_slot_order():
    world, _ = first({"a": 3}, [W("a:2"), W("a:1")], order=["a"])
    assert ranks(world) == ["a:1", "a:2", "a:0"]


def test_max_np_drops_new_workers_from_last_hosts_first():
    before, _ = first({"a": 2, "b": 2}, order=["a", "b"])
    world, start = first({"a": 2, "b": 2, "c": 2, "d": 2}, ranks_alive(before),
                         max_np=5, order=["a", "b", "c", "d"], previous=before)
    assert ranks(world) == ["a:0", "a:1", "b:0", "b:1", "c:0"]
    assert start == [W("c:0")]
    assert world.hosts == ("a", "b", "c")


def test_max_np_below_survivors_drops_survivors_from_the_end():
    before, _ = first({"a": 2, "b": 2}, order=["a", "b"])
    world, start = first({"a": 2, "b": 2}, ranks_alive(before), max_np=3,
                         order=["a", "b"], previous=before)
    assert ranks(world) == ["a:0", "a:1", "b:0"]
    assert start == []


def test_below_min_np_is_none():
    assert plan_world({"a": 2}, [W("a:0")], 3, 8, ["a"]) is None
    assert plan_world({}, [W("a:0")], 1, 8, ["a"]) is None


def test_survivors_on_unavailable_hosts_or_gone_slots_are_out():
    world, start = first({"a": 1}, [W("a:0"), W("a:1"), W("b:0")], order=["a", "b"])
    assert ranks(world) == ["a:0"]
    assert start == []


def test_duplicate_alive_entries_count_once():
    world, start = first({"a": 2}, [W("a:1"), W("a:1")], order=["a"])
    assert ranks(world) == ["a:1", "a:0"]
    assert start == [W("a:0")]


@pytest.mark.parametrize("min_np, max_np", [(0, 4), (5, 4)])
def test_bad_bounds(min_np, max_np):
    with pytest.raises(ValueError, match="min_np"):
        plan_world({"a": 4}, [], min_np, max_np, ["a"])


def test_describe_world():
    world, _ = first({"a": 2, "b": 2}, order=["a", "b"])
    assert describe_world(world) == "4 ranks on 2 hosts (a:2, b:2)"
    single, _ = first({"x": 1})
    assert describe_world(single) == "1 rank on 1 host (x:1)"
    assert W("[::1]:3").name == "[::1]:3"


# ---------------------------------------------------------------------------- properties
NAMES = [f"h{i}" for i in range(6)]


def _random_case(rnd: random.Random):
    hosts = {h: rnd.randint(1, 4) for h in rnd.sample(NAMES, rnd.randint(0, len(NAMES)))}
    alive = [Worker(rnd.choice(NAMES), rnd.randint(0, 4)) for _ in range(rnd.randint(0, 12))]
    order = rnd.sample(NAMES, len(NAMES))
    min_np = rnd.randint(1, 10)
    max_np = rnd.randint(min_np, 20)
    return hosts, alive, min_np, max_np, order


def check_world(hosts, alive, min_np, max_np, world: World, start: list[Worker]) -> None:
    size = world.size
    assert min_np <= size <= max_np
    assert [p.rank for p in world.places] == list(range(size))
    workers = [p.worker for p in world.places]
    assert len(set(workers)) == size
    assert all(w.host in hosts and 0 <= w.slot < hosts[w.host] for w in workers)
    assert world.hosts == tuple(dict.fromkeys(w.host for w in workers))  # contiguous
    for index, host in enumerate(world.hosts):
        mine = [p for p in world.places if p.worker.host == host]
        assert [p.local_rank for p in mine] == list(range(len(mine)))
        assert {p.local_size for p in mine} == {len(mine)}
        assert {(p.cross_rank, p.host_index, p.cross_size) for p in mine} == {
            (index, index, len(world.hosts))}
    eligible = {w for w in alive if w.host in hosts and 0 <= w.slot < hosts[w.host]}
    assert set(start) == set(workers) - eligible and len(start) == len(set(start))
    kept = set(workers) & eligible
    assert len(kept) == min(len(eligible), size)  # new workers are dropped first
    if len(eligible) <= max_np:
        assert kept == eligible
    # survivor hosts come first, a host's survivors before its new workers
    is_new = [w in set(start) for w in workers]
    for host in world.hosts:
        flags = [flag for w, flag in zip(workers, is_new, strict=True) if w.host == host]
        assert flags == sorted(flags)
    capacity = min(sum(hosts.values()), max_np)
    assert size == capacity


def test_properties_over_random_cases():
    rnd = random.Random(20261203)
    nones = 0
    for _ in range(2000):
        hosts, alive, min_np, max_np, order = _random_case(rnd)
        got = plan_world(hosts, alive, min_np, max_np, order)
        if got is None:
            assert sum(hosts.values()) < min_np
            nones += 1
            continue
        check_world(hosts, alive, min_np, max_np, *got)
    assert 0 < nones < 2000  # both outcomes were exercised


def test_rank_zero_and_survivor_order_are_stable_over_membership_changes():
    rnd = random.Random(7)
    checked = 0
    for _ in range(300):
        order = list(NAMES)
        hosts = {h: rnd.randint(1, 3) for h in rnd.sample(NAMES, 3)}
        got = plan_world(hosts, [], 1, 12, order)
        assert got is not None
        world = got[0]
        for _step in range(8):
            survivors = [w for w in world.workers() if rnd.random() > 0.2]
            hosts = {h: s for h, s in hosts.items() if rnd.random() > 0.15}
            for h in rnd.sample(NAMES, rnd.randint(0, 2)):
                hosts.setdefault(h, rnd.randint(1, 3))
            got = plan_world(hosts, survivors, 1, 12, order, previous=world)
            if got is None:
                break
            new_world, start = got
            check_world(hosts, survivors, 1, 12, new_world, start)
            staying = [w for w in world.workers() if w in set(new_world.workers())
                       and w not in set(start)]
            # the survivors' relative order is the previous one
            assert staying == [w for w in new_world.workers() if w in set(staying)]
            if world.workers()[0] in set(staying):
                assert new_world.workers()[0] == world.workers()[0]
                checked += 1
            elif staying:
                assert new_world.workers()[0] in set(staying)  # rank 0 has the state
            world = new_world
    assert checked > 100
