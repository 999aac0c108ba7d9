"""Horovod's ``horovod.tensorflow`` collectives over :mod:`ddl.hvd.collectives`.

A collective runs on the numpy view of its tensors: directly when executing eagerly, and as
one stateful ``tf.numpy_function`` inside a ``tf.function`` (TensorFlow chains stateful ops
in program order, so every rank that traces the same program issues the same collectives
in the same order; the op's inputs are views of TensorFlow's buffers, so results always go
to fresh arrays). Each op has Horovod's gradient, written with ``tf.custom_gradient``:
without one, ``numpy_function`` has no gradient at all. XLA cannot compile a
``numpy_function`` (``jit_compile=True`` fails), see docs/tensorflow.md.

Errors raised inside a ``tf.function`` reach the caller as TensorFlow errors whose message
is ddl's (``DDLMismatchError: ...``), on every rank.

This module holds the tensor collectives and their gradients; how one runs (eagerly, in a
graph, staged from a GPU) is :mod:`.op_runner`'s. The object collectives
(:mod:`.object_ops`) and the value ops such as ``rank_op`` (:mod:`.value_ops`) are
re-exported here, where Horovod's ``horovod.tensorflow.mpi_ops`` has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import ddl
from ddl.hvd import basics as _basics  # noqa: F401 - horovod's mpi_ops._basics
from ddl.hvd import collectives as C
from ddl.hvd import negotiate as ng
from ddl.hvd.adasum import Adasum
from ddl.hvd.compression import Compressor
from ddl.hvd.join import join as _join
from ddl.hvd.process_sets import ProcessSet, global_process_set, scope

from .compression import Compression
from .object_ops import allgather_object, broadcast_object  # noqa: F401 - Horovod's names
from .op_runner import (  # noqa: F401 - the errors are mpi_ops names too
    HorovodMismatchError,
    Key,
    horovod_error,
    horovod_errors,
    run_op,
)
from .value_ops import (  # noqa: F401 - Horovod's names
    PROCESS_SET_ERROR_INIT,
    PROCESS_SET_ERROR_UNKNOWN_SET,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)


def _tensor(x: Any) -> tf.Tensor:
    return x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x)


def _shape_rows(x: tf.Tensor) -> tf.TensorShape:
    """The static shape of a gathered result: rows unknown, the rest as the input's."""
    if x.shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None] + x.shape.as_list()[1:]) if x.shape.rank else \
        tf.TensorShape([None])


