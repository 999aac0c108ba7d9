"""Elastic training, framework-free: the state a job keeps across a change of its world
(``State``, ``ObjectState``), the loop that re-forms the world in place (``run``), the
exceptions that drive it (Horovod's ``HorovodInternalError`` and
``HostsUpdatedInterrupt``) and the link to ddlrun's elastic driver (``link``). The torch,
TensorFlow and Keras adapters add their objects' state (``ddl.torch.elastic`` and so on).
"""

from __future__ import annotations

from ..errors import HorovodInternalError, HostsUpdatedInterrupt
from .runner import reset, run, run_fn
from .state import ObjectState, State

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "reset",
           "run", "run_fn"]
