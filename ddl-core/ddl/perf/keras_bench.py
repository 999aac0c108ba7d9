"""Step time of one Keras 3 model (TensorFlow backend), three ways, on every rank of a
ddlrun job::

    ddlrun -n 2 python -m ddl.perf.keras_bench [--steps 30]

- ``alone``: ``model.fit`` with a plain optimizer, every rank training its own copy at the
  same time (no communication; the ranks still compete for the machine as in the others);
- ``ddl``: ``model.fit`` with ``ddl.keras.DistributedOptimizer`` (one grouped allreduce
  per step);
- ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy`` (``RING``), one worker per rank,
  ``TF_CONFIG`` built from the job (each rank's address and a free port, exchanged with
  ``allgather_object``), the strategy created before any other TensorFlow op. Keras 3.15's
  ``fit`` fails inside the strategy's scope ("Attempt to convert a value (PerReplica...)
  to a Tensor", keras-team/keras#20585), so this mode is a custom loop: model and Keras
  optimizer created in ``strategy.scope()``, a ``tf.function`` running
  ``strategy.run(step)``, the step a ``tf.GradientTape`` of the same loss and
  ``optimizer.apply(grads, model.trainable_variables)`` (Keras sums the gradients over the
  workers with the strategy's all-reduce; the loss is averaged over the global batch).
  After its timed steps the script asserts that every rank holds the same weights (the
  ranks train on different data, so only a synchronized update keeps them equal).

The model is an MLP of ``--width`` (2048: about 10.5 M float32 parameters, 42 MB of
gradients). A step's time is the time between two consecutive ``on_train_batch_end``
calls (in ``mwms``: between two consecutive step returns, the loss fetched); the table
shows the median over ``--steps`` after ``--warmup`` steps, on rank 0, and each mode's
ratio to ``alone``. The same as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from .train_keras import mwms_strategy  # shared with ddl-perf train --framework keras


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddl.perf.keras_bench",
                                description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    p.add_argument("--width", type=int, default=2048, help="hidden width of the MLP")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


class _Timer:
    """Seconds between consecutive batch ends, the first ``skip`` dropped."""

    def __init__(self, keras: Any, skip: int) -> None:
        timer = self

        class Callback(keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
                now = time.perf_counter()
                if timer.last is not None and batch >= skip:
                    timer.times.append(now - timer.last)
                timer.last = now

        self.times: list[float] = []
        self.last: float | None = None
        self.callback = Callback()


def _model(keras: Any, dim: int, width: int) -> Any:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((dim,)),
                             keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(10)])


def _time_fit(keras: Any, model: Any, optimizer: Any, data: Any, args: Any,
              callbacks: list) -> float:
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    timer = _Timer(keras, args.warmup)
    steps = args.warmup + args.steps + 1
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False,
              callbacks=[*callbacks, timer.callback])
    return statistics.median(timer.times)


def _time_mwms(keras: Any, tf: Any, hvd: Any, strategy: Any, x: Any, y: Any, dim: int,
               args: Any) -> float:
    with strategy.scope():
        model = _model(keras, dim, args.width)
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction=None)
    global_batch = args.batch * strategy.num_replicas_in_sync

    def step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model(xb, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def train_step(xb: Any, yb: Any) -> Any:
        per_replica = strategy.run(step, args=(xb, yb))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    xb, yb = tf.constant(x), tf.constant(y)
    times: list[float] = []
    last = None
    for i in range(args.warmup + args.steps + 1):
        train_step(xb, yb).numpy()
        now = time.perf_counter()
        if last is not None and i >= args.warmup:
            times.append(now - last)
        last = now
    mine = [w.numpy() for w in model.trainable_weights]
    ref = hvd.broadcast_object(mine, 0)
    same = all(bool((a == b).all()) for a, b in zip(mine, ref))
    agree = hvd.allgather_object(same)
    assert all(agree), f"mwms: weights differ between ranks after training ({agree})"
    if hvd.rank() == 0 and not args.json:
        print(f"# mwms: the {len(mine)} weight tensors are equal on all {hvd.size()} ranks "
              f"after {args.warmup + args.steps + 1} steps on different data (synchronized)")
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import ddl.keras as hvd

    hvd.init()
    strategy = mwms_strategy(hvd)  # before any other TensorFlow op
    import keras
    import numpy as np
    import tensorflow as tf

    dim = 1024
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((args.batch, dim)).astype("float32")
    y = rng.integers(0, 10, args.batch)
    local = tf.data.Dataset.from_tensors((x, y)).repeat()

    results: dict[str, float] = {}
    model = _model(keras, dim, args.width)
    params = model.count_params()
    hvd.broadcast_object(0)  # start together
    results["alone"] = _time_fit(keras, model, keras.optimizers.SGD(0.01), local, args, [])
    hvd.broadcast_object(0)
    results["ddl"] = _time_fit(
        keras, _model(keras, dim, args.width),
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), local, args,
        [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    hvd.broadcast_object(0)
    results["mwms"] = _time_mwms(keras, tf, hvd, strategy, x, y, dim, args)

    if hvd.rank() == 0:
        base = results["alone"]
        if args.json:
            print(json.dumps(dict(params=params, ranks=hvd.size(), batch=args.batch,
                                  steps=args.steps, median_s=results)))
        else:
            print(f"# Keras 3 {keras.__version__} (TensorFlow {tf.__version__}), "
                  f"{hvd.size()} ranks, MLP {params / 1e6:.1f} M parameters, batch "
                  f"{args.batch} per rank, median of {args.steps} steps")
            print(f"# {'mode':<6} {'step ms':>9} {'x alone':>8}")
            for mode, t in results.items():
                print(f"  {mode:<6} {t * 1e3:>9.1f} {t / base:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
