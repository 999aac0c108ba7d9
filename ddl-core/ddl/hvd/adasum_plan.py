"""The Adasum call: ``hvd.allreduce`` / ``grouped_allreduce`` with ``op=hvd.Adasum`` as one
Horovod-level call (its identity, its data step, its result), over the pairwise rule and
the tree of :mod:`ddl.hvd.adasum`, which says how it moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import ddl
from ddl import api as _api
from ddl import tensors as _tensors

from . import adasum as _adasum
from . import negotiate as ng
from .arguments import members_layout, ops_of
from .compression import Compressor
from .negotiate import Call, Planned, code_of


class _AdasumCall(Call):
    """An Adasum call's identity: an allreduce whose op word is ``ADASUM_CODE``, which
    ``ddl.ReduceOp`` (and so ``Call.describe``) does not know."""

    __slots__ = ()

    def describe(self) -> str:
        return Call(*self._replace(op=int(ddl.Sum))).describe().replace("op=Sum", "op=Adasum")


def adasum_plan(ts: list[Any], single: bool, average: bool | None, name: str | None,
                prescale: float, postscale: float, compression: type[Compressor],
                inplace: bool, st: ng._State) -> Planned:
    """Adasum (:mod:`ddl.hvd.adasum`) of one tensor or a group: prescaled and compressed as
    a Sum would be, one allgather of each dtype's members, the tree evaluated here, then
    postscaled. Coefficients are per member."""
    if average is not None:
        raise ddl.DDLConfigError("pass op=hvd.Adasum or average (deprecated), not both")
    _adasum.check_size(st.size)
    pre, post = float(prescale), float(postscale)
    fw = ops_of(ts)
    sent = [compression.compress(t) for t in ts]
    if pre != 1.0:
        sent = [(fw.scaled(s, pre), ctx) for s, ctx in sent]
    flats = [_tensors.flatten(s, name=name or "tensor") for s, _ in sent]
    by_code: dict[int, list[int]] = {}
    for i, f in enumerate(flats):
        _adasum.check_dtype(f.dtype.code)
        by_code.setdefault(f.dtype.code, []).append(i)
    code = _adasum.ADASUM_CODE
    if single:
        s = sent[0][0]
        call = _AdasumCall(ng.ALLREDUCE, code, code_of(s), tuple(s.shape), pre=pre,
                           post=post, name=name)
    else:
        ss = [s for s, _ in sent]
        call = _AdasumCall(ng.GROUPED_ALLREDUCE, code, pre=pre, post=post, name=name,
                           count=len(ss), numel=sum(fw.numel(s) for s in ss),
                           ndim=max((fw.ndim(s) for s in ss), default=0),
                           layout=members_layout(fw, ss, False))

    def data(r: np.ndarray) -> list[np.ndarray]:
        if r[ng.JOINED] == 1:
            raise ddl.DDLConfigError(
                "hvd.allreduce(op=hvd.Adasum) while a rank has called hvd.join(): joined "
                "ranks do not serve Adasum calls; use op=hvd.Average with join, or give "
                "every rank the same number of batches")
        outs: list[np.ndarray] = [f.array for f in flats]  # empty members stay as they are
        for members in by_code.values():
            numels = [flats[i].array.size for i in members]
            if not sum(numels):
                continue
            row = np.concatenate([flats[i].array for i in members]).reshape(1, -1)
            rows = _api.plan_allgather(row, st.group)()
            dt = flats[members[0]].dtype
            got, coefs = _adasum.tree(rows, numels, dt)
            if st.size > 1:
                # the lowest rank's coefficients for all: a rank whose dot products rounded
                # otherwise (another CPU kind) redoes the exact scaled adds with them
                agreed = coefs.copy()
                _api.plan_broadcast(agreed, 0, inplace=True, group=st.group)()
                if not np.array_equal(agreed, coefs, equal_nan=True):
                    got, _ = _adasum.tree(rows, numels, dt, coefs=agreed)
            off = 0
            for i, n in zip(members, numels):
                outs[i] = got[off:off + n]
                off += n
        return outs

    def finish(outs: list[np.ndarray]) -> Any:
        done = []
        with fw.no_grad():
            for i, (flat, got) in enumerate(zip(flats, outs)):
                out, view = _tensors.empty_like(flat)
                view.array[...] = got
                view.write_back()
                if post != 1.0:
                    fw.scale_(out, post)
                out = compression.decompress(out, sent[i][1])
                if inplace:
                    fw.copy_(ts[i], out)
                    out = ts[i]
                done.append(out)
        return done[0] if single else done

    return Planned(call, data, finish)


__all__ = ["adasum_plan"]
