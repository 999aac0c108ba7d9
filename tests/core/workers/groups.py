"""ddl.new_group: collectives among some ranks, against numpy, beside the job's own.

Groups: two disjoint halves (busy at the same time), a group in a rank order of its own,
the whole job, one rank alone, and one spanning the halves. Every collective of a group is
checked, and world collectives are interleaved with them. Prints one JSON line: checks made,
each group's engine and a digest (the test compares digests within each group).
"""

import hashlib
import json
import os

import numpy as np

import ddl

ddl.init()
R, N = ddl.rank(), ddl.size()
checks = 0
engines: dict[str, str] = {}
digests: dict[str, str] = {}


def gen(rank, dtype, count, salt):
    rng = np.random.default_rng([rank, count, salt])
    return rng.integers(-8, 9, count).astype(dtype)


def eq(got, want, what):
    global checks
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        raise SystemExit(f"rank {R}: {what}: got {got.reshape(-1)[:6]}, want "
                         f"{want.reshape(-1)[:6]}")
    checks += 1


def exercise(name, ranks):
    g = ddl.new_group(ranks)
    if R not in ranks:
        assert g is None, g
        world = ddl.allreduce(np.full(9, R, np.int64), op=ddl.Sum)  # the members' "between"
        eq(world, np.full(9, N * (N - 1) // 2, np.int64), f"{name} world, as a non-member")
        return
    assert (g.ranks, g.rank, g.size) == (tuple(ranks), ranks.index(R), len(ranks)), g
    engines[name] = g.engine.name
    h = hashlib.sha256()
    for dtype in ("int32", "float64", "float16", "uint8"):
        for count in (0, 3, 1001, 300_001):
            x = gen(R, dtype, count, 1)
            want = sum(gen(r, dtype, count, 1).astype(np.int64) for r in ranks)
            want = np.asarray(want, dtype=np.int64).astype(dtype).reshape(-1)[:count]
            got = ddl.allreduce(x, op=ddl.Sum, group=g)
            eq(got, want, f"{name} allreduce {dtype}[{count}]")
            h.update(got.tobytes())
            ddl.allreduce_(x, op=ddl.Max, group=g)
            eq(x, np.max([gen(r, dtype, count, 1) for r in ranks], axis=0).astype(dtype),
               f"{name} allreduce_ Max {dtype}[{count}]")
    y = gen(R, "float32", 70_001, 2)
    avg = ddl.allreduce(y, op=ddl.Average, group=g)
    h.update(avg.tobytes())
    parts = [gen(R, "int64", 5, 3), gen(R, "int64", 200_000, 4)]
    ddl.grouped_allreduce_(parts, op=ddl.Sum, group=g)
    eq(parts[1], sum(gen(r, "int64", 200_000, 4) for r in ranks), f"{name} grouped")
    rows = ddl.allgather(np.full((g.rank + 1, 2), R, np.int16), group=g)
    eq(rows, np.concatenate([np.full((i + 1, 2), r, np.int16) for i, r in enumerate(ranks)]),
       f"{name} allgather")
    for root in range(g.size):
        b = ddl.broadcast(gen(R, "int32", 1000, 5), root_rank=root, group=g)
        eq(b, gen(ranks[root], "int32", 1000, 5), f"{name} broadcast root={root}")
    rs = ddl.reduce_scatter(np.ones((2 * g.size + 1, 3), np.int32) * (R + 1), op=ddl.Sum,
                            group=g)
    split = ddl.split_rows(2 * g.size + 1, g.size)
    eq(rs, np.full((split[g.rank], 3), sum(r + 1 for r in ranks), np.int32), f"{name} rs")
    ddl.barrier(group=g)
    hs = [ddl.allreduce_async(np.full(7, R, np.int64), op=ddl.Sum, group=g),
          ddl.allreduce_async(np.full(9, R, np.int64), op=ddl.Sum)]  # the world's, after
    eq(hs[0].wait(), np.full(7, sum(ranks), np.int64), f"{name} async")
    eq(hs[1].wait(), np.full(9, N * (N - 1) // 2, np.int64), f"{name} world between")
    try:
        ddl.broadcast(np.zeros(1), root_rank=g.size, group=g)
    except ddl.DDLConfigError as e:
        assert "outside" in str(e)
    else:
        raise SystemExit("a root outside the group was accepted")
    digests[name] = h.hexdigest()


half = N // 2
lo, hi = list(range(half)), list(range(half, N))
exercise("lo", lo)  # the halves run concurrently
exercise("hi", hi)
exercise("reversed", list(range(N))[::-1])
exercise("world", list(range(N)))
exercise("self", [R])
exercise("across", [0, N - 1])
exercise("lo_again", lo)  # a second group of the same ranks is a different group
if N >= 3:
    # Each group has its own queue: async collectives of three groups issued in a cyclic
    # order (0: A then C, 1: B then A, 2: C then B) all complete; one queue would deadlock.
    groups = {"A": [0, 1], "B": [1, 2], "C": [0, 2]}
    made = {k: ddl.new_group(v) for k, v in groups.items()}
    order = {0: "AC", 1: "BA", 2: "CB"}.get(R, "")
    hs = [(k, ddl.allreduce_async(np.full(1000, R + 1, np.int64), op=ddl.Sum, group=made[k]))
          for k in order]
    for k, h in hs:
        eq(h.wait(), np.full(1000, sum(r + 1 for r in groups[k]), np.int64), f"cyclic {k}")
    for g in made.values():
        if g is not None:
            ddl.destroy_group(g)
            try:
                ddl.allreduce(np.ones(1), group=g)
            except ddl.DDLError as e:
                assert "released" in str(e), e
            else:
                raise SystemExit("a destroyed group still ran a collective")
for bad in ([], [0, 0], [N], "x"):
    try:
        ddl.new_group(bad)
    except ddl.DDLConfigError:
        pass
    else:
        raise SystemExit(f"new_group({bad!r}) was accepted")
try:
    ddl.allreduce(np.ones(2), group="not a group")
except ddl.DDLConfigError:
    pass
else:
    raise SystemExit("a bad group was accepted")
# a member that never comes: the others time out, naming it, and leave no segment behind
# ([0, N - 1] is the whole job, in order, when N == 2; MPI_Comm_create_group has no timeout)
if R == 0 and N >= 3 and ddl.engine_name() != "ddl/mpi":
    try:
        ddl.new_group([0, N - 1], timeout=1.5)
    except ddl.DDLTimeoutError as e:  # the shared-memory or the network rendezvous
        assert ("did not attach" in str(e) or f"[{N - 1}] did not join" in str(e)) and \
            "1.5s" in str(e), e
    else:
        raise SystemExit("new_group without its other member did not time out")
    job = ddl.api.session().world.job_id
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"ddl-{job}-") and "ctl" in f]
    assert not left, left
    checks += 1
total = ddl.allreduce(np.array([R], np.int64), op=ddl.Sum)
eq(total, np.array([N * (N - 1) // 2], np.int64), "world after the groups")
print(json.dumps({"rank": R, "checks": checks, "engines": engines, "digests": digests}))
ddl.shutdown()
