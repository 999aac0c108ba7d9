"""A TensorFlow 2 custom training loop on scikit-learn's bundled 8x8 digits, data-parallel
with ``ddl.tensorflow.DistributedGradientTape`` inside a ``tf.function`` (Horovod's TF2
API)::

    ddlrun -n 2 python examples/tf_custom_loop.py --epochs 10

Each rank trains on its own shard; the gradients are averaged over the ranks in the
compiled step (one grouped allreduce); rank 0 prints.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import ddl.tensorflow as hvd


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
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
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    # Every rank must run the same number of steps: drop the ragged last batch.
    steps = min(hvd.allgather_object(len(x_train) // args.batch_size))
    data = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
            .shuffle(len(x_train), seed=args.seed + hvd.rank())
            .batch(args.batch_size, drop_remainder=True).take(steps))

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    opt.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)  # every rank starts from rank 0
    hvd.broadcast_variables(opt.variables, root_rank=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)  # gradient(): averaged over the ranks
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for epoch in range(args.epochs):
        losses = [float(train_step(x, y)) for x, y in data]
        mean = float(hvd.allreduce(np.mean(losses)))  # the average over ranks
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {mean:.4f}")
    logits = model(x_test, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    if hvd.rank() == 0:
        print(f"final accuracy: {accuracy:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
