"""Checks every collective against numpy, on every dtype, op and an assortment of sizes.

Inputs are small integers (exact in every dtype, in any summation order), so results must
equal numpy's bit for bit; a second pass with random floats checks that every rank gets
bitwise the same bytes. Prints one JSON line: the number of checks and a digest of every
result, which the test compares across ranks.
"""

import hashlib
import json
import os
import sys

import numpy as np

import ddl

ddl.init()
R, N = ddl.rank(), ddl.size()
SIZES = [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
    0, 1, 2, 3, 7, 127, 1000, 4099, 65537, 300_001]
DTYPES = os.environ.get("CHECK_DTYPES", "").split(",") if os.environ.get("CHECK_DTYPES") else [
    "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128"]
digest = hashlib.sha256()
checks = 0


def gen(rank, dtype, count, salt, op=None):
    rng = np.random.default_rng([rank, count, salt, len(dtype)])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if op is ddl.Product:
        vals = rng.choice([1, 2] if dt.kind == "u" else [-1, 1, 2], count)
    elif dt.kind == "u":
        vals = rng.integers(0, 9, count)
    else:
        vals = rng.integers(-8, 9, count)
    out = vals.astype(dt)
    if dt.kind == "c":
        out = out + 1j * rng.integers(-8, 9, count).astype(dt)
    return out


UFUNC = {ddl.Sum: np.add, ddl.Average: np.add, ddl.Min: np.minimum, ddl.Max: np.maximum,
         ddl.Product: np.multiply}


def expect(dtype, count, salt, op):
    terms = [gen(i, dtype, count, salt, op) for i in range(N)]
    acc = terms[0].copy()
    for t in terms[1:]:
        UFUNC[op](acc, t, out=acc)
    if op is ddl.Average:
        acc = (acc / N).astype(dtype)
    return acc


def record(arr):
    global checks
    checks += 1
    digest.update(np.ascontiguousarray(arr).tobytes())


def ops_for(dtype):
    dt = np.dtype(dtype)
    ops = [ddl.Sum, ddl.Product]
    if dt.kind != "c":
        ops += [ddl.Min, ddl.Max]
    if dt.kind in "fc":
        ops.append(ddl.Average)
    return ops


def check_equal(got, want, what):
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        same = got.shape == want.shape
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:5] if same else []
        raise SystemExit(f"rank {R}: {what}: wrong result at {list(bad)}: "
                         f"got {got.reshape(-1)[bad]}, want {want.reshape(-1)[bad]}")


# allreduce: out-of-place, in-place, out=
for dtype in DTYPES:
    for op in ops_for(dtype):
        for count in SIZES:
            x = gen(R, dtype, count, 1, op)
            keep = x.copy()
            want = expect(dtype, count, 1, op)
            got = ddl.allreduce(x, op=op)
            check_equal(got, want, f"allreduce {dtype}[{count}] {op.name}")
            check_equal(x, keep, "allreduce must not modify its input")
            record(got)
            ddl.allreduce_(x, op=op)
            check_equal(x, want, f"allreduce_ {dtype}[{count}] {op.name}")
            out = np.empty_like(x)
            r = ddl.allreduce(keep, op=op, out=out)
            assert r is out
            check_equal(out, want, f"allreduce(out=) {dtype}[{count}] {op.name}")

# random floats: results differ from numpy's order, but must be identical on every rank
for dtype in ("float16", "float32", "float64"):
    for count in SIZES:
        x = np.random.default_rng([R, count, 7]).standard_normal(count).astype(dtype)
        got = ddl.allreduce(x, op=ddl.Sum)
        ref = sum(np.random.default_rng([i, count, 7]).standard_normal(count).astype(np.float64)
                  for i in range(N)) if count else np.zeros(0)
        tol = 5e-2 if dtype == "float16" else 1e-4
        if count and not np.allclose(got.astype(np.float64), ref, atol=tol * N, rtol=tol):
            raise SystemExit(f"rank {R}: random {dtype}[{count}] sum is off")
        record(got)
        avg = ddl.allreduce(x, op=ddl.Average)
        record(avg)

# large private buffers: read and written in place by the peers where the machine allows
# cross-memory copies (engines/cma.py, from MIN_BYTES), else staged
for dtype, count, op in (("float32", 2_500_001, ddl.Sum), ("int64", 1_100_003, ddl.Max)):
    x = gen(R, dtype, count, 13, op)
    want = expect(dtype, count, 13, op)
    check_equal(ddl.allreduce(x, op=op), want, f"large allreduce {dtype}[{count}]")
    ddl.allreduce_(x, op=op)
    check_equal(x, want, f"large allreduce_ {dtype}[{count}]")
    record(x)
