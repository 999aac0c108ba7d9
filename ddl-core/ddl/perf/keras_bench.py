"""Step time of one Keras 3 model (TensorFlow backend) trained with ``model.fit``, two
ways, on every rank of a ddlrun job::

    ddlrun -n 2 python -m ddl.perf.keras_bench [--steps 30]

- ``alone``: a plain optimizer, every rank training its own copy at the same time (no
  communication; the ranks still compete for the machine as in the others);
- ``ddl``: ``ddl.keras.DistributedOptimizer`` (one grouped allreduce per step).

``tf.distribute.MultiWorkerMirroredStrategy`` is not timed: with a ``TF_CONFIG`` made from
the job and the strategy created before any TensorFlow op, Keras 3.15's ``fit`` inside its
scope failed ("Attempt to convert a value (PerReplica...) to a Tensor"); see
docs/performance.md.

The model is an MLP of ``--width`` (2048: about 10.5 M float32 parameters, 42 MB of
gradients). A step's time is the time between two consecutive ``on_train_batch_end``
calls; the table shows the median over ``--steps`` after ``--warmup`` steps, on rank 0,
and each mode's ratio to ``alone``. The same as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import ddl.keras as hvd

    hvd.init()
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
