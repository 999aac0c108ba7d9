"""Horovod-compatibility names and behaviours of ddl.tensorflow / ddl.keras, on real ranks:
rank_op and kin, broadcast_, broadcast_global_variables, broadcast_variables of Keras 3
and tf variables in and out of tf.function, local sources and variables, Horovod's error
types. One JSON report per rank: (name, ok, detail) checks."""

import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl  # noqa: E402
import ddl.keras as hk  # noqa: E402
import ddl.tensorflow as hvd  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
checks: list[tuple[str, bool, str]] = []


def check(name, got, want, tol=1e-6):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    ok = got.shape == want.shape and np.allclose(got, want, rtol=tol, atol=tol)
    checks.append((name, bool(ok), "" if ok else f"got {got.ravel()[:6]} want "
                   f"{want.ravel()[:6]} shapes {got.shape} {want.shape}"))


def raises(name, fn, types):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        ok = all(isinstance(exc, t) for t in types)
        checks.append((name, ok, "" if ok else f"raised {type(exc).__mro__} {exc}"[:400]))
        return exc
    checks.append((name, False, "did not raise"))
    return None


def guard(label, fn):
    try:
        fn()
    except Exception:  # noqa: BLE001
        checks.append((label, False, traceback.format_exc()[-1500:]))


# ---------------------------------------------------------------- rank_op and kin
def ops_values():
    for mode, run in (("eager", lambda f: f()), ("function", lambda f: tf.function(f)())):
        check(f"rank_op/{mode}", run(lambda: hvd.rank_op()).numpy(), R)
        check(f"size_op/{mode}", run(lambda: hvd.size_op()).numpy(), N)
        check(f"local_rank_op/{mode}", run(lambda: hvd.local_rank_op()).numpy(),
              hvd.local_rank())
        check(f"local_size_op/{mode}", run(lambda: hvd.local_size_op()).numpy(),
              hvd.local_size())
        check(f"process_set_included_op/{mode}",
              run(lambda: hvd.process_set_included_op()).numpy(), 1)
        check(f"process_set_included_op/unknown/{mode}",
              run(lambda: hvd.process_set_included_op(99)).numpy(), -3)
    ps = hvd.add_process_set([0])
    table = hvd.mpi_ops._basics._get_process_set_ids_and_ranks()
    checks.append(("process_sets/ids_and_ranks",
                   table == {0: list(range(N)), ps.process_set_id: [0]}, str(table)))
    check("size_op/process_set", hvd.size_op(ps.process_set_id).numpy(), 1)
    check("process_set_included_op/process_set",
          hvd.process_set_included_op(ps.process_set_id).numpy(), int(R == 0))
    hvd.remove_process_set(ps)
    check("rank_op/dtype", int(hvd.rank_op().dtype == tf.int32), 1)


guard("ops_values", ops_values)


# ---------------------------------------------------------------- broadcast_
def inplace():
    v = tf.Variable(np.full(3, R + 1.0, np.float32))
    out = hvd.broadcast_([v], N - 1)
    check("broadcast_/eager/variable", v.numpy(), np.full(3, float(N)))
    check("broadcast_/eager/returned", out[0].numpy(), np.full(3, float(N)))
    w = tf.Variable(np.full((2, 2), R + 5.0))

    @tf.function
    def f():
        return hvd.broadcast_([w], 0)

    res = f()
    check("broadcast_/function/variable", w.numpy(), np.full((2, 2), 5.0))
    check("broadcast_/function/returned", res[0].numpy(), np.full((2, 2), 5.0))
    one = tf.Variable(float(R))
    check("broadcast_/single", hvd.broadcast_(one, 1).numpy(), 1.0)


guard("inplace", inplace)
raises("broadcast_global_variables/eager", lambda: hvd.broadcast_global_variables(0),
       [RuntimeError])


