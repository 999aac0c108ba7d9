"""Horovod's integer Average and integer scale factors, the "ddl" backend's integer AVG,
reducescatter, and the gradients of every collective, each against a numpy reference
computed here from every rank's inputs (each rank can rebuild any rank's tensor)."""

import json

import numpy as np
import torch
import torch.distributed as dist

import ddl.torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
failed: list[str] = []


def check(name: str, got, want) -> None:
    """Bit for bit for integers; floats average as ``sum / size`` here, ``sum * (1 / size)``
    in Horovod: equal to the last bits."""
    got = got.detach().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    same = (np.allclose(got, want, rtol=1e-14, atol=0) if want.dtype.kind == "f"
            else np.array_equal(got, want))
    if got.dtype != want.dtype or got.shape != want.shape or not same:
        failed.append(f"{name}: got {got.dtype}{got.shape} {got.ravel()[:8]}, "
                      f"want {want.dtype}{want.shape} {want.ravel()[:8]}")


def ints(r: int, dtype, shape=(5, 3)) -> np.ndarray:
    """Rank ``r``'s tensor: negative and positive values, sums not multiples of N."""
    return np.random.default_rng(100 + r).integers(-1000, 1000, size=shape).astype(dtype)


def horovod_scale(x: np.ndarray, factor: float) -> np.ndarray:
    """Horovod's ScaleBuffer on an integer buffer: ``(T)(double factor * x)``."""
    return (np.float64(factor) * x.astype(np.float64)).astype(x.dtype)


def horovod_allreduce(dtype, op, pre=1.0, post=1.0, shape=(5, 3)) -> np.ndarray:
    terms = [ints(r, dtype, shape) for r in range(N)]
    if pre != 1.0:
        terms = [horovod_scale(t, pre) for t in terms]
    total = np.sum(terms, axis=0, dtype=dtype)
    if op is hvd.Average:
        post = post / N  # Horovod: "Averaging happens via postscale_factor"
    return horovod_scale(total, post) if post != 1.0 else total


# ------------------------------------------------- 1. integer Average and scaling
for np_dtype in (np.int32, np.int64):
    mine = torch.from_numpy(ints(R, np_dtype))
    tag = np.dtype(np_dtype).name
    check(f"average_{tag}", hvd.allreduce(mine), horovod_allreduce(np_dtype, hvd.Average))
    check(f"average_true_{tag}", hvd.allreduce(mine, average=True),
          horovod_allreduce(np_dtype, hvd.Average))
    y = mine.clone()
    hvd.allreduce_(y, op=hvd.Average)
    check(f"average_inplace_{tag}", y, horovod_allreduce(np_dtype, hvd.Average))
    check(f"average_async_{tag}", hvd.synchronize(hvd.allreduce_async(mine)),
          horovod_allreduce(np_dtype, hvd.Average))
    check(f"sum_scaled_{tag}", hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.7,
                                             postscale_factor=1.9),
          horovod_allreduce(np_dtype, hvd.Sum, 0.7, 1.9))
    check(f"average_scaled_{tag}", hvd.allreduce(mine, prescale_factor=2.5,
                                                 postscale_factor=0.3),
          horovod_allreduce(np_dtype, hvd.Average, 2.5, 0.3))
    other = torch.from_numpy(ints(R + 7, np.float64))
    g = hvd.grouped_allreduce([mine, other], op=hvd.Average, postscale_factor=1.5)
    check(f"grouped_average_{tag}", g[0],
          horovod_allreduce(np_dtype, hvd.Average, post=1.5))
    gi = [mine.clone(), mine.clone()[:, :2]]
    hvd.grouped_allreduce_(gi, op=hvd.Average)
    check(f"grouped_average_inplace_{tag}", gi[0], horovod_allreduce(np_dtype, hvd.Average))

