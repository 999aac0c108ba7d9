"""TF1 graph mode (tf.compat.v1 sessions): every collective is named as Horovod names it,
and that name reaches the core; calls that differ across ranks raise Horovod's
FailedPreconditionError and the ranks stay in step; then 8 independent same-shape allreduces in one
session.run, built in another order on each rank, checked against the right sums, 3
times. One JSON report per rank."""

import json
import os
import sys
import threading
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as hvd  # noqa: E402
from ddl.hvd import collectives as C  # noqa: E402

tf.compat.v1.disable_eager_execution()
hvd.init()
R, N = hvd.rank(), hvd.size()
checks: list[tuple[str, bool, str]] = []
seen: list[str | None] = []


def recording(fn):
    def wrapped(*args, **kwargs):
        seen.append(kwargs.get("name"))
        return fn(*args, **kwargs)
    return wrapped


for attr in ("allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall",
             "reducescatter", "broadcast_group_"):
    setattr(C, attr, recording(getattr(C, attr)))


def names():
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.ones(4, np.float32), name="x")
        y = tf.constant(np.ones((2, 2), np.float32), name="y")
        ops = [hvd.allreduce(x, op=hvd.Sum)]
        with tf.name_scope("tower"):
            ops.append(hvd.allreduce(x, op=hvd.Sum))
            ops.append(hvd.allreduce(x, op=hvd.Sum, ignore_name_scope=True, name="given"))
            ops.append(hvd.allgather(y))
        ops.append(hvd.broadcast(y, 0))
        ops.append(hvd.grouped_allreduce([x, y], op=hvd.Sum)[0])
        ops.append(hvd.allreduce(x, op=hvd.Sum, name="mine"))
        want = ["HorovodAllreduce_x_0", "tower/HorovodAllreduce_x_0", "given",
                "tower/HorovodAllgather_y_0", "HorovodBroadcast_y_0",
                "HorovodGroupedAllreduce_x_0_y_0", "mine"]
        with tf.compat.v1.Session(graph=g, config=tf.compat.v1.ConfigProto(
                inter_op_parallelism_threads=1)) as sess:
            for op in ops:  # one at a time: the same order on every rank
                del seen[:]
                sess.run(op)
                checks.append((f"name/{want[ops.index(op)]}",
                               seen == [want[ops.index(op)]], f"core got {seen}"))


def independent(repeats=3):
    g = tf.Graph()
    with g.as_default():
        order = range(8) if R == 0 else reversed(range(8))
        outs = {}
        for i in order:  # built (and run) in another order on each rank
            t = tf.constant(np.full(16, (i + 1) * (R + 1), np.float32), name=f"t{i}")
            outs[i] = hvd.allreduce(t, op=hvd.Sum)
        want = {i: np.full(16, (i + 1) * N * (N + 1) / 2) for i in range(8)}
        # its own 16 threads: each collective blocks one while it waits for its namesake,
        # and the process-wide pool is the first session's (names() made it 1 thread)
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=16,
                                          use_per_session_threads=True)
        with tf.compat.v1.Session(graph=g, config=config) as sess:
            for k in range(repeats):
                got = sess.run({i: outs[i] for i in range(8)})
                ok = all(np.array_equal(got[i], want[i]) for i in range(8))
                checks.append((f"independent/{k}", ok,
                               "" if ok else str({i: got[i][0] for i in range(8)})))


def errors():
    """Calls that differ across ranks raise Horovod's FailedPreconditionError from
    session.run on every rank, and the next call pairs again."""
    g = tf.Graph()
    with g.as_default():
        cases = {
            "allreduce/shape": hvd.allreduce(tf.ones([3 + R])),
            "allreduce/dtype": hvd.allreduce(tf.ones([3], tf.float32 if R else tf.int32)),
            "allgather/rank": hvd.allgather(tf.ones([2] + [2] * R)),
            "broadcast/root": hvd.broadcast(tf.ones([2]), R),
            "alltoall/dtype": hvd.alltoall(tf.ones([2 * N], tf.float32 if R else tf.int32)),
            "grouped/shape": hvd.grouped_allreduce([tf.ones([2]), tf.ones([1 + R])])[1],
        }
        after = hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum)
        with tf.compat.v1.Session(graph=g) as sess:
            for label, op in cases.items():
                try:
                    sess.run(op)
                    checks.append((f"error/{label}", N == 1, "no error"))
                except tf.errors.FailedPreconditionError as exc:
                    checks.append((f"error/{label}", "DDLMismatchError" in str(exc),
                                   str(exc)[-300:]))
                except Exception as exc:  # noqa: BLE001
                    checks.append((f"error/{label}", False, f"{type(exc).__name__}: {exc}"))
                got = sess.run(after)
                checks.append((f"error/{label}/after", got[0] == sum(range(N)), str(got)))


def report():
    print(json.dumps({"rank": R, "size": N, "checks": sorted(c[0] for c in checks),
                      "failed": [c for c in checks if not c[1]]}))
    sys.stdout.flush()
    os._exit(0)  # collectives stuck in a session.run must not hold the exit


def watchdog():  # a session with too few threads waits forever: say so, do not hang
    checks.append(("independent", False, "session.run did not finish in 40 s"))
    report()


for label, fn in (("names", names), ("errors", errors), ("independent", independent)):
    timer = threading.Timer(40.0, watchdog) if label == "independent" else None
    if timer:
        timer.start()
    try:
        fn()
    except Exception:  # noqa: BLE001
        checks.append((label, False, traceback.format_exc()[-1500:]))
    if timer:
        timer.cancel()
report()
