"""Typed launcher errors. Messages name the offending value and, where possible, the fix."""

from __future__ import annotations


class LaunchError(Exception):
    """Base class: anything that stops ddlrun before or while it starts ranks."""

    exit_code = 2


class UsageError(LaunchError):
    """Bad command line, host list, hostfile or environment: nothing was started."""

    exit_code = 2


class PreflightError(LaunchError):
    """A host failed the preflight check (unreachable, version mismatch, port in use)."""

    exit_code = 3

    def __init__(self, problems: list[str], table: str = "") -> None:
        self.problems = list(problems)
        self.table = table
        super().__init__("\n".join(self.problems))
