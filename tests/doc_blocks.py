"""Outputs docs/troubleshooting.md shows, kept true by tests: the block after a marker,
and lines with what differs between runs and machines replaced."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md"


def shown_after(marker: str) -> list[str]:
    """The lines of the first fenced block after ``marker`` on the page."""
    block = PAGE.read_text().split(marker, 1)[1]
    return block.split("```", 2)[1].splitlines()[1:]


def program_before(marker: str) -> str:
    """The last ```python block on the page before ``marker``: the program whose output
    the block after the marker shows."""
    before = PAGE.read_text().split(marker, 1)[0]
    return before.rsplit("```python\n", 1)[1].split("```", 1)[0]


def stable(lines: list[str]) -> list[str]:
    """``normalized`` without the lines whose presence or state depends on timing: which
    peers had exited by the report (``then ...``), each rank's flight recorder line, the
    dumps."""
    return [t for t in normalized(lines) if not t.startswith(
        ("ddlrun: then ", "ddlrun:     rank", "ddlrun:   dumps:"))]


def normalized(lines: list[str]) -> list[str]:
    """Lines with what differs between runs and machines replaced: paths up to the file
    name, line numbers inside ddl, pids, job ids, rank numbers, line counts, seconds."""
    out = []
    for t in lines:
        t = re.sub(r'File "[^"]*/([^/"]+)"', r'File "\1"', t)
        t = re.sub(r"\(pid \d+\)", "(pid P)", t)
        t = re.sub(r"job \d+_[0-9a-f]+", "job J", t)
        t = re.sub(r"\S*/ddl-flight-\d+/[^/\s]+/rank\d\.json", "DUMP", t)
        t = re.sub(r"\brank \d\b", "rank R", t)
        t = re.sub(r"\branks \d, \d\b", "ranks R, R", t)
        t = re.sub(r"last \d+ line", "last N line", t)
        t = re.sub(r"\d+\.\d s earlier", "T s earlier", t)
        t = re.sub(r'(File "(?:api|shm_meta|shm_sync)\.py"), line \d+', r"\1, line N", t)
        out.append(t.rstrip())
    return out
