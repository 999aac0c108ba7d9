"""What every rank's DDL_OPTIONS says: ``-mode`` with the job's machine grid (``grid``:
GPUs per host x hosts per rack x racks per aisle x aisles), then the options ddlrun's own
environment holds (``inherited_options``) and --ddloption. The mode letters default to the
core's (``default_mode``) and a mode is checked by the core's own grammar where ``import
ddl`` works (``ddlrun.core``). Pure but for that door to the core.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import core
from .errors import UsageError
from .plan_types import Request


def grid(ranks_per_host: int, nhosts: int, racks: int | None, aisles: int | None) -> list[int]:
    """Machine grid, innermost first: GPUs per host x hosts per rack x racks per aisle x
    aisles. Dimensions of size 1 are dropped (a grid of one dimension is a flat ring)."""
    dims = [ranks_per_host]
    racks = racks or 1
    aisles = aisles or 1
    if nhosts % racks:
        raise UsageError(f"--racks {racks} does not divide the {nhosts} hosts evenly")
    if racks % aisles:
        raise UsageError(f"--aisles {aisles} does not divide the {racks} racks evenly")
    dims += [nhosts // racks, racks // aisles, aisles]
    kept = [d for d in dims if d > 1]
    return kept or [1]


def inherited_options(text: str | None, drop_mode: bool) -> list[str]:
    """DDL_OPTIONS from ddlrun's own environment, as options given before the command
    line's --ddloption; its ``-mode`` yields to --mode (``drop_mode``)."""
    words = (text or "").split()
    if drop_mode and "-mode" in words:
        at = words.index("-mode")
        del words[at:at + 2]
    return [" ".join(words)] if words else []


def ddl_options(req: Request, placement: Sequence[tuple[int, int]],
                inherited: str | None = None) -> str | None:
    """What every rank's DDL_OPTIONS says: ``-mode`` with the job's grid, then the options
    of ``inherited`` (DDL_OPTIONS in ddlrun's environment) and --ddloption, in that order;
    None with --no_ddloptions."""
    if req.no_ddloptions:
        return None
    extra = [*inherited_options(inherited, drop_mode=bool(req.mode)), *req.ddloptions]
    if not req.mode and any("-mode" in o.split() for o in extra):
        return " ".join(extra)  # --ddloption "-mode b:2x2" is the user's mode
    world = len(placement)
    per_host: dict[int, int] = {}
    for host, _ in placement:
        per_host[host] = per_host.get(host, 0) + 1
    mode = req.mode or default_mode()
    letters, _, dims = mode.partition(":")
    if dims:
        spec = mode
    else:
        counts = set(per_host.values())
        if len(counts) == 1:
            spec = f"{letters}:" + "x".join(
                str(d) for d in grid(counts.pop(), len(per_host), req.racks, req.aisles)
            )
        else:  # uneven hosts: no grid describes them, use one flat dimension
            spec = f"{letters}:{world}"
    _check_mode(spec, mode, world if dims else None)
    return " ".join(("-mode", spec, *extra))


def fixed_grid(req: Request, inherited: str | None = None) -> str | None:
    """The ``-mode`` with its own dimensions (``r:2x3``) that the ranks' DDL_OPTIONS would
    end with (the core takes the last ``-mode``: --mode first, then ``inherited``
    DDL_OPTIONS and --ddloption, as :func:`ddl_options` orders them), or None when ddlrun
    fits the grid: such a mode fixes the number of ranks, which an elastic world changes."""
    if req.no_ddloptions:
        return None
    words = ["-mode", req.mode] if req.mode else []
    for option in (*inherited_options(inherited, drop_mode=bool(req.mode)), *req.ddloptions):
        words += option.split()
    spec = None
    for i, word in enumerate(words[:-1]):
        if word == "-mode":
            spec = words[i + 1]
    return spec if spec is not None and ":" in spec else None


def default_mode() -> str:
    """The mode letters when ``--mode`` gives none: the core's own default
    (``ddl.options.DEFAULT_MODE``, the one source), so a job under ddlrun and one started
    by hand run the same algorithm."""
    options = core.require(core.options(), "its default mode",
                           "give the letters with --mode (r, n, b, p), or reinstall powerddl")
    return options.DEFAULT_MODE


def _check_mode(spec: str, given: str, world: int | None) -> None:
    """``spec`` by ddl's own ``-mode`` grammar and, with ``world``, its grid against the
    job's rank count (``ddl.options.parse_mode`` and ``grid_mismatch``, the one copy of
    each). Where ``import ddl`` fails the launcher cannot check it: the workers' ddl does,
    when it reads DDL_OPTIONS."""
    options, errors = core.options(), core.errors()
    if options is None or errors is None:  # left to the ranks
        return
    try:
        letters, shape = options.parse_mode(spec)
    except errors.DDLConfigError as e:
        raise UsageError(f"--mode {given!r} is invalid: {e}") from None
    why = options.grid_mismatch(letters, shape, world) if world is not None and shape else None
    if why:
        raise UsageError(f"--mode {given!r}: {why}")
