"""Ranks out of step never give a wrong result, in one job (one process start per rank
count). Each part prints what it saw; test_torch_safety.py judges.

- grouped_grad: grouped_allreduce of tensors that require grad is differentiable (Horovod:
  the gradients are the grouped allreduce of the gradients); grouped_allreduce_ on them
  works in place;
- failures: a call that fails on one rank only before its data moves (int with Average, a
  bad root, bad splits, a compressor that raises, not a tensor, a bad op in an async call)
  raises on every rank at once: that rank its own error, the others a DDLMismatchError
  naming it; calls that differ (dtype, grouped layout, name, model, a gradient sparse on
  one rank only in the DistributedOptimizer) raise on every rank;
- out_of_step: the sequence that paired calls with the wrong partner before (a rank raising
  before the exchange, a duplicate name on one rank, an async broadcast left over), then a
  mismatching call and 20 mixed collectives, every result checked against numpy;
- names: Horovod's duplicate-name tests (the second in-flight use raises ValueError on every
  rank) and a name reused after synchronize;
- shutdown: a rank calls shutdown() and init() while the others are inside a collective (rank
  0, the one that creates the shared memory, then the last rank): they get a
  DDLMismatchError naming the shutdown, hold the old generation a while, and their next
  init() joins the new one;
- cycles: 20 x shutdown/init with collectives between; threads, file descriptors and this
  rank's /dev/shm segments must not grow.

Prints one JSON line: {"grouped_grad": {...}, "failures": {...}, ...}.
"""

import json
import os
import threading
import time
import traceback

import numpy as np
import torch

import ddl
import ddl.torch as hvd
from ddl.engines import segments

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
V = N - 1  # the rank that misbehaves
report: dict = {}


def caught(fn):
    """What ``fn`` raised: type, message, seconds (None: it returned)."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test judges the type
        return {"type": type(e).__name__, "value_error": isinstance(e, ValueError),
                "runtime_error": isinstance(e, RuntimeError),
                "msg": str(e)[:600], "seconds": round(time.perf_counter() - t0, 2)}
    return None


def in_step() -> bool:
    got = hvd.allreduce(torch.tensor([R + 1.0, 2.0 * R]), op=hvd.Sum)
    return np.array_equal(got.numpy(), [N * (N + 1) / 2, N * (N - 1)])


# ------------------------------------------------------------------ grouped grad
def grouped_grad():
    out = {}
    ts = [torch.full((3,), float(R + 1), requires_grad=True),
          torch.full((2, 2), 1.0 + R, dtype=torch.float64, requires_grad=True)]
    summed = hvd.grouped_allreduce(ts, op=hvd.Sum)
    out["values"] = (np.allclose(summed[0].detach().numpy(), N * (N + 1) / 2)
                     and np.allclose(summed[1].detach().numpy(), N * (N + 1) / 2))
    out["requires_grad"] = all(s.requires_grad for s in summed)
    (summed[0].sum() + 2 * summed[1].sum()).backward()
    out["grad_sum"] = [float(ts[0].grad[0]), float(ts[1].grad[0, 0])]  # N and 2N
    # Horovod's test: one backward per output (the others' gradients are zeros)
    ts = [torch.full((4,), float(R), requires_grad=True) for _ in range(3)]
    for s in hvd.grouped_allreduce(ts, average=False):
        s.backward(torch.ones(4))
    out["grad_per_output"] = [float(t.grad[0]) for t in ts]  # N each
    ts = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    avg = hvd.grouped_allreduce(ts)  # Average: the gradient is the average, 1
    (avg[0].sum() + avg[1].sum()).backward()
    out["grad_average"] = [float(t.grad[0]) for t in ts]
    leaves = [torch.full((2,), float(R), requires_grad=True),
              torch.full((3,), 1.0, dtype=torch.float64, requires_grad=True)]
    ret = hvd.grouped_allreduce_(leaves, op=hvd.Sum)
    out["inplace"] = (all(a is b for a, b in zip(ret, leaves))
                      and np.allclose(leaves[0].detach().numpy(), N * (N - 1) / 2)
                      and np.allclose(leaves[1].detach().numpy(), N)
                      and leaves[0].grad is None)
    w = torch.full((3,), float(R), requires_grad=True)
    hvd.allreduce(w, op=hvd.Sum).sum().backward()
    out["allreduce_grad"] = float(w.grad[0])
    out["in_step"] = in_step()
    return out


# ------------------------------------------------------------------- failures
class Exploding(hvd.Compressor):
    @staticmethod
    def compress(tensor):
        if hvd.rank() == V:
            raise RuntimeError("compressor exploded on purpose")
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def sparse_on_one_rank():
    """A sparse gradient (no sparse_as_dense) on one rank only: its sparse allreduce meets
    the others' dense one."""
    emb = torch.nn.Embedding(10, 3, sparse=R == V)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters())
    opt.zero_grad()
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()


