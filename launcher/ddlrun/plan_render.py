"""A plan as text: ``describe`` for --dry-run and -v (every rank's argv, working directory
and env; values quoted so a printout cannot be forged by a newline, the job's secret shown
as ``<secret>``) and ``rankfile_lines``, the Open MPI rankfile mpirun gets. Pure.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from . import envs
from .hosts import is_local
from .plan_types import JobPlan

MASK = "<secret>"


def rankfile_lines(plan: JobPlan, cores: Mapping[str, int] | None = None) -> list[str]:
    """Open MPI rankfile for the plan: ``rank R=host slot=S`` (S = local rank modulo the
    host's cores, so oversubscribed hosts stay valid)."""
    lines = []
    for r in sorted(plan.ranks, key=lambda r: r.rank):
        ncores = (cores or {}).get(r.host) or 0
        slot = r.local_rank % ncores if ncores else r.local_rank
        lines.append(f"rank {r.rank}={r.host} slot={slot}")
    return lines


def quote(value: str) -> str:
    """``shlex.quote``, but a value with control characters (a newline could forge a line
    of the printout) is written in bash's ``$'...'`` form with escapes."""
    if value.isprintable():
        return shlex.quote(value)
    out = []
    for ch in value:
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        elif ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        else:
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
    return "$'" + "".join(out) + "'"


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def masked(key: str, value: str) -> str:
    """``KEY=VALUE`` for printing, the value quoted: secrets shown as ``<secret>``."""
    return f"{key}={MASK if envs.is_secret(key) else quote(value)}"


def describe(plan: JobPlan, cwd: str | None = None) -> str:
    """Human-readable plan for --dry-run and -v (values quoted, secrets masked): every
    rank's argv, working directory and env."""
    out = [
        f"job {plan.job_id}: {plan.world_size} ranks on {len(plan.hosts)} host(s)",
        f"  MASTER_ADDR={quote(plan.master_addr)} MASTER_PORT={plan.master_port}",
        f"  DDL_OPTIONS={quote(plan.ddl_options)}" if plan.ddl_options is not None
        else "  DDL_OPTIONS not set (--no_ddloptions)",
    ]
    for name in plan.unknown_slots:
        out.append(f"  note: slots of {name} are unknown (no {name}:N, its GPUs not probed in "
                   "--dry-run): planned 1 rank there; the real run takes one rank per GPU "
                   f"nvidia-smi lists there, else 1 (give {name}:N or --accelerators N)")
    common = dict(plan.common_env)
    for h in plan.hosts:
        local = is_local(h.host.name)
        out.append(f"host {h.index} {h.host.destination}: ranks "
                   + ",".join(str(r.rank) for r in h.ranks))
        for r in h.ranks:
            own = {k: v for k, v in r.env if common.get(k) != v}
            out.append(f"  [{r.rank}] argv: " + " ".join(quote(a) for a in r.argv))
            if cwd:
                where = "" if local else " (if it exists there, else the login directory)"
                out.append(f"  [{r.rank}] cwd: {quote(cwd)}{where}")
            base = "ddlrun's environment" if local else "the remote login environment"
            out.append(f"  [{r.rank}] env: {base} + common env + "
                       + " ".join(masked(k, v) for k, v in sorted(own.items())))
    out.append("common env: " + " ".join(masked(k, v) for k, v in plan.common_env))
    return "\n".join(out)
