"""Horovod behaviours that Horovod's own test_tensorflow.py found missing in ddl.tensorflow,
checked on real ranks, eagerly, in a tf.function and in a TF1 graph session. One JSON
report per rank: (name, ok, detail) checks."""

import json
import os
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as hvd  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
checks: list[tuple[str, bool, str]] = []


def check(name, got, want, tol=1e-6):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    ok = got.shape == want.shape and np.allclose(got, want, rtol=tol, atol=tol)
    checks.append((name, bool(ok), "" if ok else f"got {got.ravel()[:6]} want "
                   f"{want.ravel()[:6]} shapes {got.shape} {want.shape}"))


def guard(label, fn):
    try:
        fn()
    except Exception:  # noqa: BLE001
        checks.append((label, False, traceback.format_exc()[-1500:]))


# ------------------------------------- DistributedGradientTape(process_set=) outside the set
def tape_outside_set():
    """Horovod's test_distributed_gradient_tape_process_sets: the even ranks average
    d(x*x)/dx = 2x; a rank outside the set keeps its own gradient."""
    subset = hvd.add_process_set(range(0, N, 2))
    want = 2.0 * sum(subset.ranks) / subset.size() if subset.included() else 2.0 * R

    def grad():
        x = tf.constant(float(R))
        with tf.GradientTape() as g:
            g.watch(x)
            y = x * x
        return hvd.DistributedGradientTape(g, process_set=subset).gradient(y, [x])[0]

    check("tape_process_set/eager", grad(), want)
    check("tape_process_set/function", tf.function(grad)(), want)
    with tf.Graph().as_default():
        out = grad()
        with tf.compat.v1.Session() as sess:
            check("tape_process_set/graph", sess.run(out), want)
    hvd.remove_process_set(subset)


guard("tape_process_set", tape_outside_set)


# ------------------------------------------- DistributedOptimizer of a TF1 train.Optimizer
class _AddOptimizer(tf.compat.v1.train.Optimizer):
    """Adds the gradient to the variable; the gradient of its one variable is this rank's
    number (dense, or as tf.IndexedSlices)."""

    def __init__(self, sparse=False):
        super().__init__(use_locking=False, name="add")
        self.variable = tf.compat.v1.Variable([0.0])
        self.sparse = sparse

    def compute_gradients(self, *args, **kwargs):
        g = tf.constant([float(R)])
        if self.sparse:
            g = tf.IndexedSlices(g, tf.constant([0]), tf.constant([1]))
        return [(g, self.variable)]

    def _apply_dense(self, grad, var):
        return var.assign_add(grad)

    def _resource_apply_dense(self, grad, var):
        return var.assign_add(grad)


def legacy_aggregation(sparse):
    """k=3 backward passes per step, averaged: every 3rd session.run adds mean(ranks)
    (the sum of 3 passes of rank r is 3r, divided by 3, averaged over the ranks); the
    global step counts every run."""
    label = "legacy/aggregation/" + ("sparse" if sparse else "dense")
    with tf.Graph().as_default():
        base = _AddOptimizer(sparse)
        opt = hvd.DistributedOptimizer(base, backward_passes_per_step=3,
                                       average_aggregated_gradients=True,
                                       sparse_as_dense=sparse)
        step = tf.compat.v1.Variable(0, dtype=tf.int64, trainable=False)
        update = opt.apply_gradients(opt.compute_gradients(), global_step=step)
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(),
                      tf.compat.v1.local_variables_initializer()])
            got, steps = [], []
            for _ in range(7):
                sess.run(update)
                got.append(sess.run(base.variable)[0])
                steps.append(sess.run(step))
    mean = sum(range(N)) / N
    check(label, got, [mean * ((i + 1) // 3) for i in range(7)])
    check(label + "/global_step", steps, list(range(1, 8)))


def legacy_process_set():
    """The even ranks average their gradients; a rank outside the set applies its own."""
    subset = hvd.add_process_set(range(0, N, 2))
    with tf.Graph().as_default():
        base = _AddOptimizer()
        opt = hvd.DistributedOptimizer(base, process_set=subset)
        update = opt.apply_gradients(opt.compute_gradients())
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(update)
            got = sess.run(base.variable)[0]
    want = sum(subset.ranks) / subset.size() if subset.included() else float(R)
    check("legacy/process_set", got, want)
    hvd.remove_process_set(subset)


guard("legacy/aggregation/dense", lambda: legacy_aggregation(False))
guard("legacy/aggregation/sparse", lambda: legacy_aggregation(True))
guard("legacy/process_set", legacy_process_set)


# ------------------------------------------------- Horovod's error types for refused calls
def raises(name, fn, types):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        ok = all(isinstance(exc, t) for t in types)
        checks.append((name, ok, "" if ok else f"raised {type(exc).__mro__} {exc}"[:400]))
        return
    checks.append((name, False, "did not raise"))


def refused_calls():
    """Horovod raises tf.errors.InvalidArgumentError for an alltoall whose rows do not
    split over the ranks and for a process set this rank is not in, and ValueError for a
    process set that is not registered (in a graph, when the op is built); ddl's errors
    stay ddl.DDLConfigErrors. The ranks are in step afterwards."""
    invalid = (tf.errors.InvalidArgumentError, hvd.DDLConfigError)
    raises("refused/alltoall_rows/eager", lambda: hvd.alltoall(tf.ones([N + 1])), invalid)
    others = hvd.add_process_set([r for r in range(N) if r != 0])
    if R == 0:
        raises("refused/not_member/eager",
               lambda: hvd.allreduce(tf.ones([4]), process_set=others), invalid)
        with tf.Graph().as_default():
            raises("refused/not_member/graph",
                   lambda: hvd.allreduce(tf.ones([4]), process_set=others), invalid)
    else:
        checks.append(("refused/not_member/eager", True, ""))
        checks.append(("refused/not_member/graph", True, ""))
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 10
    with tf.Graph().as_default():
        raises("refused/unregistered/graph",
               lambda: hvd.allreduce(tf.ones([4]), process_set=fake), (ValueError,))
    raises("refused/unregistered/eager",
           lambda: hvd.allreduce(tf.ones([4]), process_set=fake), (ValueError,))
    hvd.remove_process_set(others)
    check("refused/in_step_after", hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum),
          [sum(range(N))])


guard("refused", refused_calls)
hvd.barrier()
print(json.dumps({"rank": R, "checks": [c[0] for c in checks],
                  "failed": [c for c in checks if not c[1]]}), flush=True)