def failures():
    out = {}
    x = torch.ones(4)
    cases = {
        "bool_average": lambda: hvd.allreduce(
            torch.ones(4, dtype=torch.bool) if R == V else x),
        "bad_root": lambda: hvd.broadcast(x, root_rank=N if R == V else 0),
        "bad_splits": lambda: hvd.alltoall(torch.ones(N, 2),
                                           splits=[N + 1] + [0] * (N - 1) if R == V else None),
        "compression": lambda: hvd.grouped_allreduce([x, torch.ones(2)],
                                                     compression=Exploding),
        "not_a_tensor": lambda: hvd.allgather([1.0, 2.0] if R == V else torch.ones(2, 2)),
        "async_bad_op": lambda: hvd.synchronize(hvd.allreduce_async(
            x, op="bogus" if R == V else hvd.Sum)),
        "optimizer_sparse": sparse_on_one_rank,
        # every rank checks, but they differ: agreed in the exchange
        "dtype": lambda: hvd.allreduce(torch.ones(4, dtype=torch.int32) if R == 0 else x,
                                       op=hvd.Sum),
        "grouped_layout": lambda: hvd.grouped_allreduce(
            [x, torch.ones(2)] + ([torch.ones(1)] if R == V else []), op=hvd.Sum),
        "grouped_allgather_layout": lambda: hvd.grouped_allgather(
            [torch.ones(R + 1, 3 if R != V else 4), torch.ones(1)]),
        "model": lambda: hvd.broadcast_parameters(
            torch.nn.Linear(3, 3 + (R == V)).state_dict(), root_rank=0),
    }
    for case, fn in cases.items():
        out[case] = caught(fn)
        out[f"{case}_in_step"] = in_step()
    return out


# ----------------------------------------------------------------- out of step
def value(rank, shape=(4,), dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 10 - 5).to(dtype)


def out_of_step():
    out = {}
    # a rank that raised before the exchange (it used to skip it)
    out["raised_before"] = caught(lambda: hvd.allreduce(
        torch.ones(3, dtype=torch.int64) if R == V else torch.ones(3)))
    # an async broadcast left over, then a duplicate name on one rank only: a local error,
    # as in Horovod (the other ranks issue nothing: a named call waits for its name)
    left = hvd.broadcast_async(torch.full((3,), float(R)), root_rank=0, name="left")
    out["duplicate_one_rank"] = caught(lambda: hvd.synchronize(hvd.allreduce_async(
        torch.ones(2), name="left"))) if R == V else None
    out["left_over"] = caught(left.wait)
    # a mismatching call
    out["mismatch"] = caught(lambda: hvd.allreduce(torch.ones(2 + (R == V))))
    # then 20 mixed collectives, each checked against numpy
    ok = []
    every = [value(r) for r in range(N)]
    for i in range(20):
        k = i % 10
        if k == 0:
            a, b = hvd.grouped_allreduce([value(R), value(R, (2, 3), torch.float32)], op=hvd.Sum)
            want_b = sum(value(r, (2, 3), torch.float32).numpy() for r in range(N))
            ok.append(np.allclose(a.numpy(), sum(e.numpy() for e in every))
                      and np.allclose(b.numpy(), want_b, atol=1e-5))
        elif k == 1:
            ts = [value(R), value(R, (5,))]
            hvd.grouped_allreduce_(ts, op=hvd.Max)
            ok.append(np.array_equal(ts[0].numpy(), np.max([e.numpy() for e in every], 0))
                      and np.array_equal(ts[1].numpy(),
                                         np.max([value(r, (5,)).numpy() for r in range(N)], 0)))
        elif k == 2:
            g = hvd.grouped_allgather([torch.full((R + 1, 2), float(R)), value(R, (1,))])
            ok.append(np.array_equal(g[0].numpy(), np.concatenate(
                [np.full((r + 1, 2), float(r)) for r in range(N)]))
                and np.array_equal(g[1].numpy(), np.concatenate(
                    [value(r, (1,)).numpy() for r in range(N)])))
        elif k == 3:
            rs = hvd.reduce_scatter(value(R, (2 * N, 3)), op=hvd.Sum)
            full = sum(value(r, (2 * N, 3)).numpy() for r in range(N))
            ok.append(np.allclose(rs.numpy(), full[2 * R:2 * R + 2]))
        elif k == 4:
            ok.append(np.allclose(hvd.allreduce(value(R)).numpy(),
                                  sum(e.numpy() for e in every) / N))
        elif k == 5:
            hs = [hvd.allreduce_async(value(R), op=hvd.Min, name=f"m{i}"),
                  hvd.broadcast_async(value(R), root_rank=i % N),
                  hvd.allgather_async(value(R, (R + 1,)))]
            a, b, c = (h.wait() for h in hs)
            ok.append(np.array_equal(a.numpy(), np.min([e.numpy() for e in every], 0))
                      and np.array_equal(b.numpy(), every[i % N].numpy())
                      and np.array_equal(c.numpy(), np.concatenate(
                          [value(r, (r + 1,)).numpy() for r in range(N)])))
        elif k == 6:
            send = torch.cat([torch.full((j + 1, 2), float(10 * R + j)) for j in range(N)])
            got, received = hvd.alltoall(send, splits=[j + 1 for j in range(N)])
            ok.append(received.tolist() == [R + 1] * N and np.array_equal(
                got.numpy(), np.concatenate([np.full((R + 1, 2), float(10 * r + R))
                                             for r in range(N)])))
        elif k == 7:
            ok.append(hvd.broadcast_object({"i": i, "r": R}, root_rank=N - 1) == {
                "i": i, "r": N - 1} and hvd.allgather_object(R * i) == [r * i for r in range(N)])
        elif k == 8:
            got = hvd.allreduce(torch.arange(6, dtype=torch.int32) * (R + 1), op=hvd.Sum)
            ok.append(np.array_equal(got.numpy(), np.arange(6) * N * (N + 1) // 2))
        else:
            y = value(R, (3, 3))
            hvd.broadcast_(y, root_rank=0)
            ok.append(np.array_equal(y.numpy(), value(0, (3, 3)).numpy()))
    out["checked"] = ok
    return out


# ------------------------------------------------------------------- names
def names():
    out = {}
    tensor = torch.ones(17, 17, 17)
    for kind, call in [("allreduce", lambda: hvd.allreduce_async(tensor, name="duplicate_name")),
                       ("allgather", lambda: hvd.allgather_async(tensor, name="duplicate_name")),
                       ("broadcast", lambda: hvd.broadcast_async(tensor, 0,
                                                                 name="duplicate_name"))]:
        call()  # Horovod's test drops this handle
        res = None
        for i in range(10):
            res = caught(call)
            if res is not None:
                res["at"] = i
                break
        out[kind] = res
        out[f"{kind}_in_step"] = in_step()  # a blocking call: the dropped one has finished
    h = hvd.allreduce_async(torch.ones(2), name="again")
    hvd.synchronize(h)
    out["reuse_after_synchronize"] = caught(
        lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="again"))) is None
    return out


