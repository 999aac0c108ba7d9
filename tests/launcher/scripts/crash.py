"""A rank dies of an ordinary exception in the middle of training; ddlrun must name it, never
a peer that failed because of it (tests/launcher/test_failure_records.py).

    crash.py numpy VICTIM AT   allreduces of a small array; rank VICTIM raises before the
                               allreduce AT
    crash.py ddp VICTIM        DDP on the "ddl" torch backend (CPU); rank VICTIM raises in
                               epoch 1
    crash.py keras VICTIM      Keras fit with ddl.keras; rank VICTIM raises from a callback
                               in epoch 1

The exception is ``ValueError: boom on rank VICTIM``, raised on the line marked CRASH.
"""

import sys


def boom(rank: int) -> None:
    raise ValueError(f"boom on rank {rank}")  # CRASH


def numpy_job(victim: int, at: int) -> None:
    import numpy as np

    import ddl

    ddl.init()
    buf = np.ones(4, np.float32)
    for i in range(at + 50):
        if i == at and ddl.rank() == victim:
            boom(victim)
        ddl.allreduce(buf)


def ddp_job(victim: int) -> None:
    import torch
    import torch.distributed as dist

    import ddl.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    dist.init_process_group("ddl", init_method="env://")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(3):
        for step in range(8):
            if epoch == 1 and step == 3 and hvd.rank() == victim:
                boom(victim)
            opt.zero_grad()
            model(torch.randn(8, 32)).sum().backward()
            opt.step()


def keras_job(victim: int) -> None:
    import os

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np

    import ddl.keras as hvd

    hvd.init()

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self._epoch == 1 and batch == 2 and hvd.rank() == victim:
                boom(victim)

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((64, 6)).astype("float32")
    y = rng.integers(0, 3, 64).astype("int64")
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Crash()])


def main() -> int:
    mode, victim = sys.argv[1], int(sys.argv[2])
    if mode == "numpy":
        numpy_job(victim, int(sys.argv[3]))
    elif mode == "ddp":
        ddp_job(victim)
    elif mode == "keras":
        keras_job(victim)
    else:
        raise SystemExit(f"crash.py: unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
