"""The fold fast path: a call's descriptor rides on its data's first step (every framework).

On the shared-memory engine (a job or a process set on one host) the descriptor of
:mod:`ddl.hvd.descriptor` is *folded* into the first synchronisation of the call's own data
collective instead of taking an allreduce of its own (``ShmEngine.fold_identity``): every
rank reads every descriptor after that step and computes the same MAX; when
``descriptor.problem`` holds, or some rank exchanged its descriptor alone (a joined rank, a
call that failed there), no rank moves data in that step and each gets the MAX back
(``Unfolded``), which :func:`ddl.hvd.control.settle` then handles exactly as the result of a
separate exchange. On the multi-host engine the descriptor rides on the call's first
message across hosts the same way (engines/identity_round.py), with a small allreduce's data
in that message. Calls whose data step reads the exchange's result before its first
collective (``broadcast_object``...), jobs whose torch tensors may go to a device engine,
grids of more than one dimension across hosts, and calls made while the timeline or the
torch profiler records (so the exchange shows as its own span) keep the separate exchange.
A folded call's descriptor is made once per kind of call (``Fold``, only its sequence
number patched per call) and compared as one view per peer. A set of one rank has no peer
to agree with: its calls take the folded path with nobody to meet (``_SOLO``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import ddl
from ddl import api as _api
from ddl import timeline as _tl
from ddl.engines.base import identity_fold
from ddl.engines.shm_meta import Fold, Unfolded

from . import control
from .control import _State
from .descriptor import (
    AGREED,
    FAILED,
    FOLDABLE,
    JOINED,
    LOWEST,
    NEG_SEQ,
    PAYLOAD,
    ROOT_HERE,
    ROOTED,
    SEQ,
    Call,
    problem,
)

_FOLDABLE = frozenset(FOLDABLE)  # the per-call test


def engine_for(call: Call, st: _State) -> Any:
    """The engine to fold ``call``'s descriptor into, or None. Ranks may decide differently
    (the engine then runs the exchange as a step of its own): this only has to be safe
    here, which it is when the data step's first collective runs on the set's engine."""
    if call.kind not in _FOLDABLE:
        return None
    if _tl.recorder is not None or _tl.torch_profiler() is not None:
        return None  # traced: the exchange stays a step of its own, with its own span
    engine = st.fold_engine if st.session is _api.session() else _find_engine(st)
    if engine is None or engine is _SOLO:
        return engine
    # (a process set's calls never go to a device engine)
    unsure = st.group is None and st.fold_ok is not True
    if unsure and (st.fold_ok is False or _device_route(st)):
        return None
    return engine


class _Solo:
    """What a set of one rank folds its descriptor into: with no peer to agree with, the
    identity is settled as soon as it is made, and the data step sees the agreed result."""

    armed = None  # as if the data's first step carried it: nobody else to meet

    @staticmethod
    def fold_identity(fold: Fold) -> None:
        pass

    @staticmethod
    def cancel_fold() -> None:
        return None


_SOLO = _Solo()


def _find_engine(st: _State) -> Any:
    """The engine that can carry ``st``'s descriptors (``_SOLO`` for a set of one rank),
    or None; cached for the current session (``init()`` makes new engines)."""
    st.session = _api.session()
    engine = st.engine()
    if st.size == 1:
        st.fold_engine = _SOLO
    else:
        st.fold_engine = identity_fold(engine)
    return st.fold_engine


def _device_route(st: _State) -> bool:
    """Whether some torch tensor of this job could go to a device engine (NCCL, or Gloo
    with DDL_DEVICE_ENGINE=gloo) rather than the job's engine. Without torch loaded none
    can, for now: the answer is cached in ``st.fold_ok`` only once it cannot change."""
    s = _api.session()
    router = None if s is None else s.devices
    if router is None:
        return False
    if router.choice == "host":
        st.fold_ok = True
        return False
    if "torch" not in sys.modules:
        return False
    if router.choice == "gloo":
        route = True
    else:
        from ddl.engines import device as _device

        # a CUDA tensor can only exist, and go to NCCL, where a GPU is visible: a CUDA
        # build of torch on a machine without one (PyPI's torch) routes nothing
        route = _device.nccl_refusal() is None
    st.fold_ok = not route
    return route


def prepared(call: Call, st: _State) -> tuple[Fold, np.ndarray]:
    """The reusable :class:`Fold` of ``call`` in ``st`` (its descriptor as
    :func:`control.template`, the sequence number and payload patched per call), and the
    exchange's result as it is whenever the data may move in the folded step: every rank agrees (so
    the agreed words are ours, but for the sequence number, left out), none joined or
    failed, set rank 0 runs and a rooted call's root is here. Made once per kind of call;
    the result is read-only (the data step only reads it)."""
    found = st.folds.get(call)
    if found is None:
        d = control.template(call, False)
        r = d.copy()
        r[JOINED] = r[FAILED] = r[LOWEST] = 0
        r[ROOT_HERE] = int(call.kind in ROOTED)
        r.setflags(write=False)
        # The same agreed words on every folded (so running, not failed) rank: problem()
        # can only hold for a rooted call whose root joined, and a joined rank never folds.
        fold = Fold(d, problem, 0 if call.kind in ROOTED else AGREED)
        if len(st.folds) > 4096:
            st.folds.clear()
        found = st.folds[call] = (fold, r)
    return found


def run_folded(call: Call, word: int, payload: int, data: Callable[[np.ndarray], Any],
               engine: Any, st: _State) -> Any:
    """The call with its descriptor folded into its data's first step (module docstring).
    The fast path makes nothing: a cached fold, three words patched, one engine call."""
    if call is st.last_call:  # the same Call object again (collectives reuses them)
        fold, provisional = st.last_fold
    else:
        fold, provisional = st.last_fold = st.folds.get(call) or prepared(call, st)
        st.last_call = call
    words = fold.words
    words[SEQ] = word
    words[NEG_SEQ] = -word
    words[PAYLOAD] = payload
    engine.fold_identity(fold)
    unfolded = None
    try:
        out = data(provisional)
    except Unfolded as why:
        # Settled below, outside this handler: what settling raises (a mismatch on every
        # rank) is the user's error, not a consequence of ddl's internal Unfolded.
        unfolded = why.result
    except (ddl.DDLMismatchError, ddl.DDLConfigError):
        raise  # the engine is still in step (as control.engine_step)
    except ddl.DDLError as exc:
        st.broken = exc
        raise
    finally:
        left = engine.armed
        if left is not None:
            engine.cancel_fold()
    if unfolded is not None:
        st.count += 1
        return control.engine_step(data, control.settle(call, word, payload, None, unfolded))
    if left is None:  # the data's first step carried it, and every rank moved its data
        st.count += 1
        return out
    # No collective took it: this rank's data step moved nothing (an empty call); the
    # others meet this exchange in their first step, or run it alone as well.
    mine = control.mine(call, False, word, payload)
    control.settle(call, word, payload, None, control.exchange(mine))
    return out

