"""Horovod's ``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()``
returns the gradients averaged (or ``op``-reduced) over every rank, in one grouped call;
and the same reduction for a Keras optimizer on the tensorflow backend
(:data:`KERAS_REDUCTION`, for :mod:`ddl.keras_optimizer`)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

import ddl
from ddl.hvd import compression as hvd_compression
from ddl.hvd.compression import Compressor
from ddl.hvd.process_sets import ProcessSet, global_process_set, scope
from ddl.keras_optimizer import Reduction, local_layer_variables

from .compression import Compression
from .mpi_ops import grouped_allreduce


def reduce_gradients(grads: list[Any], *, compression: type[Compressor] = Compression.none,
                     sparse_as_dense: bool = False, op: Any = ddl.Average,
                     gradient_predivide_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """``grads`` reduced over every rank as one grouped call (None entries stay None: a
    variable the loss does not reach on any rank). With ``gradient_predivide_factor`` f
    and op Average, gradients are scaled by 1/f before the sum and by f/size after, as in
    Horovod. Shared by DistributedGradientTape and ddl.keras's DistributedOptimizer."""
    at = [i for i, g in enumerate(grads) if g is not None]
    todo = []
    for i in at:
        g = grads[i]
        if sparse_as_dense and isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        todo.append(g)
    pre, post, rop = 1.0, 1.0, op
    if gradient_predivide_factor != 1.0:
        if op is not ddl.Average:
            raise ddl.DDLConfigError("gradient_predivide_factor needs op=Average")
        pre, post, rop = 1.0 / gradient_predivide_factor, gradient_predivide_factor, ddl.Sum
        post /= scope(process_set).size
    reduced = grouped_allreduce(todo, compression=compression, op=rop, prescale_factor=pre,
                                postscale_factor=post, process_set=process_set)
    out = list(grads)
    for i, r in zip(at, reduced):
        out[i] = r
    return out


def _member(process_set: ProcessSet | None) -> bool:
    """Whether this rank reduces over ``process_set`` (every rank is in the global set)."""
    return process_set is None or process_set is global_process_set or process_set.included()


def var_key(v: Any) -> int:
    """A variable's identity: a Keras 3 variable and the ``tf.Variable`` it holds (its
    ``.value`` on the tensorflow backend) are the same variable."""
    inner = getattr(v, "_value", None) if not isinstance(v, tf.Variable) else None
    return id(inner if isinstance(inner, tf.Variable) else v)


def reduce_with_locals(grads: list[Any], sources: list[Any], local: dict[int, Any],
                       scale_local_gradients: bool, process_set: ProcessSet,
                       **reduce_args: Any) -> list[Any]:
    """``reduce_gradients`` of the gradients whose source is not registered as local; a
    local source's gradient stays this rank's own, divided by the set's size when
    ``scale_local_gradients`` (Horovod's, so that with Average it weighs as much as the
    averaged ones; horovod pull 3695). A rank outside ``process_set`` takes no part and
    keeps its own gradients unchanged, as in Horovod."""
    if not _member(process_set):
        return list(grads)
    if not local:
        return reduce_gradients(grads, process_set=process_set, **reduce_args)
    is_local = [var_key(s) in local for s in sources]
    shared = [i for i, loc in enumerate(is_local) if not loc]
    reduced = reduce_gradients([grads[i] for i in shared], process_set=process_set,
                               **reduce_args)
    out = list(grads)
    for i, r in zip(shared, reduced):
        out[i] = r
    if scale_local_gradients:
        n = scope(process_set).size
        for i, loc in enumerate(is_local):
            g = out[i]
            if not loc or g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                out[i] = tf.IndexedSlices(g.values / tf.cast(n, g.values.dtype), g.indices,
                                          g.dense_shape)
            else:
                out[i] = g / tf.cast(n, g.dtype)
    return out



def _reduce_keras(grads: list[Any], args: dict, variables: list[Any], local: dict
                  ) -> list[Any]:
    # Horovod's Compression.fp16 for TF casts in the graph: ddl.tensorflow's own.
    compression = (Compression.fp16 if args["compression"] is hvd_compression.Compression.fp16
                   else args["compression"])
    return reduce_with_locals(grads, variables, local, args["scale_local"],
                              args["process_set"], compression=compression,
                              sparse_as_dense=args["sparse_as_dense"], op=args["op"],
                              gradient_predivide_factor=args["predivide"])


KERAS_REDUCTION = Reduction(reduce=_reduce_keras, key=var_key)
"""A Keras optimizer's gradients on the tensorflow backend, reduced with TF ops (they run
inside Keras's ``tf.function`` train step)."""

class _DistributedGradientTape(tf.GradientTape):
    """Mixed into the class of the tape it wraps (as Horovod does), so ``isinstance``
    checks and the tape's own state keep working."""

    def register_local_source(self, source: Any) -> None:
        """Horovod's: ``source``'s gradient is not reduced over the ranks; this rank's own
        is returned (divided by the number of ranks with ``scale_local_gradients``)."""
        self._ddl_local[var_key(source)] = source

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        flat_sources = tf.nest.flatten(sources) if self._ddl_local else flat
        reduced = reduce_with_locals(flat, flat_sources, self._ddl_local,
                                     self._ddl_scale_local, **self._ddl_args)
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",  # noqa: N802
                            device_sparse: str = "",
                            compression: type[Compressor] = Compression.none,
                            sparse_as_dense: bool = False, op: Any = ddl.Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap a tape (after recording, as in Horovod's examples)::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    Every gradient travels in one grouped call (fused per dtype), so ``num_groups`` and
    ``groups`` are accepted and change nothing; ``device_*`` are accepted for
    compatibility. ``tape.register_local_source(v)`` keeps ``v``'s gradient local."""
    if _member(process_set):
        scope(process_set)  # a set this rank is in must be known here
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__),
               {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._ddl_args = dict(compression=compression, sparse_as_dense=sparse_as_dense,
                          op=op, gradient_predivide_factor=gradient_predivide_factor,
                          process_set=process_set)
    tape._ddl_local = {}
    tape._ddl_scale_local = bool(scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape,  # noqa: N802
                                   device_dense: str = "", device_sparse: str = "",
                                   compression: type[Compressor] = Compression.none,
                                   sparse_as_dense: bool = False, op: Any = ddl.Average,
                                   gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """Horovod's: a :func:`DistributedGradientTape` whose ``local_layers``' trainable
    variables are registered local sources (their gradients stay on this rank)."""
    local_vars = local_layer_variables(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor,
                                   num_groups, groups, process_set, scale_local_gradients)
    for v in local_vars:
        tape.register_local_source(v)
    return tape