# ----------------------------------------- broadcast_variables: Keras 3 and tf, tf.function
def bvars():
    keras.utils.set_random_seed(100 + R)  # a different model on each rank
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    want = [np.asarray(v) for v in hk.broadcast(
        np.concatenate([np.ravel(v.numpy()) for v in model.variables]), 0).numpy()]
    tv = tf.Variable(np.full(2, R + 3.0, np.float32))

    @tf.function
    def first_batch():  # Horovod's tensorflow2_mnist.py, unchanged
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables([tv], root_rank=0)
        return tf.constant(0)

    first_batch()
    got = np.concatenate([np.ravel(v.numpy()) for v in model.variables])
    check("broadcast_variables/function/keras", got, np.asarray(want))
    check("broadcast_variables/function/tf.Variable", tv.numpy(), np.full(2, 3.0))
    keras.utils.set_random_seed(200 + R)
    m2 = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    root = hk.broadcast(np.ravel(m2.variables[0].numpy()), 1).numpy()
    hvd.broadcast_variables(m2.variables, root_rank=1)
    check("broadcast_variables/eager/keras", np.ravel(m2.variables[0].numpy()), root)
    tv2 = tf.Variable(np.full(2, R + 7.0))
    hvd.broadcast_variables([tv2], root_rank=1)
    check("broadcast_variables/eager/tf.Variable", tv2.numpy(), np.full(2, 8.0))


guard("bvars", bvars)


# ---------------------------------------------------- local sources (tape) and variables
def tape_local_source(mode):
        shared = tf.Variable(np.ones(3, np.float32))
        local = tf.Variable(np.ones(3, np.float32))
        c = float(R + 1)

        def grads():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(c * shared) + tf.reduce_sum(c * c * local)
            tape = hvd.DistributedGradientTape(tape)
            tape.register_local_source(local)
            return tape.gradient(loss, [shared, local])

        g = grads() if mode == "eager" else tf.function(grads)()
        mean_c = np.mean([r + 1.0 for r in range(N)])
        check(f"register_local_source/{mode}/shared", g[0].numpy(), np.full(3, mean_c))
        check(f"register_local_source/{mode}/local", g[1].numpy(), np.full(3, c * c / N))


def tapes():
    for mode in ("eager", "function"):
        tape_local_source(mode)

    keras.utils.set_random_seed(1)
    dense, head = keras.layers.Dense(2), keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((2,)), dense, head])
    x = tf.constant(np.full((1, 2), R + 1.0, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    plain = tape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=head)
    got = tape.gradient(loss, model.trainable_variables)
    every = [hk.allgather(np.ravel(p.numpy())[None]).numpy() for p in plain]
    for i, (v, g) in enumerate(zip(model.trainable_variables, got)):
        is_local = any(v is w for w in head.trainable_weights)
        want = np.ravel(plain[i].numpy()) / N if is_local else every[i].mean(axis=0)
        check(f"PartialDistributedGradientTape/{i}/{'local' if is_local else 'shared'}",
              np.ravel(g.numpy()), want, tol=1e-5)
    raises("PartialDistributedGradientTape/bad_layers",
           lambda: hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[1]),
           [ValueError])


guard("tapes", tapes)


def opt_local_var(mode):
        a = keras.Variable(np.zeros(3, np.float32))
        b = keras.Variable(np.zeros(3, np.float32))
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(1.0))
        opt.register_local_var(b)
        ga = tf.constant(np.full(3, R + 1.0, np.float32))
        gb = tf.constant(np.full(3, 2.0 * (R + 1), np.float32))
        if mode == "eager":
            opt.apply([ga, gb], [a, b])
        else:
            opt.build([a, b])
            tf.function(lambda: opt.apply([ga, gb], [a, b]))()
        mean = np.mean([r + 1.0 for r in range(N)])
        check(f"register_local_var/{mode}/shared", a.numpy(), np.full(3, -mean))
        check(f"register_local_var/{mode}/local", b.numpy(), np.full(3, -2.0 * (R + 1) / N))


