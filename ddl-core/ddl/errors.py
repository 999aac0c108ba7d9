"""Typed errors. Every message names the rank, the operation and, where it helps, the fix."""

from __future__ import annotations


class DDLError(RuntimeError):
    """Base class of every error PowerDDL raises on purpose."""


class DDLConfigError(DDLError, ValueError):
    """A bad environment variable, option string or argument."""


class DDLTimeoutError(DDLError, TimeoutError):
    """A peer did not reach a collective within the timeout."""


class DDLPeerError(DDLError):
    """A peer died or aborted during a collective."""


class DDLMismatchError(DDLError, ValueError):
    """Ranks called the same collective with different shapes, dtypes or ops."""


class DDLShmError(DDLError, OSError):
    """The shared-memory area could not be created or is too small."""
