"""How ``ddl.tensorflow`` runs a collective on TensorFlow tensors: a function of numpy arrays
run now (eagerly; GPU tensors staged to the host and back, named in the timeline) or as
one stateful ``tf.numpy_function`` of the graph being built (in a ``tf.function`` or a TF1
graph, where the op also gets Horovod's name for the collective). ddl's mismatch errors
reach the caller as Horovod's TensorFlow errors. The collectives themselves are in
:mod:`ddl.tensorflow.mpi_ops`.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import ddl
from ddl import timeline as _tl
from ddl.hvd.process_sets import scope

_log = logging.getLogger("ddl.tensorflow")


class Key:
    """The name a collective carries in the core. In a TF1 graph (a ``tf.compat.v1``
    session, not a ``tf.function``) every collective is named as Horovod names it: its
    graph op is called ``name`` or ``<Prefix>_<input tensor name>`` (``:`` and ``/`` made
    ``_``), within the current name scope and made unique by the graph, and the core gets
    that op's full name (less the scope with ``ignore_name_scope``), so ranks can match a
    session's independent collectives by name whatever order they run in. Eagerly and in a
    ``tf.function`` (whose stateful ops run in program order) the name is the one given."""

    __slots__ = ("name", "label", "_base", "_strip")

    def __init__(self, name: str | None, prefix: str, tensors: Sequence[Any],
                 ignore_name_scope: bool = False, label: str | None = None) -> None:
        self.name = name
        self.label = label or name or prefix
        self._base: str | None = None
        self._strip = ignore_name_scope
        if _graph_mode():
            if name is not None:
                self._base = _normalize_name(name)
            elif len(tensors) == 1:
                self._base = f"{prefix}_{_normalize_name(tensors[0].name)}"
            elif tensors:
                self._base = _normalize_name(
                    f"{prefix}_{tensors[0].name}_{tensors[-1].name}")
            else:
                self._base = prefix

    def op_name(self) -> str:
        return self._base if self._base is not None else _op_name(self.label)

    def bind(self, op: tf.Operation) -> None:
        """The graph op is made: its name is the collective's (TF1 graph mode only)."""
        if self._base is not None:
            self.name = op.name.rsplit("/", 1)[-1] if self._strip else op.name


def _graph_mode() -> bool:
    """Building a TF1 graph (``tf.compat.v1`` sessions): not eager, not a tf.function."""
    return not tf.executing_eagerly() and not tf.inside_function()


def _normalize_name(name: str) -> str:
    """Horovod's ``_normalize_name``: every character but ``[a-zA-Z0-9_]`` made ``_``."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def run_op(fn: Callable[..., Any], inputs: Sequence[Any], touts: Sequence[tf.DType],
           key: Key | str, process_set: Any = None) -> list[tf.Tensor]:
    """``fn`` (numpy arrays in, a list of numpy arrays out) on ``inputs``: now, or as one
    stateful op of the graph being built. In eager calls ddl's mismatch and unsupported
    errors are raised as Horovod's TensorFlow errors (see :func:`horovod_error`). A graph
    op on a ``process_set`` that is not registered, or that this rank is not in, is
    refused when it is built (Horovod's ``ValueError`` for an unknown set)."""
    if isinstance(key, str):
        key = Key(key, key, ())
    if process_set is not None and not tf.executing_eagerly():
        with horovod_errors():
            scope(process_set)
    if tf.executing_eagerly():
        device = _accelerator(inputs)
        with horovod_errors():
            if device is None:
                outs = fn(*[np.asarray(t) for t in inputs])
                return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, touts)]
            return _staged(fn, inputs, touts, key.label, device)

    # a TF1 graph (session): a mismatch is Horovod's FailedPreconditionError, as its tests
    # check; in a tf.function, ddl's own message (which rank called what) is kept instead
    in_session = _graph_mode()

    def call(*arrays: np.ndarray) -> list[np.ndarray]:
        try:
            outs = [np.asarray(o) for o in fn(*arrays)]
            return outs + [np.int32(0)] if in_session else outs
        except ddl.DDLMismatchError as exc:
            if not in_session:
                raise type(exc)(f"{type(exc).__name__}: {exc}") from exc
            # a Python error leaves a graph op as InvalidArgument or Unknown only: the op
            # reports the mismatch in its last output and the graph raises it as Horovod's
            # FailedPreconditionError (_mismatch_raised); the message goes to this rank's log
            _log.error("%s in %s: %s", type(exc).__name__, key.name or key.label, exc)
            return [np.zeros(0, d.as_numpy_dtype) for d in touts] + [np.int32(1)]
        except ddl.DDLError as exc:
            # TensorFlow keeps only the message of a ValueError (a mismatch or a refused call
            # arrives as InvalidArgumentError): it names ddl's error, so a script can tell
            raise type(exc)(f"{type(exc).__name__}: {exc}") from exc

    if not in_session:
        outs = tf.numpy_function(call, list(inputs), list(touts), stateful=True,
                                 name=key.op_name())
        return list(outs) if isinstance(outs, (list, tuple)) else [outs]
    *outs, mismatched = tf.numpy_function(call, list(inputs), [*touts, tf.int32],
                                          stateful=True, name=key.op_name())
    key.bind(mismatched.op)
    return _mismatch_raised(outs, mismatched, mismatched.op.name)


