"""Calls into one torch ProcessGroup (Gloo or NCCL) from ddl's engines: failures become
ddl errors naming the rank, the operation and the group, and ``close()`` destroys the group
while the interpreter is whole.

Why destroy it explicitly: a process group's worker threads keep each Work, and so its
tensors, for a moment after ``wait()`` returns, and dropping a tensor made in Python takes
the GIL. Left to the interpreter's own teardown, a worker thread that does so while Python
is finalizing is unwound and the process aborts ("terminate called without an active
exception", after every rank had printed its result). torch releases the GIL while it
destroys a process group, whose destructor joins those threads, so once ``close()`` returns
none is left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import DDLPeerError, DDLTimeoutError


def classify(error: BaseException, context: str) -> DDLTimeoutError | DDLPeerError:
    """A torch/Gloo/NCCL error as ddl's: a timeout ("Timed out waiting ... for recv",
    "timeout", DistStoreError's "wait timeout") or a lost peer (everything else)."""
    text = str(error)
    low = text.lower()
    cls = DDLTimeoutError if "timed out" in low or "timeout" in low else DDLPeerError
    first = text.splitlines()[0] if text else repr(error)
    return cls(f"{context}: {first}")


class PGCaller:
    """Owns ``pg`` (its only reference, so ``close()`` destroys it) and runs operations on
    it; ``where`` names the group in error messages."""

    def __init__(self, pg: Any, rank: int, where: str, *, shutdown: bool = False):
        self.pg = pg
        self.rank = rank
        self.where = where
        self._shutdown = shutdown  # NCCL wants its communicators aborted before destruction

    def run(self, what: str, *issues: Callable[[Any], Any]) -> None:
        """Issue each operation (a callable taking the group, returning a Work), then wait
        for them all. Every
        issued one is waited for even after another failed, so none is left running in the
        group's threads (destroying the group would wait for it)."""
        error: RuntimeError | None = None
        works = []
        try:
            for issue in issues:
                works.append(issue(self.pg))
        except RuntimeError as exc:
            error = exc
        for w in works:
            try:
                w.wait()
            except RuntimeError as exc:
                error = error or exc
        if error is not None:
            raise classify(error, f"rank {self.rank}: {what} on {self.where} failed") from error

    def close(self) -> None:
        """Destroy the group (its threads joined). Safe to call more than once."""
        pg, self.pg = self.pg, None
        if pg is not None and self._shutdown:
            pg.shutdown()
