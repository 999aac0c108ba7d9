"""``hvd.init()`` and ``hvd.shutdown()`` as Horovod's tests use them (init, shutdown, init
again between cases), and what this build has in Horovod's vocabulary; the same for every
framework adapter."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import ddl

from . import control
from . import process_sets as _sets
from .collectives import shutdown_exchange


def init(comm: Any = None, process_sets: Any = None, *, who: str = "ddl") -> None:
    """Join the job (``ddl.init()``). ``process_sets``: ProcessSets (or rank lists) to
    register now, as Horovod's (every rank passes the same list), or ``"dynamic"``.
    Horovod's ``comm`` (an MPI communicator) is not accepted.

    Calling it again is a no-op, as in Horovod, unless this generation is unusable (a peer
    shut down, died or timed out): then it starts a new one, which is how a rank whose peer
    called ``shutdown()`` and ``init()`` catches up.
    """
    if comm is not None:
        raise NotImplementedError(f"{who}.init: comm= is not supported; ddl.init() reads "
                                  "the launch environment (ddlrun, torchrun, mpirun, srun)")
    if ddl.is_initialized():
        if control.broken() is None:
            _sets.init_sets(process_sets)
            return
        ddl.shutdown()  # no collective step: the peers are gone or have moved on
    control.reset()
    _sets.reset()
    ddl.init()
    _sets.init_sets(process_sets)


def shutdown() -> None:
    """Leave the job, collectively: every rank finishes the calls before this one, then
    takes part in one control exchange, so a rank still inside another collective raises a
    ``DDLMismatchError`` naming this shutdown (and re-initialises on its next ``init()``).
    ``init()`` may follow, any number of times. Safe to call more than once."""
    if not ddl.is_initialized():
        return
    try:
        if control.broken() is None:
            shutdown_exchange()
    except ddl.DDLError:
        pass  # a peer is gone or elsewhere: it has been told, or will see this rank closed
    finally:
        try:
            ddl.shutdown()
        finally:
            control.reset()
            _sets.reset()


def _transport() -> str:
    name = ddl.engine_name() if ddl.is_initialized() else ""
    return name.partition("/")[2]  # "ddl/mpi" -> "mpi"; single host: ""


def mpi_enabled() -> bool:
    """True when this job's cross-host dimensions run on MPI."""
    return _transport() == "mpi"


def mpi_built() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    """True when this job's cross-host dimensions run on Gloo."""
    return _transport() == "gloo"


def gloo_built() -> bool:
    """ddl's Gloo engine is torch.distributed's Gloo: built when torch is installed with it
    (torch is not imported here for the question when the program has not imported it)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.distributed.is_available() and torch.distributed.is_gloo_available())
    return importlib.util.find_spec("torch") is not None


def _cuda_torch() -> Any:
    """The imported torch when it is a CUDA build (ddl's device engine runs NCCL through
    it), else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and getattr(torch.version, "cuda", None) else None


def nccl_built() -> int:
    """NCCL's version code (Horovod's ``NCCL_VERSION_CODE``: 22703 for 2.27.3) when CUDA
    tensors go to NCCL through torch, else 0."""
    torch = _cuda_torch()
    if torch is None or not torch.distributed.is_nccl_available():
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * 10000 + minor * 100 + patch


def ddl_built() -> bool:
    return True


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return _cuda_torch() is not None


def rocm_built() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def is_homogeneous() -> bool:
    return True
