"""ddl.keras on N ranks, on the Keras backend named by KERAS_BACKEND, against one process
(or a hand-computed reference): model.fit with DistributedOptimizer and the callbacks,
save and hvd.load_model, backward_passes_per_step, the learning-rate callbacks, and on the
tensorflow backend a DistributedGradientTape loop and jit_compile=True.

argv[1]: a directory shared by the ranks (rank 0 saves its model there). Prints one JSON
line: {section: result or {"error": traceback}}.
"""

import sys
import traceback
import warnings

import keras
import numpy as np
from keras_common import (
    CLASSES,
    STEPS,
    B,
    backend,
    data,
    digest,
    make_model,
    rel_diff,
    report,
    shard,
    weights,
)

import ddl.keras as hvd
from ddl.keras.optimizer import is_distributed

hvd.init()
R, N = hvd.rank(), hvd.size()
OUT_DIR = sys.argv[1]
LR = 0.1
EPOCHS = 2


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Record(keras.callbacks.Callback):
    """The learning rate each batch trains with, and the epoch's logs as this callback
    sees them (before or after MetricAverageCallback, by its place in the list)."""

    def __init__(self):
        super().__init__()
        self.lrs, self.losses = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["loss"]))


def distributed_fit(seed, optimizer, x, y, epochs, extra=(), jit_compile="auto"):
    model = make_model(keras, seed)
    model.compile(optimizer=optimizer, loss=loss(), jit_compile=jit_compile)
    history = model.fit(shard(x, R, N, len(x) // (N * B)), shard(y, R, N, len(x) // (N * B)),
                        batch_size=B, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), *extra])
    return model, history


STATE = {}


def fit_section():
    x, y = data(N)
    ref = make_model(keras, 1)
    ref.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9), loss=loss())
    ref.fit(x, y, batch_size=N * B, epochs=EPOCHS, shuffle=False, verbose=0)
    local, averaged = Record(), Record()
    # Every rank starts from other weights: the broadcast makes them rank 0's (seed 1).
    model, history = distributed_fit(
        1 + R, hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), x, y,
        EPOCHS, extra=[local, hvd.callbacks.MetricAverageCallback(), averaged])
    STATE["model"] = model
    return dict(digest=digest(weights(model)), vs_one_process=rel_diff(weights(model),
                                                                          weights(ref)),
                local_loss=local.losses, averaged_loss=averaged.losses,
                history_loss=[float(v) for v in history.history["loss"]],
                distributed=is_distributed(model.optimizer))


def save_section():
    model = STATE["model"]
    path = f"{OUT_DIR}/m.keras"
    if R == 0:
        model.save(path)
    hvd.broadcast_object(0, 0)  # the file is written before anybody reads it
    loaded = hvd.load_model(path)
    opt = loaded.optimizer
    same_on_load = rel_diff(weights(loaded), weights(model)) == 0.0
    x, y = data(N)
    for m in (model, loaded):  # one more epoch each: the optimizer's state must be there
        m.fit(shard(x, R, N), shard(y, R, N), batch_size=B, epochs=1, shuffle=False,
              verbose=0)
    return dict(distributed=is_distributed(opt), iterations=int(
        keras.ops.convert_to_numpy(opt.iterations)), cls=type(opt).__name__,
        module=type(opt).__module__, same_on_load=same_on_load,
        digest=digest(weights(loaded)),
        vs_continued_original=rel_diff(weights(loaded), weights(model)))


def numpy_grads(ws, x, y):
    """The gradient of the mean cross-entropy of Dense(tanh) -> Dense, by hand."""
    w1, b1, w2, b2 = ws
    h = np.tanh(x @ w1 + b1)
    z = h @ w2 + b2
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dz = (p - np.eye(CLASSES)[y]) / len(x)
    da = (dz @ w2.T) * (1 - h * h)
    return [x.T @ da, da.sum(0), h.T @ dz, dz.sum(0)]


