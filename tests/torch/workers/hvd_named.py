"""Named calls matched by name, in any order (ddl/hvd/named.py), on N real ranks in one job,
as Horovod's CI runs its tests (no shutdown between the parts):

- horovod_duplicates: Horovod's duplicate-name tests as they are written: rank 0 submits a
  named call (and its duplicate, which raises ValueError at once) before a barrier, the
  others after it; then a blocking call must be in step, for each kind of collective;
- any_order: 24 named allreduces, allgathers and broadcasts, each rank submitting and
  waiting in its own random order; every result checked against numpy;
- shape_mismatch: one name, another shape on one rank: DDLMismatchError on every rank, and
  the job is in step after it;
- mixed: named calls interleaved with unnamed blocking ones at different points per rank;
- polled: a named call polled (never waited) until it ran, with one rank late;
- soak: SOAK random steps (named batches in per-rank order, unnamed calls, one-rank errors
  in both), each result against numpy: it counts wrong results;
- stall (only with NAMED_STALL=1): every rank waits on a name no other rank submits; with
  HOROVOD_STALL_CHECK_TIME_SECONDS and _SHUTDOWN_TIME_SECONDS set, each warns, then all fail
  together, and the job is in step after it.

Prints one JSON line.
"""

import json
import os
import random
import time
import traceback

import numpy as np
import torch

import ddl.torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()