def _mismatch_raised(outs: list[tf.Tensor], mismatched: tf.Tensor,
                     op_name: str) -> list[tf.Tensor]:
    """``outs``, once the graph has checked ``mismatched``: when the ranks' calls differed it
    raises ``tf.errors.FailedPreconditionError``, as Horovod's kernels do. No Python error
    can carry that code out of a graph op, so the failing branch reads a resource variable
    that does not exist, the one native op that fails with it; its message names the
    collective and ddl's error (whose own message is in this rank's log)."""
    def fail() -> tf.Tensor:
        handle = tf.raw_ops.VarHandleOp(
            dtype=tf.int32, shape=[], shared_name=(
                f"DDLMismatchError in collective {op_name} (the ranks' calls differ: "
                f"shapes, dtypes, ops or roots; ddl's message is in this rank's log)"))
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32)

    checked = tf.cond(tf.equal(mismatched, 0), lambda: tf.constant(0), fail)
    with tf.control_dependencies([checked]):
        return [tf.identity(o) for o in outs]


class HorovodMismatchError(tf.errors.FailedPreconditionError, ddl.DDLMismatchError):
    """Ranks called a collective with different shapes, dtypes, ops or roots: raised
    eagerly where Horovod raises ``tf.errors.FailedPreconditionError``; it is a
    ``ddl.DDLMismatchError`` (a ``ddl.DDLError``) too. In a TF1 session the graph raises a
    plain ``tf.errors.FailedPreconditionError`` naming the collective and
    ``DDLMismatchError`` (ddl's message goes to the rank's log); inside a ``tf.function``
    TensorFlow turns ddl's error into ``tf.errors.InvalidArgumentError``, whose message
    carries ddl's."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class HorovodInvalidArgumentError(tf.errors.InvalidArgumentError, ddl.DDLConfigError):
    """A call this rank cannot make (an alltoall whose rows do not split over the ranks, a
    process set this rank is not in or that is not registered): raised eagerly where
    Horovod raises ``tf.errors.InvalidArgumentError``; it is a ``ddl.DDLConfigError`` (a
    ``ValueError``, as Horovod's refusal of an unknown process set) too."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def horovod_error(exc: BaseException) -> BaseException:
    """``exc`` as Horovod's TensorFlow binding raises it: a ``ddl.DDLMismatchError`` as a
    :class:`HorovodMismatchError`, a ``ddl.DDLConfigError`` as a
    :class:`HorovodInvalidArgumentError` (their attributes kept); anything else
    unchanged."""
    for ddl_type, horovod_type in ((ddl.DDLMismatchError, HorovodMismatchError),
                                   (ddl.DDLConfigError, HorovodInvalidArgumentError)):
        if isinstance(exc, ddl_type) and not isinstance(exc, horovod_type):
            new = horovod_type(str(exc))
            new.__dict__.update({k: v for k, v in vars(exc).items() if k not in vars(new)})
            return new
    return exc


@contextlib.contextmanager
def horovod_errors() -> Iterator[None]:
    """Raise ddl's mismatch and refused-call errors as Horovod's (see
    :func:`horovod_error`)."""
    try:
        yield
    except (ddl.DDLMismatchError, ddl.DDLConfigError) as exc:
        new = horovod_error(exc)
        if new is exc:
            raise
        raise new from exc


def _accelerator(inputs: Sequence[Any]) -> str | None:
    """The device of the first input that lives off the host (a GPU), or None."""
    for t in inputs:
        device = getattr(t, "device", "") or ""
        if ":GPU:" in device.upper():
            return device
    return None


def _staged(fn: Callable[..., Any], inputs: Sequence[Any], touts: Sequence[tf.DType],
            name: str, device: str) -> list[tf.Tensor]:
    """An eager call on GPU tensors: ddl's host engines need host memory, so the inputs are
    copied to the host and the results back to ``device``, each copy a named range of the
    timeline (``stage to host``/``stage to device``, with its bytes). Inside a
    ``tf.function`` TensorFlow makes these copies around the ``numpy_function`` itself."""
    with _tl.span("stage to host", "tensorflow",
                  {"call": name, "device": device,
                   "bytes": sum(int(np.prod(t.shape)) * t.dtype.size for t in inputs)}):
        arrays = [np.asarray(t) for t in inputs]
    outs = fn(*arrays)
    with _tl.span("stage to device", "tensorflow",
                  {"call": name, "device": device,
                   "bytes": sum(int(np.asarray(o).nbytes) for o in outs)}), tf.device(device):
        return [tf.identity(tf.convert_to_tensor(o, dtype=d)) for o, d in zip(outs, touts)]


def _op_name(name: str) -> str:
    return "DDL_" + "".join(c if c.isalnum() or c == "_" else "_" for c in name)


__all__ = ["HorovodMismatchError", "Key", "horovod_error", "horovod_errors", "run_op"]