total = np.sum([ints(r, np.int64) for r in range(N)], axis=0, dtype=np.int64)
if np.array_equal(horovod_allreduce(np.int64, hvd.Average), total // N):
    failed.append("the inputs do not tell truncation from flooring: change them")

# the "ddl" torch.distributed backend: AVG of an integer tensor as NCCL computes it
dist.init_process_group("ddl", init_method="env://")
for np_dtype in (np.int32, np.int64):
    t = torch.from_numpy(ints(R, np_dtype))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    total = np.sum([ints(r, np_dtype) for r in range(N)], axis=0, dtype=np_dtype)
    want = (np.abs(total) // N * np.sign(total)).astype(np_dtype)  # truncated toward zero
    check(f"backend_avg_{np.dtype(np_dtype).name}", t, want)
    rows = torch.from_numpy(ints(R, np_dtype, (N, 4)))
    out = torch.empty(4, dtype=rows.dtype)
    dist.reduce_scatter_tensor(out, rows, op=dist.ReduceOp.AVG)
    total = np.sum([ints(r, np_dtype, (N, 4)) for r in range(N)], axis=0, dtype=np_dtype)[R]
    check(f"backend_reduce_scatter_avg_{np.dtype(np_dtype).name}", out,
          (np.abs(total) // N * np.sign(total)).astype(np_dtype))
    t = torch.from_numpy(ints(R, np_dtype))
    dist.reduce(t, dst=0, op=dist.ReduceOp.AVG)
    if R == 0:
        total = np.sum([ints(r, np_dtype) for r in range(N)], axis=0, dtype=np_dtype)
        check(f"backend_reduce_avg_{np.dtype(np_dtype).name}", t,
              (np.abs(total) // N * np.sign(total)).astype(np_dtype))
    out = torch.empty(4, dtype=rows.dtype)
    dist.reduce_scatter(out, list(rows.unbind(0)), op=dist.ReduceOp.AVG)
    total = np.sum([ints(r, np_dtype, (N, 4)) for r in range(N)], axis=0, dtype=np_dtype)[R]
    check(f"backend_reduce_scatter_list_avg_{np.dtype(np_dtype).name}", out,
          (np.abs(total) // N * np.sign(total)).astype(np_dtype))
dist.destroy_process_group()

# -------------------------------------------------------------- 2. reducescatter
def block(rows: int, r: int) -> slice:
    """Horovod's split of dimension 0: as even as possible, lower ranks get the extra rows."""
    split = [rows // N + (1 if j < rows % N else 0) for j in range(N)]
    return slice(sum(split[:r]), sum(split[:r + 1]))


def horovod_reducescatter(dtype, op, pre=1.0, post=1.0, shape=(7, 3)) -> np.ndarray:
    return horovod_allreduce(dtype, op, pre, post, shape)[block(shape[0], R)]


RS = (2 * N + 1, 3)  # an uneven split
for np_dtype in (np.int32, np.int64, np.float64):
    tag = np.dtype(np_dtype).name
    mine = torch.from_numpy(ints(R, np_dtype, RS))
    check(f"reducescatter_avg_{tag}", hvd.reducescatter(mine),
          horovod_reducescatter(np_dtype, hvd.Average, shape=RS))
    check(f"reducescatter_sum_scaled_{tag}",
          hvd.reducescatter(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
          horovod_reducescatter(np_dtype, hvd.Sum, 0.5, 3.0, RS))
    check(f"reducescatter_async_avg_scaled_{tag}",
          hvd.synchronize(hvd.reducescatter_async(mine, name="rs", postscale_factor=0.7)),
          horovod_reducescatter(np_dtype, hvd.Average, post=0.7, shape=RS))
    check(f"reduce_scatter_alias_{tag}", hvd.reduce_scatter(mine, hvd.Sum),
          horovod_reducescatter(np_dtype, hvd.Sum, shape=RS))
    second = torch.from_numpy(ints(R + 50, np_dtype, (N, 2)))
    want2 = np.sum([ints(r + 50, np_dtype, (N, 2)) for r in range(N)], axis=0,
                   dtype=np_dtype)[block(N, R)]
    got = hvd.grouped_reducescatter([mine, second], op=hvd.Sum)
    check(f"grouped_reducescatter_{tag}_0", got[0],
          horovod_reducescatter(np_dtype, hvd.Sum, shape=RS))
    check(f"grouped_reducescatter_{tag}_1", got[1], want2)
    got = hvd.synchronize(hvd.grouped_reducescatter_async([mine], op=hvd.Average,
                                                          prescale_factor=1.5))
    check(f"grouped_reducescatter_async_{tag}", got[0],
          horovod_reducescatter(np_dtype, hvd.Average, pre=1.5, shape=RS))


# ------------------------------------------------------------------ 3. gradients
def close(name: str, got, want) -> None:
    got = got.detach().numpy()
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-12, atol=1e-12):
        failed.append(f"{name}: got {got.shape} {got.ravel()[:6]}, want {want.shape} "
                      f"{want.ravel()[:6]}")


def floats(r: int, shape, salt: int = 0) -> np.ndarray:
    return np.random.default_rng(1000 * salt + r).standard_normal(shape)


def leaf(r: int, shape, salt: int = 0) -> torch.Tensor:
    return torch.from_numpy(floats(r, shape, salt)).requires_grad_()


rows = [r + 1 for r in range(N)]  # allgather: a different first dimension on every rank
total = sum(rows)
start = sum(rows[:R])
x = leaf(R, (rows[R], 2))
weights = [floats(r, (total, 2), 1) for r in range(N)]  # rank r's upstream gradient
hvd.allgather(x).backward(torch.from_numpy(weights[R]))
# Horovod: allreduce(grad, average=True), this rank's rows
close("grad_allgather", x.grad, np.mean(weights, axis=0)[start:start + rows[R]])

xs = [leaf(R, (rows[R], 2), 2), leaf(R, (1, 3), 3)]
ws = [[floats(r, (total, 2), 4) for r in range(N)], [floats(r, (N, 3), 5) for r in range(N)]]
outs = hvd.grouped_allgather(xs)
torch.autograd.backward(outs, [torch.from_numpy(w[R]) for w in ws])
close("grad_grouped_allgather_0", xs[0].grad, np.mean(ws[0], axis=0)[start:start + rows[R]])
close("grad_grouped_allgather_1", xs[1].grad, np.mean(ws[1], axis=0)[R:R + 1])

ROOT = N - 1
x = leaf(R, (3, 2), 6)
w = [floats(r, (3, 2), 7) for r in range(N)]
hvd.broadcast(x, root_rank=ROOT).backward(torch.from_numpy(w[R]))
# Horovod: allreduce(grad, average=True) on the root, zeros elsewhere
close("grad_broadcast", x.grad, np.mean(w, axis=0) if R == ROOT else np.zeros((3, 2)))

splits = [[(i + j) % 3 for j in range(N)] for i in range(N)]  # rows rank i sends to j
x = leaf(R, (sum(splits[R]), 2), 8)
received = [sum(splits[i][j] for i in range(N)) for j in range(N)]
w = [floats(j, (received[j], 2), 9) for j in range(N)]
out, got_splits = hvd.alltoall(x, splits=splits[R])
out.backward(torch.from_numpy(w[R]))
# the adjoint: rank R's rows sent to j come back from j's gradient, where j put them
want = np.concatenate([w[j][sum(splits[i][j] for i in range(R)):][:splits[R][j]]
                       for j in range(N)])
close("grad_alltoall", x.grad, want)
check("alltoall_received_splits", got_splits,
      np.array([splits[i][R] for i in range(N)], dtype=np.int64))
x = leaf(R, (2 * N, 2), 10)
w = [floats(j, (2 * N, 2), 11) for j in range(N)]
hvd.alltoall(x).backward(torch.from_numpy(w[R]))
close("grad_alltoall_even", x.grad,
      np.concatenate([w[j][2 * R:2 * R + 2] for j in range(N)]))

for op, factor in ((hvd.Sum, N), (hvd.Average, 1)):
    x = leaf(R, RS, 12)
    w = [floats(r, (block(RS[0], r).stop - block(RS[0], r).start, 3), 13) for r in range(N)]
    hvd.reducescatter(x, op=op, prescale_factor=2.0, postscale_factor=0.25).backward(
        torch.from_numpy(w[R]))
    # Horovod: the allgather of the gradient, times size() for Sum, times the scale factors
    close(f"grad_reducescatter_{op.name}", x.grad, np.concatenate(w) * factor * 0.5)
    xs = [leaf(R, RS, 14), leaf(R, (N, 2), 15)]
    ws = [[floats(r, (block(RS[0], r).stop - block(RS[0], r).start, 3), 16)
           for r in range(N)], [floats(r, (1, 2), 17) for r in range(N)]]
    torch.autograd.backward(hvd.grouped_reducescatter(xs, op=op),
                            [torch.from_numpy(w[R]) for w in ws])
    close(f"grad_grouped_reducescatter_{op.name}_0", xs[0].grad,
          np.concatenate(ws[0]) * factor)
    close(f"grad_grouped_reducescatter_{op.name}_1", xs[1].grad,
          np.concatenate(ws[1]) * factor)

print(json.dumps({"rank": R, "failed": failed}))
hvd.shutdown()
