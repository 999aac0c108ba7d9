"""Keras variables and values through the ddl core as numpy: the same for every Keras
backend (``Variable.numpy()`` and ``assign`` exist on all of them). Eager only, which is
where Keras runs callbacks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from ddl.hvd import collectives as C


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0) -> None:
    """Assign every variable ``root_rank``'s value, as one call (ranks whose variables
    differ in count, dtype or shape raise on every rank)."""
    vs = list(variables)
    values = [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in vs]
    C.broadcast_group_(lambda: values, root_rank, what="broadcast_variables")
    for v, a in zip(vs, values):
        v.assign(a)


def model_variables(model: Any) -> list[Any]:
    """A model's variables and, once it is built, its optimizer's, less the optimizer's
    gradient accumulators (``backward_passes_per_step``): they hold this rank's own
    gradients until the next update step, and a broadcast after the first batch would
    replace them with the root's."""
    out = list(model.variables)
    opt = getattr(model, "optimizer", None)
    if opt is not None and getattr(opt, "built", False):
        local = {id(v) for v in getattr(opt, "_accumulated_gradients", None) or ()}
        out += [v for v in opt.variables if id(v) not in local]
    return out


def numpy_of(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))

