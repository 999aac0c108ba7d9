"""ddlrun: the PowerDDL multi-server launcher.

Shape: parse (``cli``) -> plan (``hosts``, ``plan``: pure, frozen dataclasses) -> act
(``backends``, ``procs``, ``agent``, ``run``). See docs/launcher.md.
"""

from __future__ import annotations


def version() -> str:
    """The installed powerddl version ("unknown" when running from a bare checkout)."""
    from importlib import metadata

    try:
        return metadata.version("powerddl")
    except metadata.PackageNotFoundError:
        return "unknown"


__all__ = ["version"]
