"""ddl.tensorflow's allreduce(op=hvd.Adasum) on a power-of-two number of ranks, eager and
inside tf.function, against a numpy reference written here (the pairwise rule over the
halves of the rank list, lower half on the left, dot products in float64); its gradient is
the Adasum of the upstream gradients. One JSON line per rank."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as hvd  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()


def ref_adasum(vectors, dtype):
    if len(vectors) == 1:
        return vectors[0]
    half = len(vectors) // 2
    a = ref_adasum(vectors[:half], dtype).astype(np.float64)
    b = ref_adasum(vectors[half:], dtype).astype(np.float64)
    dot, na, nb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2.0 * na) if na >= 1e-8 else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb >= 1e-8 else 1.0
    return (ca * a + cb * b).astype(dtype)


def data(r, n, dtype):
    return np.random.default_rng(10 + r).standard_normal(n).astype(dtype)


checks = {}
for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
    want = ref_adasum([data(r, 11, dtype) for r in range(N)], dtype)
    eager = hvd.allreduce(tf.constant(data(R, 11, dtype)), op=hvd.Adasum).numpy()
    graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Adasum))(
        tf.constant(data(R, 11, dtype))).numpy()
    checks[f"eager_{np.dtype(dtype).name}"] = bool(np.allclose(eager, want, rtol=tol, atol=tol))
    checks[f"graph_{np.dtype(dtype).name}"] = bool(np.array_equal(graph, eager))
x = tf.Variable(data(R, 5, np.float32))
with tf.GradientTape() as tape:
    y = hvd.allreduce(x, op=hvd.Adasum)
    loss = tf.reduce_sum(y)
# every rank's upstream gradient is ones: equal vectors, whose Adasum is ones
checks["gradient"] = bool(np.array_equal(tape.gradient(loss, x).numpy(), np.ones(5)))
try:
    hvd.allreduce(tf.constant([1, 2], dtype=tf.int32), op=hvd.Adasum)
    checks["integer_error"] = False
except hvd.DDLConfigError as exc:
    checks["integer_error"] = "not int32" in str(exc)
print(json.dumps({"rank": R, "checks": checks}))
hvd.shutdown()
sys.exit(0)
