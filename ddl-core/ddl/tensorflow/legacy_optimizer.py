"""Horovod's ``DistributedOptimizer`` for a TF1 ``tf.compat.v1.train.Optimizer`` (graph
mode with sessions): ``compute_gradients`` returns the gradients reduced over the ranks,
``apply_gradients`` is the wrapped optimizer's.

With ``backward_passes_per_step`` k > 1 each rank sums its gradients over k calls in local
variables, as Horovod's ``LocalGradientAggregationHelper`` does: calls 1..k-1 reduce
nothing and apply nothing (``global_step`` still counts every call), call k reduces the
sum (divided by k with ``average_aggregated_gradients``), zeroes the sums and applies.
Every rank counts the same calls, so every rank takes the reducing branch together.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ddl.hvd.process_sets import ProcessSet

from .gradient_tape import reduce_with_locals


def is_legacy_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a TF1 ``tf.compat.v1.train.Optimizer``."""
    return isinstance(optimizer, tf.compat.v1.train.Optimizer)


class _Aggregation:
    """The local sums of k backward passes: a call counter and one sum per gradient,
    made on the first ``compute_gradients`` (their shapes are the gradients')."""

    def __init__(self, passes: int, average: bool) -> None:
        self.passes = passes
        self.average = average
        self.counter: tf.Variable | None = None
        self.sums: list[tf.Variable] = []

    def _variables(self, grads: list[tf.Tensor]) -> None:
        if self.counter is not None:
            return
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        self.counter = tf.compat.v1.Variable(0, trainable=False, name="ddl_agg_counter",
                                             collections=local, dtype=tf.int32)
        self.sums = [tf.compat.v1.Variable(tf.zeros_like(g), trainable=False,
                                           name=f"ddl_agg_sum_{i}", collections=local)
                     for i, g in enumerate(grads)]

    def step(self, grads: list[tf.Tensor], reduce: Any) -> list[tf.Tensor]:
        """Add ``grads`` to the sums; on every k-th call return ``reduce`` of the sums
        (and zero them), else zeros."""
        self._variables(grads)
        added = [s.assign_add(g) for s, g in zip(self.sums, grads)]
        with tf.control_dependencies(added):
            count = self.counter.assign(tf.math.floormod(self.counter + 1, self.passes))

        def reduced() -> list[tf.Tensor]:
            total = [s.read_value() for s in self.sums]
            if self.average:
                total = [t / tf.cast(self.passes, t.dtype) for t in total]
            out = reduce(total)
            with tf.control_dependencies(out):
                zeroed = [s.assign(tf.zeros_like(s)) for s in self.sums]
            with tf.control_dependencies(zeroed):
                return [tf.identity(o) for o in out]

        def waiting() -> list[tf.Tensor]:
            return [tf.zeros_like(s) for s in self.sums]

        return tf.cond(tf.equal(count, 0), reduced, waiting)

    def apply(self, apply: Any, global_step: Any) -> Any:
        """``apply()`` on the call that reduced; on the others only count the step."""
        def skip() -> Any:
            if global_step is None:
                return tf.no_op()
            return tf.compat.v1.assign_add(global_step, 1).op

        return tf.cond(tf.equal(self.counter, 0), apply, skip)


class LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer whose ``compute_gradients`` reduces over the ranks (Horovod's
    ``_DistributedOptimizer``); ``_optimizer`` is the wrapped one, as in Horovod."""

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: str | None,
                 use_locking: bool, reduce_args: dict, process_set: ProcessSet,
                 backward_passes_per_step: int, average_aggregated_gradients: bool) -> None:
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}",
                         use_locking=use_locking)
        self._optimizer = optimizer
        self._reduce_args = reduce_args
        self._process_set = process_set
        self._aggregation = (_Aggregation(backward_passes_per_step,
                                          average_aggregated_gradients)
                             if backward_passes_per_step > 1 else None)

    def _reduce(self, grads: list[Any], sources: list[Any]) -> list[Any]:
        return reduce_with_locals(grads, sources, {}, True, self._process_set,
                                  **self._reduce_args)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's gradients, reduced over the ranks (every k-th call with
        ``backward_passes_per_step`` k; zeros on the others)."""
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        at = [i for i, (g, _) in enumerate(pairs) if g is not None]
        grads = [pairs[i][0] for i in at]
        sources = [pairs[i][1] for i in at]
        if self._aggregation is None:
            reduced = self._reduce(grads, sources)
        else:
            # The local sums are dense: a sparse gradient is summed as its dense value.
            dense = [tf.convert_to_tensor(g) for g in grads]
            reduced = self._aggregation.step(dense, lambda t: self._reduce(t, sources))
        out = list(pairs)
        for i, r in zip(at, reduced):
            out[i] = (r, pairs[i][1])
        return out

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: str | None = None) -> Any:
        """The wrapped optimizer's ``apply_gradients`` (on the reducing calls only with
        ``backward_passes_per_step`` > 1)."""
        pairs = list(grads_and_vars)

        def apply() -> Any:
            return self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)

        if self._aggregation is None:
            return apply()
        with tf.control_dependencies([g for g, _ in pairs if g is not None]):
            return self._aggregation.apply(apply, global_step)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)
