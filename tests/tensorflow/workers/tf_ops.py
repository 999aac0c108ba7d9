"""Every ddl.tensorflow collective against numpy, eager and inside tf.function, over the
dtypes TF has, with Horovod's gradients; one JSON report per rank. Each check records
(name, ok, detail); the test asserts every expected check ran and passed."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as hvd  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
checks: list[tuple[str, bool, str]] = []


def check(name, got, want, tol=0.0):
    got, want = np.asarray(got), np.asarray(want)
    ok = got.shape == want.shape and (
        np.array_equal(got, want) if tol == 0 else np.allclose(got, want, rtol=tol, atol=tol))
    detail = "" if ok else f"got {got.dtype}{got.shape} {got.ravel()[:6]} want " \
                           f"{want.dtype}{want.shape} {want.ravel()[:6]}"
    checks.append((name, bool(ok), detail))


def data(r, shape, dt):
    """Rank r's input: small integers, exact in every dtype (bfloat16 included)."""
    n = int(np.prod(shape))
    return ((np.arange(n) % 7) + r + 1).reshape(shape).astype(np.float64)


DTYPES = {"float16": tf.float16, "float32": tf.float32, "float64": tf.float64,
          "int32": tf.int32, "int64": tf.int64, "bfloat16": tf.bfloat16}
SHAPE = (5, 3)  # odd sizes


def as_np(t):
    a = t.numpy()
    return a.astype(np.float64)


def run(mode, fn, *args):
    if mode == "eager":
        return fn(*args)
    return tf.function(fn)(*args)