def in_step() -> bool:
    got = hvd.allreduce(torch.full((3,), float(R + 1)), op=hvd.Sum)
    return got.tolist() == [float(N * (N + 1) // 2)] * 3


def horovod_duplicates() -> dict:
    tensor = torch.ones(4 * N, 17)  # rows an alltoall can split evenly
    calls = {
        "allreduce": lambda: hvd.allreduce_async(tensor, name="duplicate_name"),
        "allgather": lambda: hvd.allgather_async(tensor, name="duplicate_name"),
        "broadcast": lambda: hvd.broadcast_async(tensor, 0, name="duplicate_name"),
        "alltoall": lambda: hvd.alltoall_async(tensor, name="duplicate_name"),
        "reducescatter": lambda: hvd.reducescatter_async(tensor, name="duplicate_name"),
    }
    out = {}
    for kind, call in calls.items():
        raised = []
        for turn in (R == 0, R > 0):
            if turn:
                call()  # Horovod's test drops this handle
                try:
                    call()
                    raised.append(False)
                except ValueError:
                    raised.append(True)
            hvd.barrier()
        out[kind] = {"raised": raised, "in_step": in_step()}
    return out


def any_order() -> dict:
    rng = random.Random(1000 + R)
    want, calls = {}, []
    for i in range(24):
        name, k = f"any.{i}", i % 3
        if k == 0:
            calls.append((name, lambda i=i, name=name: hvd.allreduce_async(
                torch.full((i + 1,), float(R * 100 + i)), op=hvd.Sum, name=name)))
            want[name] = np.full(i + 1, float(sum(r * 100 + i for r in range(N))))
        elif k == 1:
            calls.append((name, lambda i=i, name=name: hvd.allgather_async(
                torch.full((R + 1, 2), float(i)), name=name)))
            want[name] = np.full((N * (N + 1) // 2, 2), float(i))
        else:
            root = i % N
            calls.append((name, lambda i=i, name=name, root=root: hvd.broadcast_async(
                torch.full((4,), float(R * 10 + i)), root, name=name)))
            want[name] = np.full(4, float(root * 10 + i))
    rng.shuffle(calls)
    handles = {name: submit() for name, submit in calls}
    names = list(handles)
    rng.shuffle(names)
    wrong = [n for n in names if not np.array_equal(hvd.synchronize(handles[n]).numpy(),
                                                    want[n])]
    return {"wrong": wrong, "in_step": in_step()}


def shape_mismatch() -> dict:
    try:
        hvd.allreduce(torch.ones(3 + (R == N - 1)), name="mismatch")
        got = None
    except hvd.DDLMismatchError as exc:
        got = str(exc)
    return {"error": got, "in_step": in_step()}


def mixed() -> dict:
    h = None
    if R % 2 == 0:
        h = hvd.allreduce_async(torch.ones(2), name="mixed.a", op=hvd.Sum)
    x = hvd.allreduce(torch.ones(3), op=hvd.Sum)
    if R % 2 == 1:
        h = hvd.allreduce_async(torch.ones(2), name="mixed.a", op=hvd.Sum)
    g = hvd.allgather(torch.full((1,), float(R)))
    a = hvd.synchronize(h)
    return {"ok": x.tolist() == [float(N)] * 3 and g.tolist() == [float(r) for r in range(N)]
            and a.tolist() == [float(N)] * 2, "in_step": in_step()}


def polled() -> dict:
    h = hvd.allreduce_async(torch.ones(4), name="polled", op=hvd.Sum)
    if R == N - 1:
        time.sleep(0.3)
    polls = 0
    while not hvd.poll(h):
        polls += 1
        time.sleep(0.001)
    return {"ok": hvd.synchronize(h).tolist() == [float(N)] * 4, "in_step": in_step()}


def soak(steps: int) -> dict:
    plan = random.Random(7)  # the same program on every rank
    mine = random.Random(100 + R)  # this rank's own orders
    wrong, errors, expected_errors, ops = [], 0, 0, 0
    dtypes = [torch.float32, torch.float64, torch.int32, torch.int64]
    step = 0
    while ops < steps:
        step += 1
        if plan.random() < 0.6:  # a batch of named calls
            batch = []
            for j in range(plan.randint(1, 6)):
                n = plan.randint(1, 40)
                dt = plan.choice(dtypes)
                bad = plan.random() < 0.05
                victim = plan.randrange(N)
                batch.append((f"s{step}.{j}", n, dt, bad, victim))
            order = batch[:]
            mine.shuffle(order)
            handles = {}
            for name, n, dt, bad, victim in order:
                size = n + (1 if bad and victim == R else 0)
                handles[name] = hvd.allreduce_async(
                    (torch.arange(size) % 7 + R).to(dt), op=hvd.Sum, name=name)
            waits = batch[:]
            mine.shuffle(waits)
            for name, n, _dt, bad, _victim in waits:
                ops += 1
                expected_errors += bad
                try:
                    got = hvd.synchronize(handles[name]).numpy()
                except hvd.DDLMismatchError:
                    errors += 1
                    if not bad:
                        wrong.append(f"{name}: unexpected mismatch")
                    continue
                if bad:
                    wrong.append(f"{name}: no mismatch")
                    continue
                want = sum((np.arange(n) % 7 + r) for r in range(N))
                if not np.array_equal(got, want.astype(got.dtype)):
                    wrong.append(name)
        else:  # an unnamed blocking call, sometimes wrong on one rank
            ops += 1
            n = plan.randint(1, 50)
            bad = plan.random() < 0.05
            victim = plan.randrange(N)
            expected_errors += bad
            size = n + (1 if bad and victim == R else 0)
            try:
                got = hvd.allreduce(torch.full((size,), float(R)), op=hvd.Sum).numpy()
            except hvd.DDLMismatchError:
                errors += 1
                if not bad:
                    wrong.append(f"unnamed {step}: unexpected mismatch")
                continue
            if bad or not np.array_equal(got, np.full(n, float(sum(range(N))))):
                wrong.append(f"unnamed {step}")
    return {"ops": ops, "wrong": wrong, "errors": errors, "expected_errors": expected_errors,
            "in_step": in_step()}


def stall() -> dict:
    h = hvd.allreduce_async(torch.ones(2), name=f"only.{R}")
    t0 = time.monotonic()
    try:
        hvd.synchronize(h)
        got = None
    except hvd.DDLError as exc:
        got = str(exc)
    return {"error": got, "seconds": time.monotonic() - t0, "in_step": in_step()}


out = {}
parts = [("horovod_duplicates", horovod_duplicates), ("any_order", any_order),
         ("shape_mismatch", shape_mismatch), ("mixed", mixed), ("polled", polled),
         ("soak", lambda: soak(int(os.environ.get("SOAK", "300"))))]
if os.environ.get("NAMED_STALL") == "1":
    parts = [("stall", stall)]
for key, part in parts:
    t0 = time.monotonic()
    try:
        out[key] = part()
    except Exception:  # noqa: BLE001 - reported, the test fails on it
        out[key] = {"exception": traceback.format_exc()}
    out[key]["seconds"] = round(time.monotonic() - t0, 3)
print(json.dumps(out), flush=True)
hvd.shutdown()
