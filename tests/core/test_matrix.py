"""tools/matrix.py (``make matrix``): the supported range and its table, pure."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import matrix  # noqa: E402


def _extra_pin(name: str) -> str:
    return re.search(rf'"{re.escape(name)}==([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]


def test_the_newest_end_is_what_the_extras_pin():
    for name, (oldest, newest) in matrix.supported().items():
        assert newest == _extra_pin(name), name
        assert tuple(map(int, oldest.split("."))) < tuple(map(int, newest.split("."))), name
    assert set(matrix.supported()) == {"torch", "tensorflow-cpu", "keras"}


def test_pins_of_each_end():
    ends = matrix.supported()
    assert matrix.pins("oldest") == [f"{n}=={v[0]}" for n, v in ends.items()]
    assert matrix.pins("newest") == [f"{n}=={v[1]}" for n, v in ends.items()]


def test_summary_counts_read_pytests_last_line():
    text = "....F\n= 2 failed, 120 passed, 4 skipped, 1 error in 9.10s ="
    assert matrix.summary_counts(text) == {"passed": 120, "failed": 2, "skipped": 4,
                                           "error": 1}
    assert matrix.summary_counts("no tests ran") == {"passed": 0, "failed": 0, "skipped": 0,
                                                     "error": 0}


def test_docs_table_shows_both_ends_of_the_range():
    text = (ROOT / "docs" / "install.md").read_text()
    for end, index in (("oldest", 0), ("newest", 1)):
        row = re.search(rf"^\| {end} \| (.+) \|$", text, re.M)
        assert row, f"docs/install.md has no {end} row in the matrix table"
        cells = row[1].split(" | ")
        ends = matrix.supported()
        assert cells[0].startswith(ends["torch"][index]), cells
        assert cells[1] == ends["tensorflow-cpu"][index], cells
        assert cells[2] == ends["keras"][index], cells
