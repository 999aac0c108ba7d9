"""Soak: random Horovod-level collectives (kind, dtype, size, op, async or not) with errors
injected on one rank at random points (a wrong op, dtype or shape, an op its dtype lacks, a
bad root or bad splits), and duplicate names (on every rank: a local error). Every rank
draws the same sequence from one seed and computes what every rank contributes, so each
result is checked against numpy; an injected call must raise on every rank, every other call
must give the right result.

argv[1]: the number of calls. Prints one JSON line: calls, injected, raised, failed_at (the
calls that raised here), wrong and unexpected (both must be empty).
"""

import json
import sys
import time

import numpy as np
import torch

import ddl
import ddl.torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
rng = np.random.default_rng(20261201)  # the same draws on every rank

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16]
FLOAT = (torch.float32, torch.float64, torch.float16)
KINDS = ["allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
         "grouped_allgather", "broadcast", "reduce_scatter", "alltoall", "barrier",
         "broadcast_object", "allgather_object"]
ASYNC = {"allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
         "broadcast", "reduce_scatter", "alltoall"}
OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product}


def data(i: int, r: int, shape: tuple[int, ...], dtype: torch.dtype, part: int = 0):
    """Rank r's contribution to call i: small integers, so sums and products are exact."""
    g = np.random.default_rng([i, r, part])
    a = g.integers(-3, 4, size=shape)
    return torch.from_numpy(a).to(dtype)


def reduce(op: str, rows: list[np.ndarray]) -> np.ndarray:
    stack = np.stack(rows)
    if op == "sum":
        return stack.sum(0, dtype=stack.dtype)
    if op == "average":
        return (stack.sum(0, dtype=stack.dtype) / N).astype(stack.dtype)
    return {"min": stack.min(0), "max": stack.max(0),
            "product": stack.prod(0, dtype=stack.dtype)}[op]


def close(got: torch.Tensor, want: np.ndarray) -> bool:
    g = got.detach().numpy()
    if g.shape != want.shape or g.dtype != want.dtype:
        return False
    if g.dtype.kind == "f":
        tol = 1e-2 if g.dtype == np.float16 else 1e-6
        return bool(np.allclose(g, want, rtol=tol, atol=tol))
    return bool(np.array_equal(g, want))


def draw(i: int, pending_names: list[str]) -> dict:
    kind = KINDS[rng.integers(len(KINDS))]
    dtype = DTYPES[rng.integers(len(DTYPES))]
    big = rng.random() < 0.05
    n = int(rng.integers(20_000, 40_000)) if big else int(rng.integers(1, 300))
    ops = ["sum", "average", "min", "max", "product"] if dtype in FLOAT else [
        "sum", "min", "max", "product"]
    c = {"i": i, "kind": kind, "dtype": dtype, "n": n, "op": ops[rng.integers(len(ops))],
         "async": kind in ASYNC and rng.random() < 0.5, "root": int(rng.integers(N)),
         "name": f"n{i}" if rng.random() < 0.3 else None, "inject": None,
         "victim": int(rng.integers(N))}
    if rng.random() < 0.12:
        choices = {"allreduce": ["op", "dtype", "shape", "bool_average"],
                   "allreduce_": ["op", "shape", "bool_average"],
                   "grouped_allreduce": ["shape", "bool_average"],
                   "grouped_allreduce_": ["shape"],
                   "allgather": ["shape", "dtype"], "grouped_allgather": ["shape"],
                   "broadcast": ["bad_root", "root", "shape"],
                   "reduce_scatter": ["op", "shape"], "alltoall": ["bad_splits", "dtype"],
                   "broadcast_object": ["bad_root"]}.get(kind, [])
        if pending_names and kind != "barrier":  # barrier takes no name
            choices = choices + ["duplicate_name"]
        if choices:
            c["inject"] = choices[rng.integers(len(choices))]
            if c["inject"] == "duplicate_name":
                c["dup"] = pending_names[rng.integers(len(pending_names))]
    return c


def bad(c: dict) -> str | None:
    """The injection this rank applies (the victim's), else None."""
    return c["inject"] if c["victim"] == R else None


