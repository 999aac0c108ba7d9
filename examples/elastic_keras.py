"""Elastic Keras 3 ``model.fit`` with ddl, ported from Horovod Elastic by changing the
import: the job loses a worker, re-forms its world in place and goes on from the last
commit::

    ddlrun -np 3 --min-np 2 --max-np 3 python examples/elastic_keras.py --epochs 3

A small regression network learns a fixed random linear map from synthetic data (CPU,
seconds). ``hvd.elastic.KerasState`` holds the model, its optimizer and the epoch and
batch counters; Horovod's three callbacks, in Horovod's order, keep the counters and
commit every ``--batches-per-commit`` batches and at every epoch's end. When a worker is
lost, the survivors restore the last commit, the reset callback scales the learning rate
to the new number of ranks, and ``fit`` runs again for the epochs left (the first one only
for its batches left). Each rank trains on its own shard of the data, cut again for every
world. Rank 0 ends with ``FINAL epochs=E size=N loss=L``.

To try a lost worker: ``--fail-worker localhost:1 --fail-at-batch 4`` makes the worker of
that name (``host:slot``, ddlrun's ``DDL_ELASTIC_WORKER``) SIGKILL itself right after
batch 4 of epoch 0.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import keras
import numpy as np

import ddl.keras as hvd

INPUTS, OUTPUTS = 8, 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batches-per-commit", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--steps", type=int, default=6, help="batches an epoch, on every rank")
    p.add_argument("--lr", type=float, default=0.01, help="for one rank; scaled by size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-worker", metavar="HOST:SLOT",
                   help="the worker that SIGKILLs itself (with --fail-at-batch)")
    p.add_argument("--fail-at-batch", type=int, metavar="N",
                   help="it does so right after batch N (counted from 1) of epoch 0")
    return p


def make_data(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``y = x @ W + noise`` with a fixed ``W``: the same data on every rank."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, INPUTS)).astype("float32")
    w = rng.standard_normal((INPUTS, OUTPUTS)).astype("float32")
    y = x @ w + 0.1 * rng.standard_normal((samples, OUTPUTS)).astype("float32")
    return x, y


class FailAt(keras.callbacks.Callback):
    """SIGKILL this process right after batch ``at`` of epoch 0 (a lost worker, for
    trying the elastic job out). Place it after ``UpdateBatchStateCallback``, whose
    ``state.batch`` it reads."""

    def __init__(self, state: Any, at: int) -> None:
        super().__init__()
        self.state, self.at = state, at

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.state.epoch == 0 and self.state.batch == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state: Any, x: np.ndarray, y: np.ndarray, epochs: int, batch_size: int,
          steps: int, callbacks: list[keras.callbacks.Callback]) -> keras.callbacks.History:
    # this world's shard, the same length on every rank: every rank runs the same number
    # of steps, each an allreduce that all of them must join
    keep = steps * batch_size
    shard = slice(hvd.rank(), hvd.size() * keep, hvd.size())
    return state.model.fit(x[shard], y[shard], batch_size=batch_size, shuffle=False,
                           epochs=epochs - state.epoch, callbacks=callbacks, verbose=0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hvd.init()
    keras.utils.set_random_seed(args.seed)
    # enough data for the largest world this job may have (ddlrun's --max-np; here 4)
    x, y = make_data(4 * args.steps * args.batch_size, args.seed)
    model = keras.Sequential([keras.Input((INPUTS,)), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(OUTPUTS)])
    model.compile(optimizer=hvd.DistributedOptimizer(
        keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)), loss="mse")
    # the state builds the optimizer; its sync sends rank 0's model and optimizer to every
    # rank before training and after each reset, so no BroadcastGlobalVariablesCallback
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    def scale_lr() -> None:
        # the gradients are averaged over the ranks: keep lr proportional to their number
        model.optimizer.learning_rate.assign(args.lr * hvd.size())

    state.register_reset_callbacks([scale_lr])
    callbacks: list[keras.callbacks.Callback] = [
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
    ]
    if args.fail_worker and args.fail_worker == os.environ.get("DDL_ELASTIC_WORKER"):
        callbacks.append(FailAt(state, args.fail_at_batch))
    history = train(state, x, y, args.epochs, args.batch_size, args.steps, callbacks)
    if hvd.rank() == 0:
        print(f"FINAL epochs={state.epoch} size={hvd.size()} "
              f"loss={history.history['loss'][-1]:.6f}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
