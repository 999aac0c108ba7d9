"""Elastic training's TensorFlow and Keras side (test_elastic_tf.py reads the report, one
JSON line per rank, section by section).

``single`` (1 rank, no launcher): KerasState and TensorFlowState save and restore bit for
bit after training; the model.fit callbacks (commits counted, state.batch/epoch tracked,
a restart in the middle of an epoch); a TensorFlow error caused by a lost peer taken for
HorovodInternalError. ``sync`` (under ddlrun): every rank starts from its own model,
optimizer and values; ``state.sync()`` makes them rank 0's.
"""

import hashlib
import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl  # noqa: E402
import ddl.keras as hvd  # noqa: E402
import ddl.tensorflow as htf  # noqa: E402

STEPS, B = 5, 4  # batches per epoch, batch size


def digest(variables):
    """Bit-identity of a list of variables: their dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for v in variables:
        a = np.ascontiguousarray(keras.ops.convert_to_numpy(v))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def make_model(seed, distributed=False):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(0.05)
    model.compile(optimizer=hvd.DistributedOptimizer(opt) if distributed else opt, loss="mse")
    return model


def data(seed=0, steps=STEPS):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((steps * B, 3)).astype("float32"),
            rng.standard_normal((steps * B, 1)).astype("float32"))


def keras_state_section():
    model = make_model(1)
    opt = model.optimizer
    built_before = bool(opt.built)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    out = {"built_before": built_before, "built": bool(opt.built),
           "opt_vars": len(opt.variables)}
    x, y = data()
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    state.epoch = 2
    state.commit()
    committed = digest(model.variables), digest(opt.variables)
    slots = [v for v in opt.variables if "momentum" in v.path or "velocity" in v.path]
    out["slots"] = len(slots)
    out["slots_nonzero"] = all(np.any(keras.ops.convert_to_numpy(v)) for v in slots)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    state.epoch = 7
    out["changed"] = (digest(model.variables), digest(opt.variables)) != committed
    state.restore()
    out["restored"] = (digest(model.variables), digest(opt.variables)) == committed
    out["epoch"] = state.epoch
    return out


def tf_state_section():
    a, b = tf.Variable([1.0, 2.0, 3.0]), tf.Variable([[4, 5]], dtype=tf.int64)
    state = htf.elastic.TensorFlowState([a, b], step=0)
    a.assign_add([0.5, 0.25, 0.125])
    state.step = 3
    state.commit()
    committed = digest([a, b])
    a.assign([9.0, 9.0, 9.0])
    b.assign([[7, 7]])
    state.step = 4
    state.restore()
    out = {"restored": digest([a, b]) == committed, "a": a.numpy().tolist(),
           "b": b.numpy().tolist(), "step": state.step}
    for name, kwargs in (("session", {"variables": [a], "session": object()}),
                         ("no_variables", {})):
        try:
            htf.elastic.TensorFlowState(**kwargs)
            out[name] = "no error"
        except ddl.DDLConfigError as exc:
            out[name] = str(exc)
    return out


class Recorder(keras.callbacks.Callback):
    """What the state holds after the elastic callbacks before it have run."""

    def __init__(self, state):
        super().__init__()
        self.state, self.batches, self.epochs = state, [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.batches.append([])

    def on_train_batch_end(self, batch, logs=None):
        self.batches[-1].append([self.state.batch, self.state.commits])

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append([self.state.epoch, self.state.batch, self.state.commits])


def callbacks_section():
    model = make_model(2, distributed=True)  # as in Horovod's example
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    x, y = data()
    out = {}
    for name, start in (("fresh", (0, 0)), ("restarted", (1, 3))):
        state.epoch, state.batch = start
        recorder = Recorder(state)
        # Horovod's order (its keras_mnist_elastic example), the recorder last
        callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                     hvd.elastic.UpdateBatchStateCallback(state),
                     hvd.elastic.CommitStateCallback(state, batches_per_commit=2), recorder]
        before = state.commits
        model.fit(x, y, batch_size=B, epochs=3 - state.epoch, shuffle=False, verbose=0,
                  callbacks=callbacks)
        out[name] = {"batches": recorder.batches, "epochs": recorder.epochs,
                     "commits": state.commits - before, "first": before,
                     "epoch": state.epoch, "batch": state.batch}
    return out


def error_section():
    from ddl.errors import DDLPeerError

    # ddl raised this in the op (inside a tf.function TensorFlow re-raises it as its own
    # error, the message carried on)
    peer = DDLPeerError("DDL allreduce 'grad/dense': rank 1 exited (test)")
    state = hvd.elastic.ObjectState(epoch=0)
    out = {}
    for name, exc in (("peer", tf.errors.UnknownError(None, None, f"Error: {peer}")),
                      ("other", tf.errors.InvalidArgumentError(None, None, "bad shape"))):

        @htf.elastic.run
        def train(state, exc=exc):
            raise exc

        try:
            train(state)
            out[name] = {"raised": None}
        except Exception as got:  # noqa: BLE001 - what came out is what is reported
            out[name] = {"raised": type(got).__name__,
                         "internal": isinstance(got, hvd.HorovodInternalError),
                         "cause_is_original": got.__cause__ is exc, "same": got is exc}
    return out


def sync_section():
    rank = ddl.rank()
    model = make_model(10 + rank)  # every rank's own initial weights
    state = hvd.elastic.KerasState(model, batch=rank, epoch=5 + rank)
    x, y = data(seed=rank, steps=1 + rank)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)  # own Adam slots
    var = tf.Variable([float(rank)] * 3)
    tf_state = htf.elastic.TensorFlowState([var], note=f"rank {rank}")
    before = digest(model.variables), digest(model.optimizer.variables)
    state.sync()
    tf_state.sync()
    after = digest(model.variables), digest(model.optimizer.variables)
    # what sync made is what a restore brings back
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    state.restore()
    return {"before": before, "after": after, "batch": state.batch, "epoch": state.epoch,
            "var": var.numpy().tolist(), "note": tf_state.note,
            "restored": (digest(model.variables), digest(model.optimizer.variables)) == after}


def main():
    mode = sys.argv[1]
    ddl.init()
    sections = {"single": [keras_state_section, tf_state_section, callbacks_section,
                           error_section],
                "sync": [sync_section]}[mode]
    out = {"rank": ddl.rank(), "size": ddl.size()}
    for fn in sections:
        try:
            out[fn.__name__[: -len("_section")]] = fn()
        except Exception:  # noqa: BLE001 - reported, section by section
            out[fn.__name__[: -len("_section")]] = {"error": traceback.format_exc()}
    print(json.dumps(out), flush=True)
    ddl.shutdown()


if __name__ == "__main__":
    main()
