"""The Horovod collectives that carry no tensors: Python objects (``broadcast_object``,
``allgather_object``, pickled by the adapter's pickler), and nothing at all (``barrier``,
and the collective step of ``hvd.shutdown()``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import ddl
from ddl import api as _api

from . import negotiate as ng
from .arguments import check_root
from .arrays import NumpyOps
from .named import submit
from .negotiate import Call, Planned
from .process_sets import scope


def barrier(process_set: Any = None) -> None:
    """Return once every rank of the process set has called it (Horovod's ``barrier``)."""
    st = scope(process_set)

    def plan() -> Planned:
        return Planned(Call(ng.BARRIER), lambda r: None)

    submit(ng.BARRIER, None, plan, async_=False, label="barrier", scope=st)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None, *, pickler: Any = NumpyOps) -> Any:
    """``root_rank``'s ``obj`` on every rank (pickled by ``pickler.dumps``/``loads``): one
    call, whose exchange also carries the root's payload length."""

    st = scope(process_set)

    def plan() -> Planned:
        root, local = check_root(root_rank, st)
        payload = pickler.dumps(obj) if ddl.rank() == root else None

        def data(r: np.ndarray) -> np.ndarray:
            buf = (payload if payload is not None
                   else np.empty(int(r[ng.PAYLOAD]), dtype=np.uint8))
            _api.plan_broadcast(buf, local, inplace=True, group=st.group)()
            return buf

        def finish(buf: np.ndarray) -> Any:
            return obj if payload is not None else pickler.loads(buf)

        return Planned(Call(ng.BROADCAST_OBJECT, arg=root, name=name), data, finish,
                       payload=0 if payload is None else payload.size)

    return submit(ng.BROADCAST_OBJECT, name, plan, async_=False,
                  label=name or "broadcast_object", scope=st)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None, *,
                     pickler: Any = NumpyOps) -> list[Any]:
    """Every rank's ``obj``, in rank order."""

    st = scope(process_set)

    def plan() -> Planned:
        payload = pickler.dumps(obj)

        def data(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            sizes = np.asarray([payload.size], dtype=np.int64)
            lengths = _api.plan_allgather(sizes, st.group)()
            return lengths, _api.plan_allgather(payload, st.group)()

        def finish(got: tuple[np.ndarray, np.ndarray]) -> list[Any]:
            out, off = [], 0
            for n in got[0].tolist():
                out.append(pickler.loads(got[1][off:off + n]))
                off += n
            return out

        return Planned(Call(ng.ALLGATHER_OBJECT, name=name), data, finish)

    return submit(ng.ALLGATHER_OBJECT, name, plan, async_=False,
                  label=name or "allgather_object", scope=st)


def shutdown_exchange() -> None:
    """``hvd.shutdown()``'s collective step: every rank has finished the calls before it,
    and a rank still inside another collective hears that this one shuts down."""
    submit(ng.SHUTDOWN, None, lambda: Planned(Call(ng.SHUTDOWN), lambda r: None),
           async_=False, label="shutdown")


__all__ = ["allgather_object", "barrier", "broadcast_object", "shutdown_exchange"]
