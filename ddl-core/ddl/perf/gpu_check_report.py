"""The report of ``ddl-perf gpu-check``: one markdown page and its JSON twin, rendered from
the list of check results and nothing else (pure), so the layout is unit-tested without a
GPU and a report can be re-rendered from its JSON.

Layout of the markdown: a title with the verdict, a table of the checks (status, seconds,
one-line summary), then one section per check with its table (busbw per size, images/s) or
its details, and for a failed check the last lines its job printed. The JSON holds the same
(``kind: "gpu-check"``, ``version: 1``, ``meta``, ``results``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

PASS, FAIL, SKIP = "pass", "fail", "skip"
STATUSES = (PASS, FAIL, SKIP)


@dataclass(frozen=True)
class Result:
    """One check's outcome: ``status`` (pass, fail, skip), a one-line ``summary``, an
    optional table (``columns`` and ``rows``), ``details`` (lines), ``tail`` (the last lines
    of a failed job's output) and the seconds its jobs took."""

    name: str
    title: str
    status: str
    summary: str
    seconds: float = 0.0
    columns: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    details: tuple[str, ...] = ()
    tail: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}: one of {', '.join(STATUSES)}")


def verdict(results: Sequence[Result]) -> str:
    """FAILED when any check failed, else PASSED (skipped checks are listed, not failed)."""
    return "FAILED" if any(r.status == FAIL for r in results) else "PASSED"


def exit_code(results: Sequence[Result]) -> int:
    return 1 if verdict(results) == "FAILED" else 0


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(_cell(c) for c in columns) + " |",
            "|" + "|".join("---" for _ in columns) + "|",
            *("| " + " | ".join(_cell(str(v)) for v in row) + " |" for row in rows)]


def render_markdown(results: Sequence[Result], meta: Mapping[str, str]) -> str:
    """The report as markdown (what is printed at the end and written as gpu-check.md)."""
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    lines = [f"# ddl-perf gpu-check: {verdict(results)}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [f"- checks: {counts[PASS]} passed, {counts[FAIL]} failed, "
              f"{counts[SKIP]} skipped", ""]
    lines += _table(("check", "status", "seconds", "summary"),
                    [(r.name, r.status.upper(), f"{r.seconds:.1f}", r.summary)
                     for r in results])
    for r in results:
        lines += ["", f"## {r.name}: {r.status.upper()}", "", r.title, "", r.summary]
        if r.columns:
            lines += ["", *_table(r.columns, r.rows)]
        if r.details:
            lines += ["", *(f"- {d}" for d in r.details)]
        if r.tail:
            lines += ["", "Last lines of its output:", "", "```", *r.tail, "```"]
    return "\n".join(lines) + "\n"


def to_json(results: Sequence[Result], meta: Mapping[str, str]) -> str:
    doc = {"kind": "gpu-check", "version": 1, "verdict": verdict(results), "meta": dict(meta),
           "results": [dataclasses.asdict(r) for r in results]}
    return json.dumps(doc, indent=1) + "\n"


def from_json(text: str) -> tuple[list[Result], dict[str, str]]:
    """The results and meta of a report's JSON (to re-render it)."""
    doc = json.loads(text)
    if doc.get("kind") != "gpu-check":
        raise ValueError("not a ddl-perf gpu-check report (kind is not 'gpu-check')")
    results = []
    for r in doc["results"]:
        r = dict(r)
        for key in ("columns", "details", "tail"):
            r[key] = tuple(r.get(key, ()))
        r["rows"] = tuple(tuple(row) for row in r.get("rows", ()))
        results.append(Result(**r))
    return results, dict(doc["meta"])
