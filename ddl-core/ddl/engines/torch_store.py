"""ddl's rendezvous as a ``torch.distributed.Store``, so torch's process groups (Gloo, NCCL)
and ``PrefixStore`` meet through it instead of an open ``TCPStore``.

torch calls a Python ``Store`` subclass from C++ (its own threads too) through a pybind11
trampoline that takes the GIL; an exception raised here travels back through the C++
caller to the Python code that started it (the group's constructor) as the same exception.
The trampoline looks up ``getNumKeys`` and ``deleteKey`` by their C++ names, so both
spellings are defined.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import torch.distributed as dist

from ..rendezvous import Rendezvous, StoreClient

# torch keeps only the C++ half of a Store made in Python: once the Python object is
# collected, torch's calls into it fail ("INTERNAL ASSERT FAILED ... Not implemented"). The
# groups made from a store keep its C++ half for as long as they live, and ddl's callers
# (a PrefixStore made inline, the device engines) do not keep the Python one, so every store
# is kept here for the life of the process: one small object per group.
_KEPT: list[TorchStore] = []


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class TorchStore(dist.Store):
    """A torch ``Store`` over ``client``. ``owner`` is kept alive as long as torch holds the
    store (rank 0's server must outlive the groups made from it). With ``deadline`` (a
    ``time.monotonic()`` value) no wait lasts past it: a group's constructor then cannot wait
    longer for a peer than the group's own creation timeout, whatever timeout torch asks
    for (the same it uses for every collective of the group)."""

    def __init__(self, client: StoreClient, owner: Rendezvous | None = None, *,
                 deadline: float | None = None):
        super().__init__()
        self._client = client
        self._owner = owner
        self._deadline = deadline
        _KEPT.append(self)
        self.set_timeout(datetime.timedelta(seconds=client.timeout))

    @property
    def client(self) -> StoreClient:
        return self._client

    def with_deadline(self, seconds: float) -> TorchStore:
        """The same store, whose waits end ``seconds`` from now at the latest."""
        return TorchStore(self._client, self._owner, deadline=time.monotonic() + seconds)

    def _wait_s(self, timeout: datetime.timedelta | None = None) -> float:
        wanted = (self.timeout if timeout is None else timeout).total_seconds()
        if self._deadline is None:
            return wanted
        return min(wanted, max(0.0, self._deadline - time.monotonic()))

    def set(self, key: str, value: bytes | str) -> None:
        self._client.set(key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._client.get(key, self._wait_s())

    def add(self, key: str, value: int) -> int:
        return self._client.add(key, value)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._client.compare_set(key, _bytes(expected), _bytes(desired))

    def check(self, keys: Sequence[str]) -> bool:
        return self._client.check(list(keys))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        self._client.wait(list(keys), self._wait_s(timeout))

    def delete_key(self, key: str) -> bool:
        return self._client.delete(key)

    deleteKey = delete_key  # noqa: N815 - the name torch's trampoline looks up

    def num_keys(self) -> int:
        return self._client.num_keys()

    getNumKeys = num_keys  # noqa: N815 - the name torch's trampoline looks up

    def clone(self) -> TorchStore:
        # The client is thread-safe, so a clone may share it.
        return TorchStore(self._client, self._owner, deadline=self._deadline)
