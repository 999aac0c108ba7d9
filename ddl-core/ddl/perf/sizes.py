"""Byte sizes as ``ddl-perf`` reads them: one size (``parse_size``, nccl-tests' ``-b``/``-e``
spelling), a comma-separated list (``size_list``, ``--sizes``) and the sweep nccl-tests
visits (``sweep``); and as it writes them (``size_label``). Standard library and
``ddl.config`` only: every ``ddl-perf`` command imports it.
"""

from __future__ import annotations

import argparse
import re

from .. import config

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes as nccl-tests' ``-b``/``-e`` read them: a number with an optional K, M or G
    suffix in binary units (``64K`` = 65536, ``1.5M``); a trailing ``B``/``iB`` is allowed."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"invalid size {text!r}: give bytes with an optional K, M or G "
                         "suffix, e.g. 8, 64K, 128M, 1G")
    return int(float(m[1]) * _UNITS[m[2].upper()])


def size_label(n: float) -> str:
    """8 B, 1 KiB, 64 MiB: the sizes people write (binary units, as -b/-e read them)."""
    n = float(n)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n:.0f} B"


def sweep(min_bytes: int, max_bytes: int, factor: int = 1, step: int = 1 << 20) -> list[int]:
    """The sizes nccl-tests visits: from ``min_bytes`` up to ``max_bytes`` inclusive,
    multiplying by ``factor`` when it is above 1, else adding ``step`` bytes."""
    if min_bytes < 0 or max_bytes < min_bytes:
        raise ValueError(f"-b {min_bytes} / -e {max_bytes}: need 0 <= min bytes <= max bytes")
    if factor > 1 and min_bytes == 0:
        raise ValueError("-b 0 with -f: a factor never leaves 0; start at 1 byte or more")
    if factor <= 1 and step <= 0 and min_bytes != max_bytes:
        raise ValueError("-i must be positive (or use -f N with N >= 2)")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        if factor <= 1 and step <= 0:
            break
        size = size * factor if factor > 1 else size + step
    return sizes


def size_list(text: str) -> list[int]:
    """``--sizes 1M,16M,1G``: bytes by ddl's own size rule (``ddl.config``)."""
    return [config._size(s) for s in text.split(",") if s]


def size_arg(text: str) -> int:
    """``parse_size`` as an argparse type: a bad size is argparse's one-line error."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