# ------------------------------------------------------------------- shutdown
def shutdown():
    out = {}
    for quitter in sorted({0, N - 1}):
        t0 = time.perf_counter()
        if quitter == R:
            hvd.shutdown()  # the others are about to enter an allreduce
            hvd.init()
        else:
            time.sleep(0.3)
            out[f"quit{quitter}_peer_error"] = caught(lambda: hvd.allreduce(torch.ones(2)))
            time.sleep(1.0)  # hold the old generation while the quitter starts a new one
            hvd.init()  # this generation is unusable: init() starts the new one
        out[f"quit{quitter}_in_step"] = in_step()
        out[f"quit{quitter}_seconds"] = round(time.perf_counter() - t0, 2)
    return out


def cycles():
    out = {}
    job = os.environ["DDL_JOB_ID"]

    def mine() -> list[str]:
        return [s for s in segments.list_job(job) if f"heap{R}-" in s]

    fds0 = threads0 = None
    ok = []
    for c in range(20):
        hvd.shutdown()
        if c == 0:
            fds0, threads0 = len(os.listdir("/proc/self/fd")), threading.active_count()
        else:
            ok.append((len(os.listdir("/proc/self/fd")), threading.active_count(), mine())
                      == (fds0, threads0, []))
        hvd.init()
        x = hvd.allreduce_async(torch.full((5,), float(R + c)), op=hvd.Sum)
        g = hvd.grouped_allreduce([torch.ones(3), torch.ones(2, dtype=torch.float64)],
                                  op=hvd.Sum)
        ga = hvd.allgather(torch.full((R + 1,), float(c)))
        b = hvd.broadcast(torch.full((2,), float(R)), root_rank=c % N)
        buf = torch.from_numpy(ddl.malloc((64,), np.float32))  # a heap segment to release
        buf.fill_(1.0)
        hvd.allreduce_(buf, op=hvd.Sum)
        ok.append(np.allclose(x.wait().numpy(), N * (N - 1) / 2 + N * c)
                  and all(np.allclose(t.numpy(), N) for t in g)
                  and ga.shape == (N * (N + 1) // 2,) and float(b[0]) == c % N
                  and float(buf[0]) == N)
        del buf  # shutdown() unmaps the heap
    hvd.shutdown()
    out["checked"] = ok
    out["shm_left"] = mine()
    hvd.init()
    return out


PARTS = os.environ.get("SAFETY_PARTS")  # a comma-separated choice of the parts below
ALL_PARTS = (grouped_grad, failures, out_of_step, names, shutdown, cycles)
for part in [p for p in ALL_PARTS if not PARTS or p.__name__ in PARTS.split(",")]:
    try:
        report[part.__name__] = part()
    except Exception:  # report it rather than hang the others
        report[part.__name__] = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps(report), flush=True)
        raise
hvd.shutdown()
print(json.dumps(report), flush=True)
