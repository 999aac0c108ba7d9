"""Ranks out of step under TensorFlow, on 2 ranks: each case must raise on every rank, with
ddl's message, and soon (no hang until a timeout).

argv[1]: "shapes" (an allreduce inside a tf.function whose tensor has 3 elements on rank 0
and 4 on rank 1) or "steps" (model.fit where rank 1 has one batch fewer: rank 0's gradient
allreduce meets rank 1's MetricAverageCallback allreduce). Prints one JSON line.
"""

import sys
import time

import keras
import tensorflow as tf
from keras_common import B, data, make_model, report, shard

import ddl.keras as hvd
import ddl.tensorflow as hvd_tf

hvd.init()
R, N = hvd.rank(), hvd.size()


def shapes():
    @tf.function
    def reduce(t):
        return hvd_tf.allreduce(t * 2.0, name="grads")

    return reduce(tf.ones([3 + R]))


def steps():
    x, y = data(N)
    xs, ys = shard(x, R, N), shard(y, R, N)
    if R == 1:
        xs, ys = xs[:-B], ys[:-B]
    model = make_model(keras, 1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(xs, ys, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()])


start = time.monotonic()
try:
    {"shapes": shapes, "steps": steps}[sys.argv[1]]()
    out = dict(raised=False)
except Exception as exc:  # what the user's script would see
    chain, e = [], exc
    while e is not None:
        chain.append(f"{type(e).__module__}.{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    out = dict(raised=True, type=f"{type(exc).__module__}.{type(exc).__name__}",
               is_tf_error=isinstance(exc, tf.errors.OpError), chain=chain)
out.update(seconds=time.monotonic() - start, rank=R, case=sys.argv[1])
report(out)