for mode in ("eager", "function"):
    for name, dt in DTYPES.items():
        x = tf.cast(tf.constant(data(R, SHAPE, dt)), dt)
        every = [data(r, SHAPE, dt) for r in range(N)]
        tag = f"{mode}/{name}"
        check(f"allreduce_sum/{tag}", as_np(run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum), x)),
              np.sum(every, axis=0))
        want_avg = np.sum(every, axis=0) / N
        if name.startswith("int"):
            want_avg = np.trunc(want_avg)  # Horovod: sum, then scale in float64, truncate
        check(f"allreduce_avg/{tag}", as_np(run(mode, lambda t: hvd.allreduce(t), x)),
              want_avg, tol=1e-2 if name in ("float16", "bfloat16") else 0)
        check(f"allreduce_max/{tag}", as_np(run(mode, lambda t: hvd.allreduce(t, op=hvd.Max), x)),
              np.max(every, axis=0))
        check(f"allreduce_min/{tag}", as_np(run(mode, lambda t: hvd.allreduce(t, op=hvd.Min), x)),
              np.min(every, axis=0))
        rows = R + 1  # unequal first dimensions
        xr = tf.cast(tf.constant(data(R, (rows, 3), dt)), dt)
        check(f"allgather/{tag}", as_np(run(mode, hvd.allgather, xr)),
              np.concatenate([data(r, (r + 1, 3), dt) for r in range(N)]))
        check(f"broadcast/{tag}", as_np(run(mode, lambda t: hvd.broadcast(t, N - 1), x)),
              every[N - 1])
        g = run(mode, lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum), x, xr[:1])
        check(f"grouped_allreduce/{tag}", as_np(g[0]), np.sum(every, axis=0))
        check(f"grouped_allreduce_b/{tag}", as_np(g[1]),
              np.sum([data(r, (1, 3), dt) for r in range(N)], axis=0))
        rs = as_np(run(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum), x))
        total = np.sum(every, axis=0)
        counts = [SHAPE[0] // N + (1 if r < SHAPE[0] % N else 0) for r in range(N)]
        start = sum(counts[:R])
        check(f"reducescatter/{tag}", rs, total[start:start + counts[R]])
        splits = [(R + j) % 2 + 1 for j in range(N)]
        xa = tf.cast(tf.constant(data(R, (sum(splits), 2), dt)), dt)
        out, received = run(mode, lambda t, sp=splits: hvd.alltoall(t, splits=sp), xa)
        want = []
        for r in range(N):
            sp = [(r + j) % 2 + 1 for j in range(N)]
            full = data(r, (sum(sp), 2), dt)
            want.append(full[sum(sp[:R]):sum(sp[:R]) + sp[R]])
        check(f"alltoall/{tag}", as_np(out), np.concatenate(want))
        check(f"alltoall_splits/{tag}", received.numpy(), [(r + R) % 2 + 1 for r in range(N)])

# Scalars keep their shape through every collective.
s = tf.constant(float(R + 1))
check("scalar/allreduce", hvd.allreduce(s, op=hvd.Sum).numpy(), np.float32(N * (N + 1) / 2))
check("scalar/broadcast", hvd.broadcast(s, 0).numpy(), np.float32(1.0))
v = tf.Variable(float(R + 10))
hvd.broadcast_variables([v], 0)
check("scalar/broadcast_variables", v.numpy(), np.float32(10.0))
check("scalar/allgather", hvd.allgather(s).numpy(), np.arange(1, N + 1, dtype=np.float32))

# Gradients (Horovod's rules), eager and in tf.function, against analytic values.
w = tf.Variable(np.arange(4, dtype=np.float64) + 1)


def grads(fn):
    def g():
        with tf.GradientTape() as tape:
            loss = fn(w)
        return tape.gradient(loss, w)
    return g(), tf.function(g)()


c = float(R + 1)
csum = N * (N + 1) / 2
# d/dw sum(allreduce_sum(c*w)) per rank: allreduce of the upstream ones, times c.
for label, got in zip(("eager", "function"), grads(
        lambda w: tf.reduce_sum(hvd.allreduce(c * w, op=hvd.Sum)))):
    check(f"grad/allreduce_sum/{label}", got.numpy(), np.full(4, N * c))
for label, got in zip(("eager", "function"), grads(
        lambda w: tf.reduce_sum(hvd.allreduce(c * w) * w))):
    # y = mean_r(c_r w); loss_r = sum(y * w); upstream dy_r = w; grad_in = avg_r(w) = w
    check(f"grad/allreduce_avg/{label}", got.numpy(),
          (w.numpy() * c) + c * w.numpy() if False else
          (csum / N) * w.numpy() + c * w.numpy())
for label, got in zip(("eager", "function"), grads(
        lambda w: tf.reduce_sum(hvd.allgather(c * w) ** 2))):
    # gathered rows of every rank; upstream 2*gathered, averaged over ranks, own rows
    check(f"grad/allgather/{label}", got.numpy(), 2 * c * w.numpy() * c)
for label, got in zip(("eager", "function"), grads(
        lambda w: tf.reduce_sum(hvd.broadcast(c * w, 0)))):
    check(f"grad/broadcast/{label}", got.numpy(), np.full(4, c if R == 0 else 0.0))
for label, got in zip(("eager", "function"), grads(
        lambda w: tf.reduce_sum(hvd.reducescatter(tf.reshape(c * w, (4, 1)), op=hvd.Sum)))):
    # Horovod: allgather of the gradient times size() for Sum
    check(f"grad/reducescatter_sum/{label}", got.numpy(), np.full(4, N * c))
for label, got in zip(("eager", "function"), grads(
        lambda w: tf.reduce_sum(hvd.grouped_allreduce([c * w, w], op=hvd.Sum)[0]))):
    check(f"grad/grouped_allreduce/{label}", got.numpy(), np.full(4, N * c))
sp = [4 // N + (1 if j < 4 % N else 0) for j in range(N)]
for label, got in zip(("eager", "function"), grads(
        lambda w: tf.reduce_sum(hvd.alltoall(c * w, splits=sp)[0] * (R + 2)))):
    # rows sent to rank j come back scaled by that rank's (j + 2)
    want = np.concatenate([np.full(sp[j], c * (j + 2)) for j in range(N)])
    check(f"grad/alltoall/{label}", got.numpy(), want)

# DistributedGradientTape: averaged gradients, sparse ones from an embedding too.
emb = tf.Variable(np.ones((6, 2), dtype=np.float32))
dense = tf.Variable(np.ones(2, dtype=np.float32))


def tape_grads(sparse_as_dense):
    with tf.GradientTape() as tape:
        rows = tf.nn.embedding_lookup(emb, [R % 6, 5])
        loss = tf.reduce_sum(rows) * c + tf.reduce_sum(dense) * c
    t = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
    return t.gradient(loss, [emb, dense])


want_emb = np.zeros((6, 2), dtype=np.float32)
for r in range(N):
    want_emb[r % 6] += (r + 1) / N
    want_emb[5] += (r + 1) / N
for sad in (False, True):
    ge, gd = tape_grads(sad)
    check(f"tape/sparse_as_dense={sad}/kind", isinstance(ge, tf.IndexedSlices), not sad)
    check(f"tape/sparse_as_dense={sad}/emb", tf.convert_to_tensor(ge).numpy(), want_emb,
          tol=1e-6)
    check(f"tape/sparse_as_dense={sad}/dense", gd.numpy(), np.full(2, csum / N,
                                                                   dtype=np.float32), tol=1e-6)

# Compression.fp16 travels as float16, comes back in the input dtype.
y = hvd.allreduce(tf.constant([1.0, 2.0], tf.float32) * c, op=hvd.Sum,
                  compression=hvd.Compression.fp16)
check("fp16/dtype", y.dtype == tf.float32, True)
check("fp16/value", y.numpy(), np.array([csum, 2 * csum], np.float32))

# Objects, join, barrier
check("broadcast_object", hvd.broadcast_object({"r": R, "l": [1, 2]}, N - 1) == {
    "r": N - 1, "l": [1, 2]}, True)
check("allgather_object", hvd.allgather_object(R * 2), [r * 2 for r in range(N)])
hvd.barrier()

# A mismatch inside tf.function raises on every rank; the next calls pair again.
@tf.function
def uneven(t):
    return hvd.allreduce(t)


try:
    uneven(tf.zeros([3 + R]))
    checks.append(("mismatch/raised", N == 1, "no error"))
except tf.errors.OpError as exc:
    checks.append(("mismatch/raised", "DDLMismatchError" in str(exc), str(exc)[-300:]))
for i in range(5):
    check(f"after_mismatch/{i}", hvd.allreduce(tf.constant([float(R + i)]), op=hvd.Sum).numpy(),
          np.array([sum(r + i for r in range(N))], np.float32))

# join: ranks with fewer batches keep serving the others' allreduce.
steps = 2 + R
total = []
for _ in range(steps):
    total.append(float(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy()[0]))
last = int(hvd.join())
check("join/last", last, N - 1)
want_total = [float(sum(1 for r in range(N) if 2 + r > i)) for i in range(steps)]
check("join/sums", total, want_total)

# Process sets: even ranks and odd ranks, inside tf.function too (on one rank the even set
# would be every rank: a duplicate of the global set, refused as in Horovod)
even_set = (hvd.add_process_set([r for r in range(N) if r % 2 == 0]) if N > 1
            else hvd.global_process_set)
odd_set = hvd.add_process_set([r for r in range(N) if r % 2 == 1]) if N > 1 else None
mine = even_set if R % 2 == 0 else odd_set
members = [r for r in range(N) if r % 2 == R % 2]


@tf.function
def in_set(t):
    return hvd.allreduce(t, op=hvd.Sum, process_set=mine), hvd.allgather(
        t, process_set=mine)


s_sum, s_gather = in_set(tf.constant([float(R)]))
check("process_set/allreduce", s_sum.numpy(), np.array([float(sum(members))], np.float32))
check("process_set/allgather", s_gather.numpy(), np.array(members, np.float32))
check("process_set/global", hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy(),
      np.array([float(N)], np.float32))
if odd_set is not None:
    hvd.remove_process_set(odd_set)
    hvd.remove_process_set(even_set)

failed = [(n, d) for n, ok, d in checks if not ok]
print(json.dumps({"rank": R, "size": N, "checks": [n for n, _, _ in checks],
                  "failed": failed}))
hvd.shutdown()
sys.exit(0)