def accumulation_section():
    steps = 4  # two updates of two backward passes each
    x, y = data(N, steps=steps, seed=1)
    out = {}
    for average in (False, True):
        ws = [w.astype(np.float64) for w in weights(make_model(keras, 1))]
        for k in range(0, steps, 2):
            rows = [slice(s * N * B, (s + 1) * N * B) for s in (k, k + 1)]
            # the Average over ranks of a step's gradients = the whole batch's gradient
            g = [a + b for a, b in zip(numpy_grads(ws, x[rows[0]], y[rows[0]]),
                                       numpy_grads(ws, x[rows[1]], y[rows[1]]))]
            ws = [w - LR * (gi / 2 if average else gi) for w, gi in zip(ws, g)]
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=2,
                                       average_aggregated_gradients=average)
        model, _ = distributed_fit(1 + R, opt, x, y, 1)
        got = weights(model)
        out["average" if average else "sum"] = dict(
            digest=digest(got), vs_hand=rel_diff(got, ws),
            iterations=int(keras.ops.convert_to_numpy(model.optimizer.iterations)))
        out["ref_" + ("average" if average else "sum")] = [w.tolist() for w in ws]
    # the sum is not the average: the two references are apart, so the check can tell
    out["references_apart"] = rel_diff([np.asarray(w) for w in out.pop("ref_sum")],
                                       [np.asarray(w) for w in out.pop("ref_average")])
    return out


def lr_section():
    x, y = data(N)
    lr0 = LR * N
    warm = Record()
    warmup = hvd.callbacks.LearningRateWarmupCallback(lr0, warmup_epochs=2)
    model, history = distributed_fit(1, hvd.DistributedOptimizer(keras.optimizers.SGD(lr0)),
                                     x, y, 3, extra=[warmup, warm])
    stair = Record()
    cbs = [hvd.callbacks.LearningRateScheduleCallback(0.2, lambda e: 0.5 ** e, start_epoch=1,
                                                      end_epoch=3),
           hvd.callbacks.LearningRateScheduleCallback(0.2, 0.01, start_epoch=3), stair]
    distributed_fit(1, hvd.DistributedOptimizer(keras.optimizers.SGD(0.2)), x, y, 4,
                    extra=cbs)
    smooth = Record()
    cbs = [hvd.callbacks.LearningRateScheduleCallback(0.2, lambda e: 1 / (1 + e),
                                                      staircase=False), smooth]
    distributed_fit(1, hvd.DistributedOptimizer(keras.optimizers.SGD(0.2)), x, y, 2,
                    extra=cbs)
    return dict(warmup=warm.lrs, warmup_epoch_lr=[float(v) for v in history.history["lr"]],
                staircase=stair.lrs, smooth=smooth.lrs, steps=STEPS)


def xla_section():
    x, y = data(N)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, history = distributed_fit(1 + R, hvd.DistributedOptimizer(
            keras.optimizers.SGD(LR)), x, y, 2, jit_compile=True)
    texts = [str(w.message) for w in caught if "ddl" in str(w.message)]
    return dict(warnings=texts, jit_compile=bool(model.jit_compile),
                digest=digest(weights(model)),
                finite=bool(np.isfinite(history.history["loss"]).all()))


def tape_section():
    import tensorflow as tf

    import ddl.tensorflow as hvd_tf

    x, y = data(N)
    steps = len(x) // (N * B)
    loss_fn = loss()

    def train(model, opt, distributed):
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                value = loss_fn(yb, model(xb, training=True))
            if distributed:
                tape = hvd_tf.DistributedGradientTape(tape)
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return value

        return step

    ref = make_model(keras, 1)
    ref_opt = keras.optimizers.SGD(LR, momentum=0.9)
    ref_step = train(ref, ref_opt, False)
    for s in range(steps):
        ref_step(x[s * N * B:(s + 1) * N * B], y[s * N * B:(s + 1) * N * B])

    model = make_model(keras, 1 + R)
    opt = keras.optimizers.SGD(LR, momentum=0.9)
    opt.build(model.trainable_variables)
    hvd_tf.broadcast_variables(model.variables, root_rank=0)
    hvd_tf.broadcast_variables(opt.variables, root_rank=0)
    step = train(model, opt, True)
    xs, ys = shard(x, R, N), shard(y, R, N)
    for s in range(steps):
        step(xs[s * B:(s + 1) * B], ys[s * B:(s + 1) * B])
    return dict(digest=digest(weights(model)),
                vs_one_process=rel_diff(weights(model), weights(ref)),
                traced=step.experimental_get_tracing_count())


SECTIONS = {"fit": fit_section, "save": save_section, "accumulation": accumulation_section,
            "lr": lr_section}
if backend() == "tensorflow":
    SECTIONS.update(xla=xla_section, tape=tape_section)

results = {"backend": keras.backend.backend(), "rank": R}
for name, fn in SECTIONS.items():
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()}
report(results)
