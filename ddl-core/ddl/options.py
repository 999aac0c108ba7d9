"""``DDL_OPTIONS``: the IBM DDL option string, e.g. ``-mode b:4x2 -dump_iter 100``.

Pure parsing; what the options do lives with the algorithms that read them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from .errors import DDLConfigError

MODES = {
    "r": "ring in every dimension",
    "n": "engine-native collective where possible",
    "b": "best of native/ring per dimension by the cost model",
    "p": "explore: time each candidate per dimension at start, keep the fastest",
}
# The mode letters without ``-mode`` and ddlrun's default (``ddlrun -m`` not given): the one
# source for both. Ring: no measuring at start, the bandwidth-optimal algorithm for the large
# gradient buckets that dominate training; ``b``/``p`` are opt-ins (docs/tuning.md).
DEFAULT_MODE = "r"


@dataclass(frozen=True)
class Options:
    mode: str = DEFAULT_MODE
    grid: tuple[int, ...] | None = None  # innermost dimension first; None = one flat ring
    dump_iter: int = 0
    dbg_level: int = 0

    def to_string(self) -> str:
        parts = []
        if self.grid is not None:
            parts.append(f"-mode {self.mode}:{'x'.join(map(str, self.grid))}")
        elif self.mode != DEFAULT_MODE:
            parts.append(f"-mode {self.mode}")
        if self.dump_iter:
            parts.append(f"-dump_iter {self.dump_iter}")
        if self.dbg_level:
            parts.append(f"-dbg_level {self.dbg_level}")
        return " ".join(parts)


def parse_mode(text: str) -> tuple[str, tuple[int, ...] | None]:
    """``b:4x2`` -> ("b", (4, 2)). One letter applies to every dimension; several letters
    give one per dimension, innermost first (``rb:4x2``: ring in the host, best across)."""
    letters, _, dims = text.partition(":")
    bad = [c for c in letters if c not in MODES] or ([] if letters else [""])
    if bad:
        raise DDLConfigError(
            f"-mode {text!r}: unknown mode letter {bad[0]!r}; use one of "
            + ", ".join(f"{k} ({v})" for k, v in MODES.items())
        )
    if not dims:
        if len(letters) > 1:
            raise DDLConfigError(f"-mode {text!r}: one letter per dimension needs a grid")
        return letters, None
    try:
        grid = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError:
        raise DDLConfigError(
            f"-mode {text!r}: the grid must be positive integers joined by 'x', e.g. b:4x2"
        ) from None
    if not grid or any(d < 1 for d in grid):
        raise DDLConfigError(f"-mode {text!r}: every grid dimension must be >= 1")
    if len(letters) not in (1, len(grid)):
        raise DDLConfigError(
            f"-mode {text!r}: {len(letters)} mode letters for {len(grid)} dimensions "
            "(give one letter, or one per dimension)"
        )
    return letters, grid


def _int_arg(flag: str, value: str, lo: int, hi: int | None = None) -> int:
    try:
        v = int(value)
    except ValueError:
        raise DDLConfigError(f"{flag} expects an integer, got {value!r}") from None
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise DDLConfigError(f"{flag} must be {rng}, got {v}")
    return v


def parse(text: str) -> Options:
    try:
        tokens = shlex.split(text or "")
    except ValueError as exc:
        raise DDLConfigError(f"DDL_OPTIONS {text!r}: {exc}") from None
    mode, grid, dump_iter, dbg = DEFAULT_MODE, None, 0, 0
    i = 0
    while i < len(tokens):
        flag = tokens[i]
        if flag not in ("-mode", "-dump_iter", "-dbg_level"):
            raise DDLConfigError(
                f"DDL_OPTIONS: unknown option {flag!r} (known: -mode, -dump_iter, -dbg_level)"
            )
        if i + 1 >= len(tokens):
            raise DDLConfigError(f"DDL_OPTIONS: {flag} needs a value")
        value = tokens[i + 1]
        if flag == "-mode":
            mode, grid = parse_mode(value)
        elif flag == "-dump_iter":
            dump_iter = _int_arg(flag, value, 0)
        else:
            dbg = _int_arg(flag, value, 0, 2)
        i += 2
    return Options(mode, grid, dump_iter, dbg)


def grid_mismatch(mode: str, grid: tuple[int, ...], world_size: int) -> str | None:
    """Why ``-mode mode:grid`` cannot describe a job of ``world_size`` ranks, or None (the
    one rule: the core at init and ddlrun before it starts anything)."""
    prod = 1
    for d in grid:
        prod *= d
    if prod == world_size:
        return None
    return (f"-mode {mode}:{'x'.join(map(str, grid))} describes {prod} ranks but the job "
            f"has {world_size}")


def check_grid(opts: Options, world_size: int) -> None:
    if opts.grid is None:
        return
    why = grid_mismatch(opts.mode, opts.grid, world_size)
    if why:
        raise DDLConfigError(why)
