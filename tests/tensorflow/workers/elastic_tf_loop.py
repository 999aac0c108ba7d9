"""An elastic TensorFlow 2 custom training loop (Horovod's ``tensorflow2_mnist_elastic``
shape): a ``tf.GradientTape`` step in a ``tf.function`` with ``DistributedGradientTape``,
``TensorFlowKerasState(model, optimizer, batch=0)``, a commit every COMMIT batches and a
reset callback that scales the learning rate to the world's size.

    elastic_tf_loop.py BATCHES COMMIT [WORKER AT]

The worker named WORKER (``host:slot``) SIGKILLs itself right after batch AT. Rank 0
prints ``RESULT {json}``: the batches done, the commits, the world's size, the learning
rate and the sizes seen by the reset callback.
"""

import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as hvd  # noqa: E402

BATCHES, COMMIT = int(sys.argv[1]), int(sys.argv[2])
FAIL = (sys.argv[3], int(sys.argv[4])) if len(sys.argv) > 4 else None
B, LR = 8, 0.01

hvd.init()
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.standard_normal((B * BATCHES, 3)).astype("float32")
y = x @ rng.standard_normal((3, 1)).astype("float32")
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(1)])
opt = keras.optimizers.SGD(LR * hvd.size(), momentum=0.9)
loss_fn = keras.losses.MeanSquaredError()


@tf.function
def training_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
sizes = []


def on_reset():
    opt.learning_rate.assign(LR * hvd.size())
    sizes.append(hvd.size())


state.register_reset_callbacks([on_reset])
me = os.environ.get("DDL_ELASTIC_WORKER")


@hvd.elastic.run
def train(state):
    while state.batch < BATCHES:
        # every rank its own rows of the batch, cut for the current world
        rows = slice(state.batch * B + hvd.rank(), (state.batch + 1) * B, hvd.size())
        training_step(x[rows], y[rows])
        state.batch += 1
        if FAIL and (me, state.batch) == FAIL:
            os.kill(os.getpid(), signal.SIGKILL)
        if state.batch % COMMIT == 0:
            state.commit()


train(state)
if hvd.rank() == 0:
    print("RESULT " + json.dumps({"batch": state.batch, "commits": state.commits,
                                  "size": hvd.size(), "sizes": sizes,
                                  "lr": float(opt.learning_rate.numpy())}), flush=True)
hvd.shutdown()
