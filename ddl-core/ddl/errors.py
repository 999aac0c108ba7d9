"""Typed errors. Every message names the rank, the operation and, where it helps, the fix.

``after_peer``: the error is the consequence of another rank's failure (it died, left, aborted
or did not come in time). The failure record of a rank that dies of it says so
(ddl.failures), and ddlrun then blames the rank whose failure came first instead. Every such
error made in this process is remembered (its message, the last few), so that an error
that only carries its text on (torch's futures re-raise a RuntimeError with the message,
TensorFlow an op error) is still known for one.
"""

from __future__ import annotations

import collections

_PEER_FAILURES: collections.deque[str] = collections.deque(maxlen=8)


class DDLError(RuntimeError):
    """Base class of every error PowerDDL raises on purpose."""

    after_peer = False


class HorovodInternalError(DDLError):
    """A collective failed because the job lost a peer (it died, left or stopped answering
    in time): Horovod's name, which elastic training (``ddl.elastic.run``) catches to
    restore the last commit and go on with the ranks that are left."""


class HostsUpdatedInterrupt(DDLError):
    """Elastic training: hosts were added or removed, and every rank stops at the same
    commit to re-form the world. ``skip_sync``: only removals, so every rank already holds
    the state and it need not be broadcast again (Horovod's meaning)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job's hosts changed: re-forming the world"
                         + (" (hosts removed only)" if skip_sync else ""))
        self.skip_sync = skip_sync


class _AfterPeer(HorovodInternalError):
    """An error that another rank's failure caused (see the module's docstring)."""

    after_peer = True

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        text = str(self)
        if len(text) >= 10:  # long enough not to be found by chance in another message
            _PEER_FAILURES.append(text)


def peer_failures() -> tuple[str, ...]:
    """The messages of the last errors of this process that a peer's failure caused."""
    return tuple(_PEER_FAILURES)


class DDLConfigError(DDLError, ValueError):
    """A bad environment variable, option string or argument."""


class DDLTimeoutError(_AfterPeer, TimeoutError):
    """A peer did not reach a collective within the timeout."""


class DDLPeerError(_AfterPeer):
    """A peer died or aborted during a collective."""


class DDLMismatchError(DDLError, ValueError):
    """Ranks called the same collective with different shapes, dtypes or ops."""


class DDLShmError(DDLError, OSError):
    """The shared-memory area could not be created or is too small."""