def _fill(grads: Sequence[Any], like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Upstream gradients, zeros for outputs that did not reach the loss (every rank must
    still take part in the gradient's collective)."""
    return [tf.zeros_like(y) if g is None else g for g, y in zip(grads, like)]


# ------------------------------------------------------------------- allreduce
def _allreduce(x: tf.Tensor, average: bool | None, op: Any, pre: float, post: float,
               name: str | None, process_set: Any, ignore_name_scope: bool = False
               ) -> tf.Tensor:
    """The differentiable allreduce: the gradient is the allreduce of the gradient with
    the same op and scale factors (Horovod's ``_allreduce_grad``)."""

    @tf.custom_gradient
    def fwd(t: tf.Tensor) -> Any:
        key = Key(name, "HorovodAllreduce", [t], ignore_name_scope, name or "allreduce")

        def step(a: np.ndarray) -> list[np.ndarray]:
            return [C.allreduce(a, average=average, name=key.name, op=op, prescale=pre,
                                postscale=post, process_set=process_set)]

        y, = run_op(step, [t], [t.dtype], key, process_set=process_set)
        y.set_shape(t.shape)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return _allreduce(_fill([dy], [y])[0], average, op, pre, post, None, process_set,
                              ignore_name_scope)

        return y, grad

    return fwd(x)


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: type[Compressor] = Compression.none,
              op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Average (or ``op``) of ``tensor`` over all ranks. A ``tf.IndexedSlices`` (the
    gradient of an embedding lookup) is allgathered, values and indices, as Horovod does;
    its ``op`` must be Sum or Average. ``device_*`` and ``ignore_name_scope`` are accepted
    for compatibility."""
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, average, op, name, process_set, prescale_factor,
                                 postscale_factor, ignore_name_scope)
    tensor = _tensor(tensor)
    sent, ctx = compression.compress(tensor)
    out = _allreduce(sent, average, op, float(prescale_factor), float(postscale_factor),
                     name, process_set, ignore_name_scope)
    return compression.decompress(out, ctx)


def _sparse_allreduce(s: tf.IndexedSlices, average: bool | None, op: Any, name: str | None,
                      process_set: Any, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, ignore_name_scope: bool = False
                      ) -> tf.IndexedSlices:
    """Horovod's: two allgathers, values and indices; op Sum or Average, no scale
    factors (``NotImplementedError`` otherwise, as Horovod raises, on every rank)."""
    try:
        rop = C.resolve_op(average, op)
        if rop is Adasum:
            raise NotImplementedError(
                "The Adasum reduction does not currently support sparse tensors (a "
                "tf.IndexedSlices): pass sparse_as_dense=True")
        if rop not in (ddl.Sum, ddl.Average):
            raise NotImplementedError(
                f"Only Sum and Average ops are supported with tf.IndexedSlices, not "
                f"{rop.name}; pass sparse_as_dense=True to reduce it as a dense tensor")
        if float(prescale_factor) != 1.0 or float(postscale_factor) != 1.0:
            raise NotImplementedError(
                "Pre/postscale_factor are not supported with tf.IndexedSlices")
    except Exception as exc:
        ng.fail_here(ng.ALLGATHER, exc, name or "allreduce", async_=False)
        raise
    values = allgather(s.values, name=None if name is None else name + ".values",
                       process_set=process_set, ignore_name_scope=ignore_name_scope)
    indices = allgather(s.indices, name=None if name is None else name + ".indices",
                        process_set=process_set, ignore_name_scope=ignore_name_scope)
    if rop is ddl.Average:
        values = values / tf.cast(scope(process_set).size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=s.dense_shape)


def _grouped_allreduce(xs: list[tf.Tensor], average: bool | None, op: Any, pre: float,
                       post: float, name: str | None, process_set: Any,
                       ignore_name_scope: bool = False) -> list[tf.Tensor]:
    @tf.custom_gradient
    def fwd(*ts: tf.Tensor) -> Any:
        key = Key(name, "HorovodGroupedAllreduce", ts, ignore_name_scope,
                  name or "grouped_allreduce")

        def step(*arrays: np.ndarray) -> list[np.ndarray]:
            return C.grouped_allreduce(list(arrays), average=average, name=key.name, op=op,
                                       prescale=pre, postscale=post, process_set=process_set)

        ys = run_op(step, ts, [t.dtype for t in ts], key, process_set=process_set)
        for y, t in zip(ys, ts):
            y.set_shape(t.shape)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return _grouped_allreduce(_fill(dys, ys), average, op, pre, post, None,
                                      process_set, ignore_name_scope)

        return ys, grad

    return list(fwd(*xs)) if xs else []


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: type[Compressor] = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: str | None = None) -> list[Any]:
    """``allreduce`` of every tensor as one call: one fused allreduce per dtype. Sparse
    members (``tf.IndexedSlices``) are allgathered each, after the dense ones."""
    dense_at = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out: list[Any] = list(tensors)
    sent = [compression.compress(_tensor(tensors[i])) for i in dense_at]
    reduced = _grouped_allreduce([s for s, _ in sent], average, op, float(prescale_factor),
                                 float(postscale_factor), name, process_set,
                                 ignore_name_scope)
    for i, r, (_, ctx) in zip(dense_at, reduced, sent):
        out[i] = compression.decompress(r, ctx)
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _sparse_allreduce(t, average, op, None, process_set, prescale_factor,
                                       postscale_factor, ignore_name_scope)
    return out


# ------------------------------------------------------------------- allgather
def _row_start(d0: tf.Tensor, process_set: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """This rank's first row in a gathered tensor and its row count (one allgather of
    the first dimensions, as Horovod's gradient does)."""
    dims = allgather(tf.reshape(tf.cast(d0, tf.int64), [1]), process_set=process_set)
    return tf.reduce_sum(dims[:scope(process_set).rank]), tf.cast(d0, tf.int64)


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0 (sizes may differ).
    Differentiable: the gradient is this rank's rows of the Average allreduce of the
    gradient (Horovod's ``_allgather_grad``)."""
    x = _tensor(tensor)

    @tf.custom_gradient
    def fwd(t: tf.Tensor) -> Any:
        key = Key(name, "HorovodAllgather", [t], ignore_name_scope, name or "allgather")

        def step(a: np.ndarray) -> list[np.ndarray]:
            return [C.allgather(a, name=key.name, process_set=process_set)]

        y, = run_op(step, [t], [t.dtype], key, process_set=process_set)
        y.set_shape(_shape_rows(t))

        def grad(dy: tf.Tensor) -> tf.Tensor:
            r = _allreduce(_fill([dy], [y])[0], None, ddl.Average, 1.0, 1.0, None,
                           process_set)
            scalar = t.shape.rank == 0
            start, n = _row_start(1 if scalar else tf.shape(t)[0], process_set)
            piece = r[start:start + n]
            return tf.reshape(piece, []) if scalar else piece

        return y, grad

    return fwd(x)


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """``allgather`` of each tensor, as one call. Differentiable."""
    xs = [_tensor(t) for t in tensors]
    if not xs:
        return []

    @tf.custom_gradient
    def fwd(*ts: tf.Tensor) -> Any:
        key = Key(name, "HorovodGroupedAllgather", ts, ignore_name_scope,
                  name or "grouped_allgather")

        def step(*arrays: np.ndarray) -> list[np.ndarray]:
            return C.grouped_allgather(list(arrays), name=key.name, process_set=process_set)

        ys = run_op(step, ts, [t.dtype for t in ts], key, process_set=process_set)
        for y, t in zip(ys, ts):
            y.set_shape(_shape_rows(t))

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return [_allgather_grad_piece(dy, y, t, process_set)
                    for dy, y, t in zip(dys, ys, ts)]

        return ys, grad

    return list(fwd(*xs))


def _allgather_grad_piece(dy: Any, y: tf.Tensor, t: tf.Tensor, process_set: Any) -> tf.Tensor:
    r = _allreduce(_fill([dy], [y])[0], None, ddl.Average, 1.0, 1.0, None, process_set)
    scalar = t.shape.rank == 0
    start, n = _row_start(1 if scalar else tf.shape(t)[0], process_set)
    piece = r[start:start + n]
    return tf.reshape(piece, []) if scalar else piece


# ------------------------------------------------------------------- broadcast
def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every rank. Differentiable: the gradient is the
    Average allreduce of the gradient on the root, zeros elsewhere (Horovod's)."""
    x = _tensor(tensor)

    @tf.custom_gradient
    def fwd(t: tf.Tensor) -> Any:
        key = Key(name, "HorovodBroadcast", [t], ignore_name_scope, name or "broadcast")

        def step(a: np.ndarray) -> list[np.ndarray]:
            return [C.broadcast(a, root_rank, name=key.name, process_set=process_set)]

        y, = run_op(step, [t], [t.dtype], key, process_set=process_set)
        y.set_shape(t.shape)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            r = _allreduce(_fill([dy], [y])[0], None, ddl.Average, 1.0, 1.0, None,
                           process_set)
            return r if ddl.rank() == root_rank else r * 0

        return y, grad

    return fwd(x)


def _read(v: Any) -> tf.Tensor:
    """A variable's value as a tensor: a ``tf.Variable``'s ``read_value()``; a Keras 3
    variable (no ``read_value``) through its tensor conversion."""
    read = getattr(v, "read_value", None)
    return read() if callable(read) else tf.convert_to_tensor(v)


def _broadcast_assign(vs: list[Any], root_rank: int, name: str | None, process_set: Any
                      ) -> Any:
    """Assign every variable of ``vs`` ``root_rank``'s value in one grouped call: eagerly
    now (returns None), or as graph ops (returns the assign ops)."""
    if tf.executing_eagerly():
        values = [np.array(v.numpy(), copy=True) for v in vs]
        with horovod_errors():
            C.broadcast_group_(lambda: values, root_rank, name=name,
                               what="broadcast_variables", process_set=process_set)
        for v, a in zip(vs, values):
            v.assign(a)
        return None
    key = Key(name, "HorovodGroupedBroadcast", vs, False, name or "broadcast_variables")

    def step(*arrays: np.ndarray) -> list[np.ndarray]:
        out = [np.array(a, copy=True) for a in arrays]
        C.broadcast_group_(lambda: out, root_rank, name=key.name,
                           what="broadcast_variables", process_set=process_set)
        return out

    outs = run_op(step, [_read(v) for v in vs], [tf.as_dtype(v.dtype) for v in vs], key,
                  process_set=process_set)
    for v, o in zip(vs, outs):
        o.set_shape(v.shape)
    return [v.assign(o) for v, o in zip(vs, outs)]


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Assign every variable (``tf.Variable`` or Keras 3 variable) ``root_rank``'s value,
    as one call (ranks whose variables differ in count, dtype or shape raise on every
    rank). Returns the grouped assign op inside a ``tf.function`` or a TF1 graph, None
    when eager. ``inplace`` is accepted (ddl always assigns in place)."""
    vs = list(variables)
    if not vs:
        return None if tf.executing_eagerly() else tf.no_op()
    ops = _broadcast_assign(vs, root_rank, None, process_set)
    return None if ops is None else tf.group(*ops)


def broadcast_(variables: Any, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Horovod's in-place broadcast: every variable takes ``root_rank``'s value, as one
    call. Returns the variables' new values (a list of tensors; one tensor when given one
    variable), eagerly, in a ``tf.function`` or in a TF1 graph."""
    single = not isinstance(variables, (list, tuple))
    vs = [variables] if single else list(variables)
    ops = _broadcast_assign(vs, root_rank, name, process_set) if vs else None
    if ops is None:
        values = [_read(v) for v in vs]
    else:
        with tf.control_dependencies(ops):
            values = [tf.identity(_read(v)) for v in vs]
    return values[0] if single else values


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's TF1 ``broadcast_global_variables``: an op that assigns every global
    variable (``tf.compat.v1.global_variables()``) ``root_rank``'s value. Eagerly it
    raises ``RuntimeError``, as Horovod's does: pass the model's and the optimizer's
    variables to ``broadcast_variables``."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


# ------------------------------------------------- alltoall, reducescatter
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows to rank ``j``; the rows received, and (when ``splits`` is
    given) how many came from each rank, as Horovod. Differentiable: the gradient is the
    alltoall of the gradient back with the splits received."""
    x = _tensor(tensor)
    out, received = _alltoall(x, splits, name, process_set, ignore_name_scope)
    return out if splits is None else (out, received)


def _alltoall(x: tf.Tensor, splits: Any, name: str | None, process_set: Any,
              ignore_name_scope: bool = False) -> tuple[tf.Tensor, tf.Tensor]:
    given = splits is not None
    sp = tf.cast(_tensor(splits), tf.int32) if given else tf.zeros([0], tf.int32)

    @tf.custom_gradient
    def fwd(t: tf.Tensor) -> Any:
        key = Key(name, "HorovodAlltoall", [t], ignore_name_scope, name or "alltoall")

        def step(a: np.ndarray, s: np.ndarray) -> list[np.ndarray]:
            y, r = C.alltoall(a, s if given else None, name=key.name,
                              process_set=process_set, with_splits=True)
            return [y, r.astype(np.int32)]

        y, received = run_op(step, [t, sp], [t.dtype, tf.int32], key, process_set=process_set)
        y.set_shape(_shape_rows(t))
        received.set_shape([scope(process_set).size])

        def grad(dy: tf.Tensor, _unused: Any = None) -> tf.Tensor:
            back, _ = _alltoall(_fill([dy], [y])[0], received, None, process_set,
                                ignore_name_scope)
            return back

        return (y, received), grad

    return fwd(x)


def _reducescatter(xs: list[tf.Tensor], op: Any, pre: float, post: float,
                   name: str | None, process_set: Any, grouped: bool,
                   ignore_name_scope: bool = False) -> list[tf.Tensor]:
    @tf.custom_gradient
    def fwd(*ts: tf.Tensor) -> Any:
        key = Key(name, "HorovodGroupedReducescatter" if grouped else
                  "HorovodReducescatter", ts, ignore_name_scope, name or "reducescatter")

        def step(*arrays: np.ndarray) -> list[np.ndarray]:
            out = C.reducescatter(list(arrays), op=op, name=key.name,
                                  process_set=process_set, prescale=pre, postscale=post,
                                  grouped=grouped)
            return out if grouped else [out]

        ys = run_op(step, ts, [t.dtype for t in ts], key, process_set=process_set)
        for y, t in zip(ys, ts):
            y.set_shape(_shape_rows(t))

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            # Horovod's _reducescatter_grad: the allgather of the gradient, times size()
            # for Sum, times the scale factors.
            n = scope(process_set).size
            factor = pre * post * (n if C.resolve_op(None, op) is ddl.Sum else 1)
            gathered = grouped_allgather(_fill(dys, ys), process_set=process_set)
            return [g * tf.cast(factor, g.dtype) if factor != 1.0 else g for g in gathered]

        return ys, grad

    return list(fwd(*xs))


def reducescatter(tensor: Any, device_dense: str = "",
                  compression: type[Compressor] = Compression.none, op: Any = None,
                  name: str | None = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """The Average (or ``op``) over ranks of ``tensor``, of which this rank gets its block
    of dimension 0 (as even as possible, lower ranks first). Differentiable."""
    sent, ctx = compression.compress(_tensor(tensor))
    out, = _reducescatter([sent], op, float(prescale_factor), float(postscale_factor), name,
                          process_set, False, ignore_name_scope)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none, op: Any = None,
                          name: str | None = None,
                          process_set: ProcessSet = global_process_set,
                          ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """``reducescatter`` of each tensor, as one call. Differentiable."""
    sent = [compression.compress(_tensor(t)) for t in tensors]
    if not sent:
        return []
    outs = _reducescatter([s for s, _ in sent], op, float(prescale_factor),
                          float(postscale_factor), name, process_set, True,
                          ignore_name_scope)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, sent)]


# ------------------------------------------------------------- join, barrier
def join() -> tf.Tensor:
    """Horovod's ``join``: this rank has no more data; it keeps serving the others'
    collectives until every rank has joined. Returns the rank that joined last."""
    last, = run_op(lambda: [np.asarray(_join(), dtype=np.int32)], [], [tf.int32], "join")
    last.set_shape([])
    return last


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has called it (Horovod's ``barrier``)."""
    C.barrier(process_set)