def issue(c: dict):
    """Run call ``c``; returns (handle or result, check) where check(result) -> bool."""
    i, kind, dt, n, op = c["i"], c["kind"], c["dtype"], c["n"], c["op"]
    mine = bad(c)
    # A duplicate name is a local error that no other rank hears of (as in Horovod, where a
    # call on the other ranks would then wait for its name): every rank makes it.
    name = c["dup"] if c["inject"] == "duplicate_name" else c["name"]
    rop = OPS[op]
    if mine == "op":
        rop = hvd.Max if op != "max" else hvd.Sum
    extra = 1 if mine == "shape" else 0
    my_dt = (torch.float64 if dt != torch.float64 else torch.float32) if mine == "dtype" else dt
    if mine == "bool_average":
        my_dt, rop = torch.bool, hvd.Average
    a = c["async"]
    if kind in ("allreduce", "allreduce_"):
        x = data(i, R, (n + extra,), my_dt)
        want = reduce(op, [data(i, r, (n,), dt).numpy() for r in range(N)])
        if kind == "allreduce":
            h = (hvd.allreduce_async if a else hvd.allreduce)(x, name=name, op=rop)
            return h, lambda got: close(got, want)
        h = (hvd.allreduce_async_ if a else hvd.allreduce_)(x, name=name, op=rop)
        return h, lambda got: got is x and close(x, want)
    if kind in ("grouped_allreduce", "grouped_allreduce_"):
        shapes = [(n,), (max(1, n // 3), 2), (3,)][: 1 + i % 3]
        dts = [dt, torch.float64 if dt in FLOAT else torch.int64, dt][: len(shapes)]
        if op == "average":
            dts = [d if d in FLOAT else torch.float64 for d in dts]
        xs = [data(i, R, s, d, k) for k, (s, d) in enumerate(zip(shapes, dts))]
        if mine == "shape":
            xs.append(torch.ones(2))
        if mine == "bool_average":
            xs[0], rop = xs[0].to(torch.bool), hvd.Average
        wants = [reduce(op, [data(i, r, s, d, k).numpy() for r in range(N)])
                 for k, (s, d) in enumerate(zip(shapes, dts))]
        if kind == "grouped_allreduce":
            fn = hvd.grouped_allreduce_async if a else hvd.grouped_allreduce
            return fn(xs, name=name, op=rop), lambda got: all(
                close(g, w) for g, w in zip(got, wants)) and len(got) == len(wants)
        fn = hvd.grouped_allreduce_async_ if a else hvd.grouped_allreduce_
        return fn(xs, name=name, op=rop), lambda got: all(
            g is x and close(x, w) for g, x, w in zip(got, xs, wants))
    if kind in ("allgather", "grouped_allgather"):
        cols = 1 + i % 3

        def rows_of(r, k=0):
            return data(i, r, ((i + r + k) % 3 + 1, cols), dt, k)

        if kind == "allgather":
            x = rows_of(R).to(my_dt)
            if extra:
                x = torch.zeros(x.shape[0], cols + 1, dtype=my_dt)
            want = np.concatenate([rows_of(r).numpy() for r in range(N)])
            h = (hvd.allgather_async if a else hvd.allgather)(x, name=name)
            return h, lambda got: close(got, want)
        xs = [rows_of(R, k) for k in range(2)]
        if extra:
            xs[1] = torch.zeros(xs[1].shape[0], cols + 1, dtype=dt)
        wants = [np.concatenate([rows_of(r, k).numpy() for r in range(N)]) for k in range(2)]
        return hvd.grouped_allgather(xs, name=name), lambda got: all(
            close(g, w) for g, w in zip(got, wants))
    if kind == "broadcast":
        root = c["root"]
        my_root = N + 1 if mine == "bad_root" else ((root + 1) % N if mine == "root" else root)
        x = data(i, R, (n + extra,), dt)
        want = data(i, root, (n,), dt).numpy()
        h = (hvd.broadcast_async if a else hvd.broadcast)(x, my_root, name=name)
        return h, lambda got: close(got, want)
    if kind == "reduce_scatter":
        rows = N + i % (2 * N)
        if op == "average" and dt not in FLOAT:
            op, rop = "sum", hvd.Sum
        x = data(i, R, (rows + extra, 2), dt)
        full = reduce(op, [data(i, r, (rows, 2), dt).numpy() for r in range(N)])
        split = ddl.split_rows(rows, N)
        lo = sum(split[:R])
        want = full[lo:lo + split[R]]
        h = (hvd.reduce_scatter_async if a else hvd.reduce_scatter)(x, op=rop, name=name)
        return h, lambda got: close(got, want)
    if kind == "alltoall":
        def splits_of(r):
            return [int(s) for s in np.random.default_rng([i, r, 7]).integers(0, 3, size=N)]

        def send_of(r):
            return data(i, r, (sum(splits_of(r)), 2), dt)

        sp = splits_of(R)
        if mine == "bad_splits":
            sp = [s + 1 for s in sp]
        x = send_of(R).to(my_dt)
        pieces = []
        for r in range(N):
            s = splits_of(r)
            pieces.append(send_of(r).numpy()[sum(s[:R]):sum(s[:R + 1])])
        want = np.concatenate(pieces)
        h = (hvd.alltoall_async if a else hvd.alltoall)(x, splits=sp, name=name)
        return h, lambda got: close(got[0], want) and got[1].tolist() == [
            splits_of(r)[R] for r in range(N)]
    if kind == "barrier":
        hvd.barrier()
        return None, lambda got: True
    if kind == "broadcast_object":
        root = N + 1 if mine == "bad_root" else c["root"]
        return (hvd.broadcast_object({"i": i, "r": R}, root, name=name),
                lambda got: got == {"i": i, "r": c["root"]})
    return (hvd.allgather_object((i, R), name=name),
            lambda got: got == [(i, r) for r in range(N)])


out = {"calls": 0, "injected": 0, "raised": 0, "failed_at": [], "wrong": [],
       "unexpected": []}
# async calls not yet waited for, the same list on every rank (a call that raised here at
# once stays in it, so every rank draws the same sequence)
pending: list[tuple[dict, object, object, BaseException | None]] = []
# names of async calls issued since this rank last returned from a wait: still in flight
# (Horovod's rule: a name is free once its call ran; ddl's, once the program has also
# returned from a wait since, the same on every rank), so using one again must raise
fresh: list[str] = []


def settle(c: dict, result=None, error: BaseException | None = None, check=None) -> None:
    if error is not None:
        out["raised"] += 1
        out["failed_at"].append(c["i"])
        if c["inject"] is None:
            out["unexpected"].append(f"{c['i']} {c['kind']}: raised {type(error).__name__}: "
                                     f"{str(error)[:300]}")
        return
    if c["inject"] is not None:
        out["unexpected"].append(f"{c['i']} {c['kind']}: {c['inject']} on rank "
                                 f"{c['victim']} did not raise")
    elif not check(result):
        out["wrong"].append(f"{c['i']} {c['kind']} {c['dtype']} n={c['n']} op={c['op']}")


def flush() -> None:
    while pending:
        c, h, check, raised = pending.pop(0)
        if raised is not None:
            settle(c, error=raised)
            continue
        try:
            result = h.wait()
        except Exception as e:  # noqa: BLE001 - judged in settle
            settle(c, error=e)
        else:
            settle(c, result, check=check)


t0 = time.perf_counter()
for i in range(CALLS):
    c = draw(i, fresh)
    out["calls"] += 1
    out["injected"] += c["inject"] is not None
    h = check = raised = None
    try:
        h, check = issue(c)
    except Exception as e:  # noqa: BLE001 - judged in settle
        raised = e
    if c["async"]:
        pending.append((c, h, check, raised))
        if c["name"] and c["inject"] is None:
            fresh.append(c["name"])
    else:
        fresh.clear()
        if raised is not None:
            settle(c, error=raised)
        else:
            settle(c, h, check=check)
    wait_now = rng.random() < 0.3
    if len(pending) > 4 or wait_now:
        flush()
        fresh.clear()
flush()
out["seconds"] = round(time.perf_counter() - t0, 1)
hvd.shutdown()
print(json.dumps(out), flush=True)
