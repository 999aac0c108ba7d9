"""What every Horovod collective's plan checks and shares: the process set, the op (with
Horovod's deprecated ``average=``), the root rank, how an Average is reduced and scaled, and
the few helpers the plans of :mod:`ddl.hvd.collectives`, :mod:`ddl.hvd.movement`,
:mod:`ddl.hvd.objects` and :mod:`ddl.hvd.adasum_plan` build their calls with.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import ddl
from ddl.ops import parse_op

from . import adasum as _adasum
from . import negotiate as ng
from .arrays import NumpyOps, ops_for
from .negotiate import code_of
from .process_sets import scope


def check_process_set(process_set: Any) -> ng._State:
    """The process set's protocol state (see :mod:`ddl.hvd.process_sets`)."""
    return scope(process_set)


def resolve_op(average: bool | None, op: Any) -> ddl.ReduceOp:
    """Horovod's ``op=`` / deprecated ``average=`` pair; Average when neither is given."""
    if average is not None:
        if op is not None:
            raise ddl.DDLConfigError("pass op or average (deprecated), not both")
        return ddl.Average if average else ddl.Sum
    if op is None:
        return ddl.Average
    if _adasum.is_adasum(op):
        raise ddl.DDLConfigError(
            "op=hvd.Adasum is for allreduce, grouped_allreduce and DistributedOptimizer "
            "only (as in Horovod); use op=hvd.Average or hvd.Sum here")
    return parse_op(op)


def check_root(root_rank: Any, st: ng._State | None = None) -> tuple[int, int]:
    """``root_rank`` (a job rank, as in Horovod) and its rank in the process set."""
    root = operator.index(root_rank)
    if not 0 <= root < ddl.size():
        raise ddl.DDLConfigError(f"root_rank {root} is outside 0..{ddl.size() - 1}")
    if st is None or st.group is None:
        return root, root
    if root not in st.group.ranks:
        raise ddl.DDLConfigError(
            f"root_rank {root} is not in process set {st.set_id} (ranks "
            f"{list(st.group.ranks)})")
    return root, st.group.ranks.index(root)


def without_row(step: Callable[[], Any]) -> Callable[[np.ndarray], Any]:
    """A plan's data step that does not need the exchange's result row."""
    return lambda r: step()


def reduction(rop: ddl.ReduceOp, t: Any, post: float, size: int) -> tuple[ddl.ReduceOp, float]:
    """The op the engine runs and the factor the result is scaled by after it, once.
    Horovod averages by summing and multiplying by ``postscale / size`` (a double, used as a
    float32 for 16- and 32-bit floats, see ``NumpyOps.scaled``): so does every Average
    here, but where the engine's own Average is that result bit for bit
    (:func:`ddl.hvd.negotiate.engine_op`). An integer average truncates toward zero, as in
    Horovod."""
    engine_op = ng.engine_op(rop, code_of(t), size, post)
    if engine_op is not rop:
        return engine_op, post / size
    return rop, post


def members_layout(fw: Any, ts: Sequence[Any], gathering: bool) -> bytes:
    """A grouped call's members, ``(dtype code, device, shape)`` each, as its descriptor
    carries them (:func:`ddl.hvd.descriptor.layout`)."""
    return ng.layout([(code_of(t), fw.device(t), tuple(t.shape)) for t in ts],
                     gathering=gathering)


def ops_of(ts: Sequence[Any]) -> Any:
    """The array operations of a group's tensors (numpy's for an empty group)."""
    return ops_for(ts[0]) if len(ts) else NumpyOps


__all__ = ["check_process_set", "check_root", "members_layout", "ops_of", "reduction",
           "resolve_op", "without_row"]