def keras_local():
    for mode in ("eager", "function"):
        opt_local_var(mode)

    keras.utils.set_random_seed(5)
    body, head = keras.layers.Dense(2), keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((2,)), body, head])
    opt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[head])
    before = [v.numpy().copy() for v in model.trainable_variables]
    x = np.full((4, 2), R + 1.0, np.float32)
    y = np.full((4, 1), float(R), np.float32)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    for i, v in enumerate(model.trainable_variables):
        is_local = any(v is w for w in head.trainable_weights)
        delta = np.ravel(v.numpy() - before[i])
        every = hk.allgather(delta[None]).numpy()
        same = bool(np.allclose(every, every[0], atol=1e-7))
        # shared variables get one averaged update on every rank; local ones their own
        checks.append((f"PartialDistributedOptimizer/fit/{i}/"
                       f"{'local' if is_local else 'shared'}",
                       same != is_local, f"per-rank updates {every.tolist()}"))


guard("keras_local", keras_local)


def callback_local():
    keras.utils.set_random_seed(300 + R)
    d1, d2 = keras.layers.Dense(2), keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((2,)), d1, d2])
    own = d2.kernel.numpy().copy()
    root_d1 = hk.broadcast(d1.kernel.numpy(), 0).numpy()
    cb = hk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[d2.kernel])
    cb.set_model(model)
    cb.on_train_begin()
    check("BroadcastGlobalVariablesCallback/local_variables/kept", d2.kernel.numpy(), own)
    check("BroadcastGlobalVariablesCallback/local_variables/shared", d1.kernel.numpy(),
          root_d1)
    raises("BroadcastGlobalVariablesCallback/local_variables/bad",
           lambda: hk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[3]),
           [ValueError])


guard("callback_local", callback_local)


# ---------------------------------------------------------------- Horovod's error types
def errors():
    fpe = tf.errors.FailedPreconditionError
    raises("error/allreduce/shape", lambda: hvd.allreduce(tf.ones([3 + R])),
           [fpe, ddl.DDLMismatchError, ddl.DDLError, hvd.HorovodMismatchError])
    raises("error/allreduce/dtype",
           lambda: hvd.allreduce(tf.ones([3], dtype=tf.float32 if R else tf.float64)),
           [fpe, ddl.DDLError])
    raises("error/allgather/rank", lambda: hvd.allgather(tf.ones([2] + [2] * R)),
           [fpe, ddl.DDLError])
    raises("error/broadcast/root", lambda: hvd.broadcast(tf.ones([2]), R), [fpe, ddl.DDLError])
    raises("error/broadcast_variables/shape",
           lambda: hvd.broadcast_variables([tf.Variable(tf.ones([2 + R]))], 0),
           [fpe, ddl.DDLError])
    e = raises("error/function/shape", lambda: tf.function(
        lambda t: hvd.allreduce(t, name="grads"))(tf.ones([3 + R])), [tf.errors.OpError])
    checks.append(("error/function/message", e is not None and "DDLMismatchError" in str(e),
                   str(e)[-300:]))
    s = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1]), tf.constant([4, 3]))
    for op in (hvd.Min, hvd.Max):
        raises(f"error/indexed_slices/{op.name.title()}", lambda op=op: hvd.allreduce(s, op=op),
               [NotImplementedError])
    raises("error/indexed_slices/prescale",
           lambda: hvd.allreduce(s, op=hvd.Sum, prescale_factor=2.0), [NotImplementedError])
    raises("error/indexed_slices/postscale",
           lambda: hvd.allreduce(s, op=hvd.Sum, postscale_factor=0.5), [NotImplementedError])
    raises("error/indexed_slices/grouped_prescale",
           lambda: hvd.grouped_allreduce([s], op=hvd.Average, prescale_factor=2.0),
           [NotImplementedError])
    raises("error/indexed_slices/function",
           lambda: tf.function(lambda: hvd.allreduce(s, op=hvd.Max))(), [NotImplementedError])
    # the job goes on after every one of them
    check("error/after", hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy(), np.full(2, float(N)))


guard("errors", errors)

print(json.dumps({"rank": R, "size": N, "checks": sorted(c[0] for c in checks),
                  "failed": [c for c in checks if not c[1]]}))
sys.stdout.flush()
hvd.shutdown()
