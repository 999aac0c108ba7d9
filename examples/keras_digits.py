"""Keras 3 ``model.fit`` on scikit-learn's bundled 8x8 digits, data-parallel with ddl.keras
(Horovod's ``horovod.tensorflow.keras`` API)::

    ddlrun -n 2 python examples/keras_digits.py --epochs 10 --checkpoint digits.keras

Each rank trains on its own shard of the training set; the learning rate is scaled by the
number of ranks and warmed up (Goyal et al.); rank 0 alone writes the checkpoint and
prints. Runs on the tensorflow (default) or torch Keras backend (``KERAS_BACKEND``).
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
from sklearn.datasets import load_digits

import ddl.keras as hvd


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--checkpoint", default=None,
                   help="write the model here after every epoch, on rank 0 (a .keras path)")
    p.add_argument("--seed", type=int, default=0)
    return p


def digits(seed: int) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test): the 1797 digits scaled to [0, 1], 20% held out,
    the same split on every rank."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = (x[order] / 16.0).astype("float32"), y[order].astype("int64")
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hvd.init()
    keras.utils.set_random_seed(args.seed + hvd.rank())  # rank 0's weights win below
    x_train, y_train, x_test, y_test = digits(args.seed)
    # Equal shards, so every rank runs the same number of steps (a rank with a step more
    # would wait in an allreduce that no other rank joins: ddl raises DDLMismatchError).
    keep = len(x_train) // hvd.size() * hvd.size()
    x_train, y_train = x_train[hvd.rank():keep:hvd.size()], y_train[hvd.rank():keep:hvd.size()]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    lr = args.lr * hvd.size()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # every rank starts from rank 0
        hvd.callbacks.MetricAverageCallback(),  # logs: the average over ranks
        hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=args.warmup_epochs),
    ]
    if hvd.rank() == 0 and args.checkpoint:  # one writer: ranks hold the same weights
        callbacks.append(keras.callbacks.ModelCheckpoint(args.checkpoint))
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)  # same weights on every rank
    if hvd.rank() == 0:
        print(f"final accuracy: {accuracy:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