rows = 1_000_003
x = gen(R, "float32", rows * 3, 14).reshape(rows, 3)
got = ddl.reduce_scatter(x, op=ddl.Sum)
split = ddl.split_rows(rows, N)
lo = sum(split[:R])
check_equal(got, expect("float32", rows * 3, 14, ddl.Sum).reshape(rows, 3)[lo : lo + split[R]],
            "large reduce_scatter")

# multi-dimensional shapes and a non-contiguous input
m = np.arange(6 * 5 * 4, dtype=np.int32).reshape(6, 5, 4) * (R + 1)
got = ddl.allreduce(m, op=ddl.Sum)
check_equal(got, np.arange(120, dtype=np.int32).reshape(6, 5, 4) * (N * (N + 1) // 2), "3-d")
nc = m[:, ::2, :]
got = ddl.allreduce(nc, op=ddl.Sum)
check_equal(got, (np.arange(120, dtype=np.int32).reshape(6, 5, 4) * (N * (N + 1) // 2))[:, ::2],
            "non-contiguous")
ddl.allreduce_(nc, op=ddl.Max)
check_equal(m[:, ::2, :], (np.arange(120, dtype=np.int32).reshape(6, 5, 4) * N)[:, ::2],
            "non-contiguous in place")

# shared-heap buffers (ddl.malloc): in place and into a private output
for count in SIZES:
    h = ddl.malloc((count,), np.float32)
    h[:] = gen(R, "float32", count, 3)
    want = expect("float32", count, 3, ddl.Sum)
    out = ddl.allreduce(h, op=ddl.Sum)
    check_equal(out, want, f"heap -> private [{count}]")
    ddl.allreduce_(h, op=ddl.Sum)
    check_equal(h, want, f"heap in place [{count}]")
    record(h)

# grouped (fused) allreduce: pieces of every size, staged from where they live
from ddl import api  # noqa: E402

GROUPS = [[0], [5, 0, 3], [1000, 1, 4099], [65537, 7, 300_001 - 65537 - 7], [200_000, 100_001]]
for dtype in DTYPES:
    for op in ops_for(dtype):
        for g, sizes in enumerate(GROUPS):
            total = sum(sizes)
            want = expect(dtype, total, 9 + g, op)
            whole = gen(R, dtype, total, 9 + g, op)
            cuts = np.cumsum([0] + sizes)
            parts = [whole[a:b].copy() for a, b in zip(cuts, cuts[1:])]
            ddl.grouped_allreduce_(parts, op=op)
            for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
                check_equal(parts[k], want[a:b], f"grouped_allreduce_ {dtype}{sizes} {op.name}")
            record(np.concatenate(parts))
for sizes in GROUPS[1:]:
    total = sum(sizes)
    whole = gen(R, "float32", total, 10)
    cuts = np.cumsum([0] + sizes)
    want = expect("float32", total, 10, ddl.Sum)
    for into in ("heap", "private", "aliased"):
        out = ddl.malloc((total,), np.float32) if into != "private" else np.empty(total, np.float32)
        if into == "aliased":  # the second piece already lives at its place in out
            out[:] = whole
            parts = [whole[a:b].copy() if k != 1 else out[a:b]
                     for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        else:
            parts = [whole[a:b].copy() for a, b in zip(cuts, cuts[1:])]
        keep = [p.copy() for p in parts]
        r = api.dispatch(api.plan_allreduce_into(parts, out, ddl.Sum), "into", async_=False)
        assert r is out
        check_equal(out, want, f"fused allreduce into {into} buffer {sizes}")
        for k, (p_, k_) in enumerate(zip(parts, keep)):
            if not (into == "aliased" and k == 1):
                check_equal(p_, k_, "fused allreduce into a buffer must not modify its sources")
        record(out)
# a non-contiguous piece is staged and written back; the async form keeps order
m2 = gen(R, "int64", 4000, 11).reshape(40, 100)
flat2 = gen(R, "int64", 77, 12)
h = ddl.grouped_allreduce_async_([m2[:, ::3], flat2], op=ddl.Max)
assert ddl.synchronize(h)[1] is flat2
check_equal(m2[:, ::3], expect("int64", 4000, 11, ddl.Max).reshape(40, 100)[:, ::3],
            "grouped_allreduce_ non-contiguous piece")
check_equal(flat2, expect("int64", 77, 12, ddl.Max), "grouped_allreduce_ after a strided piece")
for bad, why in (([np.zeros(3, np.float32), np.zeros(3, np.int32)], "dtypes"),
                 ([flat2, flat2[10:20]], "share memory"), ([], "no tensors")):
    try:
        ddl.grouped_allreduce_(bad, op=ddl.Sum)
    except ddl.DDLConfigError as e:
        assert why in str(e), e
    else:
        raise SystemExit(f"rank {R}: grouped_allreduce_ accepted bad input ({why})")

# allgather: equal and unequal first dimensions, several dtypes
for dtype in ("uint8", "int64", "float16", "float64", "bool"):
    for rows in (0, 1, 3, 1000):
        for unequal in (False, True):
            mine_rows = rows + (R if unequal else 0)
            x = gen(R, dtype, mine_rows * 3, 4).reshape(mine_rows, 3)
            got = ddl.allgather(x)
            want = np.concatenate([gen(i, dtype, (rows + (i if unequal else 0)) * 3, 4)
                                   .reshape(-1, 3) for i in range(N)])
            check_equal(got, want, f"allgather {dtype} rows={rows} unequal={unequal}")
            record(got)
big = gen(R, "int32", 700_001 + R, 5)
got = ddl.allgather(big)
check_equal(got, np.concatenate([gen(i, "int32", 700_001 + i, 5) for i in range(N)]),
            "allgather large")

# broadcast from every root, in place and out of place
for root in range(N):
    for dtype in ("int8", "float32", "complex128"):
        for count in (0, 5, 1_000_003):
            x = gen(R, dtype, count, 6)
            got = ddl.broadcast(x, root_rank=root)
            check_equal(got, gen(root, dtype, count, 6), f"broadcast root={root} {dtype}[{count}]")
            check_equal(x, gen(R, dtype, count, 6), "broadcast must not modify its input")
            ddl.broadcast_(x, root_rank=root)
            check_equal(x, gen(root, dtype, count, 6), "broadcast_")
            record(x)

# reduce_scatter: rows not divisible by the rank count
for dtype, op in (("int32", ddl.Sum), ("float64", ddl.Average), ("int16", ddl.Max)):
    for rows in (0, 1, N, 2 * N + 1, 100_003):
        x = gen(R, dtype, rows * 2, 8).reshape(rows, 2)
        got = ddl.reduce_scatter(x, op=op)
        full = expect(dtype, rows * 2, 8, op).reshape(rows, 2)
        split = ddl.split_rows(rows, N)
        lo = sum(split[:R])
        check_equal(got, full[lo : lo + split[R]], f"reduce_scatter {dtype} rows={rows}")
        record(ddl.allgather(got))  # each rank's part differs; the whole must not

# scalars (0-d arrays) keep their shape through every collective that takes them
for dtype in ("float32", "int64", "float16"):
    x = np.asarray(gen(R, dtype, 1, 9)[0])
    every = [np.asarray(gen(i, dtype, 1, 9)[0]) for i in range(N)]
    got = ddl.allreduce(x, op=ddl.Sum)
    check_equal(got, np.asarray(expect(dtype, 1, 9, ddl.Sum)[0]), f"0-d allreduce {dtype}")
    assert got.shape == (), f"0-d allreduce {dtype} gave shape {got.shape}"
    y = x.copy()
    ddl.allreduce_(y, op=ddl.Max)
    assert y.shape == () and y == max(every), f"0-d allreduce_ {dtype}: {y!r}"
    got = ddl.broadcast(x, root_rank=N - 1)
    assert got.shape == () and got == every[N - 1], f"0-d broadcast {dtype}: {got!r}"
    y = x.copy()
    ddl.broadcast_(y, root_rank=0)
    assert y.shape == () and y == every[0], f"0-d broadcast_ {dtype}: {y!r}"
    record(got)

ddl.barrier()
print(json.dumps({"rank": R, "checks": checks, "digest": digest.hexdigest(),
                  "engine": ddl.engine_name(),
                  "cma": getattr(api.session().engine, "cross_memory", None),
                  "one_step": getattr(api.session().engine, "small_bytes", None)}))
ddl.shutdown()
