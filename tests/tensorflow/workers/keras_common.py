"""What the Keras workers share: the data, its split by rank, a tiny model, and how weights
are compared (a digest for bit-identity across ranks, a relative difference against one
process)."""

import hashlib
import json
import os

import numpy as np

B, STEPS, DIM, CLASSES = 4, 3, 6, 3  # per-rank batch, steps per epoch, features, classes


def data(n_ranks, steps=STEPS, seed=0):
    """``steps`` global batches of ``n_ranks * B`` rows, in order."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * n_ranks * B, DIM)).astype("float32")
    y = rng.integers(0, CLASSES, steps * n_ranks * B).astype("int64")
    return x, y


def shard(a, rank, n_ranks, steps=STEPS):
    """This rank's half (1/n) of every global batch, batches kept in order, so
    ``fit(shard(x), batch_size=B, shuffle=False)`` on each rank sees what one process sees
    with ``fit(x, batch_size=n*B, shuffle=False)``."""
    tail = a.shape[1:]
    return a.reshape(steps, n_ranks, B, *tail)[:, rank].reshape(steps * B, *tail)


def make_model(keras, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((DIM,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def weights(model):
    return [np.asarray(w, dtype=np.float32) for w in model.get_weights()]


def digest(ws):
    h = hashlib.sha256()
    for w in ws:
        h.update(np.ascontiguousarray(w, dtype=np.float32).tobytes())
    return h.hexdigest()


def rel_diff(a, b):
    """max |a - b| / max |b| over all arrays."""
    num = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
    den = max(float(np.max(np.abs(y))) for y in b)
    return num / den


def report(obj):
    print(json.dumps(obj), flush=True)


def backend():
    return os.environ.get("KERAS_BACKEND", "tensorflow")
