"""Horovod's ``join``: a rank that ran out of data keeps serving the others (every framework).

In Horovod a coordinator knows which ranks have called ``join()`` and tells them what to
contribute to each collective the others still issue. The ddl core has no coordinator, but
every Horovod-level call begins with the identity exchange of :mod:`ddl.hvd.control`,
an allreduce (MAX) of a descriptor of the call:

- a joined rank sends a sentinel (``-2**62``) in every word, so it never wins the MAX, and
  learns from the result what the others do. It then takes part in an allreduce with
  zeros of the right dtype and shape (Min, Max and Product see those zeros too, and
  Average still divides by ``size()``: Horovod's rule; it runs the engine op of
  ``descriptor.engine_op``, as the running ranks do); what it receives is dropped. A
  grouped allreduce describes its members by a hash only, so while anyone has joined the
  lowest running rank broadcasts the layout first and the joined ranks serve every member
  from it. A DistributedOptimizer's plan broadcast, barrier and shutdown are served too;
- every other collective raises on every running rank while any rank has joined, as
  Horovod's controller refuses it: allgather (and grouped_allgather), alltoall, broadcast
  (broadcast_parameters...), reducescatter (and grouped_reducescatter) and the object
  collectives. The running ranks decide it from the exchange's result together
  (``descriptor.problem``/``error``); the joined ranks keep serving and the job stays in
  step;
- when every rank sends the sentinel, all have joined: ``join()`` returns on every rank the
  rank that joined last (latest in the collective sequence, then latest in time, then the
  highest rank), agreed through one final allgather.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np

import ddl
from ddl import api as _api

from . import adasum as _adasum
from . import arrays as _arrays
from . import control
from . import descriptor as desc
from . import negotiate as ng


class _Optimizers:
    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.lock = threading.Lock()


_optimizers = _Optimizers()


def register_optimizer(optimizer: Any) -> int:
    """Index of a DistributedOptimizer, the same on every rank when every rank creates its
    optimizers in the same order; a joined rank applies the plans broadcast under it."""
    with _optimizers.lock:
        _optimizers.refs.append(weakref.ref(optimizer))
        return len(_optimizers.refs) - 1


def broadcast_plan(times: np.ndarray, index: int) -> np.ndarray:
    """Broadcast a DistributedOptimizer's readiness times from the lowest running rank
    (rank 0 unless it has joined); joined ranks adopt the same plan for optimizer ``index``.
    """
    times = np.ascontiguousarray(times, dtype=np.float64)

    def plan() -> ng.Planned:
        call = desc.Call(desc.PLAN, code=desc.code_of(times), shape=tuple(times.shape), arg=index)

        def data(r: np.ndarray) -> np.ndarray:
            _api.plan_broadcast(times, int(-r[desc.LOWEST]), inplace=True)()
            return times

        return ng.Planned(call, data)

    return ng.submit(desc.PLAN, None, plan, async_=False, label="DistributedOptimizer.plan")


# ------------------------------------------------------------------ joined ranks
def _serve(r: np.ndarray) -> None:
    """Take part in the call the running ranks described, contributing nothing. Only
    allreduce (single or grouped), the optimizer's plan broadcast, barrier and shutdown get
    here: :func:`ddl.hvd.descriptor.problem` refuses every other call beside a joined rank."""
    kind, code, op = int(r[desc.KIND]), int(r[desc.DTYPE]), int(r[desc.OP])
    if op == _adasum.ADASUM_CODE and kind in (desc.ALLREDUCE, desc.GROUPED_ALLREDUCE):
        return  # the running ranks refuse Adasum beside a joined rank before data moves
    nd = min(int(r[desc.NDIM]), desc.MAX_DIMS)
    shape = tuple(int(x) for x in r[desc.DIMS:desc.DIMS + nd])
    size, post = ddl.size(), desc.bits_scale(int(r[desc.POST]))
    if kind == desc.ALLREDUCE:
        _api.plan_allreduce(_arrays.zeros(code, shape), desc.engine_op(op, code, size, post),
                            inplace=True)()
    elif kind == desc.GROUPED_ALLREDUCE:
        rows = control.share_layout(r, None)
        for members in desc.buckets(rows):
            numel = sum(int(np.prod(desc.member_shape(rows, i), dtype=np.int64))
                        for i in members)
            code = int(rows[members[0], 0])
            _api.plan_allreduce(_arrays.zeros(code, (numel,)),
                                desc.engine_op(op, code, size, post), inplace=True)()
    elif kind == desc.PLAN:
        times = np.zeros(shape, dtype=np.float64)
        _api.plan_broadcast(times, int(-r[desc.LOWEST]), inplace=True)()
        index = int(r[desc.ARG])
        ref = _optimizers.refs[index] if index < len(_optimizers.refs) else None
        opt = ref() if ref is not None else None
        if opt is not None:
            opt._adopt_plan(times)
    # BARRIER, SHUTDOWN: the control exchange was all of it.


def _serve_until_all_joined() -> int:
    joined_at, joined_ns = control.count(), time.time_ns()
    mine = desc.joined_descriptor()
    control.global_state().joined = True  # a round of named calls meets it as a joined rank
    try:
        return _serve_and_agree(joined_at, joined_ns, mine)
    finally:
        control.global_state().joined = False


def _serve_and_agree(joined_at: int, joined_ns: int, mine: np.ndarray) -> int:
    while True:
        r = control.exchange(mine.copy())
        if desc.is_round(r):  # a round of named calls: this rank offers none
            control.meet_round(r)
            continue
        if r[desc.KIND] == desc.SENTINEL:  # nobody is running any more
            break
        if desc.problem(r):
            control.diagnose(mine, desc.JOINED_NOTE)  # the running ranks raise; this one serves on
            continue
        control.engine_step(_serve, r)
    ticket = np.asarray([[joined_at, joined_ns, control.next_word()]], dtype=np.int64)
    tickets = control.engine_step(_api.plan_allgather(ticket))
    control.resync_after_join(tickets[:, 2].tolist())
    # Last in the collective sequence, then in time, then the highest rank.
    return max(range(len(tickets)), key=lambda i: (int(tickets[i, 0]), int(tickets[i, 1]), i))


def join(device: int = -1) -> int:
    """Horovod's ``hvd.join`` (see the module docstring). ``device`` is accepted for
    compatibility: a joined rank's zeros live in host memory, where the core works."""
    seq = control.next_seq()
    try:
        return _api.dispatch(_serve_until_all_joined, "join", async_=False)
    finally:
        control.observe(seq)
