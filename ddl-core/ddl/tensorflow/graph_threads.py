"""Enough inter-op threads for a TF1 graph's collectives.

In a ``tf.compat.v1`` session, each ddl collective is a ``tf.numpy_function`` that holds one
of TensorFlow's inter-op threads while it waits for its namesake on the other ranks
(Horovod's are asynchronous kernels, which hold none). Collectives with no order between
them run in another order on each rank, so with fewer threads than collectives waiting at
once, each rank's threads wait on calls the other ranks cannot reach yet, and the job
hangs: Horovod's own ``test_horovod_allgather_fused_cpu`` runs 30 independent allgathers
in one ``session.run``, and TensorFlow's default pool has one thread per core.

:func:`reserve` (called when ``ddl.tensorflow`` is imported: a session sizes the pool
when it is made, which may be before ``hvd.init()``) raises TensorFlow's process-wide
inter-op pool to :data:`GRAPH_INTEROP_THREADS` (or the core count, if larger) when
TensorFlow has not started yet, unless the user sized it (``TF_NUM_INTEROP_THREADS`` or
``tf.config.threading.set_inter_op_parallelism_threads``). The threads are idle unless
ops wait; eager code and ``tf.function`` (whose collectives run in program order) do not
need them.
"""

from __future__ import annotations

import os

import tensorflow as tf

GRAPH_INTEROP_THREADS = 64
"""The floor ``ddl.tensorflow`` gives TensorFlow's inter-op pool: more collectives than this
waiting at once in one TF1 ``session.run`` need a session of their own
(``ConfigProto(inter_op_parallelism_threads=..., use_per_session_threads=True)``)."""


def reserve() -> bool:
    """Size TensorFlow's inter-op pool for TF1 graphs' collectives; True when it was set,
    False when the user chose a size or TensorFlow had already started."""
    if os.environ.get("TF_NUM_INTEROP_THREADS"):
        return False
    if tf.config.threading.get_inter_op_parallelism_threads() != 0:
        return False
    try:
        tf.config.threading.set_inter_op_parallelism_threads(
            max(GRAPH_INTEROP_THREADS, os.cpu_count() or 1))
    except RuntimeError:
        # TensorFlow has started (an op ran): its pool keeps the size it was made with.
        return False
    return True
