"""The flight recorder's diagnosis: from what each rank's recorder says (a failure record's
``flight`` summary, or a dump file ``ddl.flight`` wrote), a few lines naming the rank that
is behind, the collective the others wait in, what every rank was doing, and the dumps.

Pure: the inputs are parsed JSON objects (see ``ddl.flight``: per queue ``issued``,
``open`` and ``done`` entries; ``waits``; ``at``, the program's frame, in a dump), plus the
C-level stacks ``faulthandler`` wrote, as text. Standard library only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

MAX_RANKS_SHOWN = 8
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')


def frame_from_stacks(text: str, package_marker: str = f"{os.sep}ddl{os.sep}") -> dict | None:
    """The main thread's innermost frame outside ddl in ``faulthandler``'s output (its last
    dump in ``text``): the thread whose stack ends in ``<module>``."""
    blocks: list[list[dict]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
        elif (m := _FRAME.match(line)) and blocks:
            blocks[-1].append({"file": m["file"], "line": int(m["line"]),
                               "function": m["function"]})
    for frames in reversed(blocks):  # the newest dump is last; its main thread
        if frames and frames[-1]["function"] == "<module>":
            for f in frames:
                if package_marker not in f["file"]:
                    return f
            return frames[0]
    return None


def _where(at: Mapping | None, cwd: str | None) -> str:
    if not at:
        return ""
    path = str(at.get("file", "?"))
    if cwd and os.path.isabs(path):
        rel = os.path.relpath(path, cwd)
        if not rel.startswith(".."):
            path = rel
    return f"{path}:{at.get('line', '?')} in {at.get('function', '?')}"


def _call(e: Mapping) -> str:
    what = e.get("what") or ""
    name = e.get("name") or "collective"
    return f"#{e.get('seq')} {name}({what})" if what else f"#{e.get('seq')} {name}"


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:MAX_RANKS_SHOWN])
    more = f" and {len(ranks) - MAX_RANKS_SHOWN} more" if len(ranks) > MAX_RANKS_SHOWN else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + shown + more


def _age(t: float | None, now: float | None) -> str:
    if t is None or now is None:
        return ""
    return f"{max(0.0, now - t):.1f} s"


def clean(flight: object) -> dict | None:
    """``flight`` (a summary or a dump, from any ddl version) with only what this module
    reads, each of the right type; None when it has nothing usable."""
    if not isinstance(flight, Mapping) or not isinstance(flight.get("queues"), Mapping):
        return None
    queues = {}
    for name, q in flight["queues"].items():
        if not isinstance(q, Mapping) or not isinstance(q.get("issued"), int):
            continue
        queues[str(name)] = {"issued": q["issued"], **{
            part: [e for e in q.get(part) or () if isinstance(e, Mapping)
                   and isinstance(e.get("seq"), int)] if isinstance(q.get(part), list) else []
            for part in ("open", "done")}}
    if not queues:
        return None
    out: dict = {"queues": queues}
    if isinstance(flight.get("time"), (int, float)):
        out["time"] = float(flight["time"])
    out["waits"] = [w for w in flight.get("waits") or () if isinstance(w, Mapping)] \
        if isinstance(flight.get("waits"), list) else []
    if isinstance(flight.get("at"), Mapping):
        out["at"] = flight["at"]
    for key in ("dump", "pid"):
        if isinstance(flight.get(key), (str, int)):
            out[key] = flight[key]
    return out


def behind(flights: Mapping[int, Mapping | None], queue: str = "job") -> list[int]:
    """The ranks furthest behind on ``queue``: fewest collectives issued, when some rank
    issued more (none when every rank that reported is level)."""
    cleaned = {r: c for r, f in flights.items() if (c := clean(f)) is not None}
    issued = {r: c["queues"][queue]["issued"] for r, c in cleaned.items()
              if queue in c["queues"]}
    if not issued or min(issued.values()) == max(issued.values()):
        return []
    low = min(issued.values())
    return sorted(r for r, n in issued.items() if n == low)


def waited_on(flights: Mapping[int, Mapping | None]) -> list[int]:
    """The peers the ranks' waits name, most named first: whom they were stuck on."""
    count: dict[int, int] = {}
    for f in flights.values():
        c = clean(f)
        for w in (c or {}).get("waits", ()):
            if isinstance(w.get("peer"), int):
                count[w["peer"]] = count.get(w["peer"], 0) + 1
    return sorted(count, key=lambda p: (-count[p], p))


def where(flight: Mapping | None, cwd: str | None = None) -> str:
    """Where a rank's program is, as its dump says (``file:line in function``), or ""."""
    return _where(flight.get("at") if isinstance(flight, Mapping) else None, cwd)


def diagnose(flights: Mapping[int, Mapping | None], world: int, *,
             at: Mapping[int, Mapping | None] | None = None, cwd: str | None = None,
             dumps: Sequence[str] = (), unanswered: Sequence[int] = ()) -> list[str]:
    """The diagnosis lines (empty when no rank's recorder said anything). ``flights``: by
    rank, its summary or dump (None: nothing from it); ``at``: by rank, where its program
    is (from a dump or its stacks); ``dumps``: the files to name; ``unanswered``: ranks
    asked for a dump that did not write one."""
    at = {r: a for r, a in (at or {}).items() if isinstance(a, Mapping)}
    known = {r: c for r, f in flights.items() if (c := clean(f)) is not None}
    if not known:
        return []
    lines: list[str] = []
    silent = [r for r in range(world) if r not in known]
    now = max((float(f.get("time") or 0.0) for f in known.values()), default=None)
    queues = sorted({q for f in known.values() for q in f["queues"]},
                    key=lambda q: (q != "job", q))
    for qname in queues:
        per = {r: f["queues"][qname] for r, f in known.items() if qname in f["queues"]}
        issued = {r: int(q.get("issued", 0)) for r, q in per.items()}
        label = "the job's collectives" if qname == "job" else f"the collectives of {qname}"
        top = max(issued.values())
        behind = sorted(r for r, n in issued.items() if n < top)
        ahead = sorted(r for r, n in issued.items() if n == top)
        if behind:
            low = min(issued[r] for r in behind)
            late = sorted(r for r in behind if issued[r] == low)
            waiting = [per[r]["open"][-1] for r in ahead if per[r].get("open")]
            wait_text = f" and wait in {_call(waiting[0])}" if waiting else ""
            lines.append(f"{_ranks(late)} {'is' if len(late) == 1 else 'are'} behind on "
                         f"{label}: issued {low}, while {_ranks(ahead)} issued "
                         f"{top}{wait_text}")
            for r in late:
                lines.append("  " + _rank_line(r, per[r], at.get(r) or known[r].get("at"),
                                               now, cwd))
        elif len(per) == 1:
            lines.append(f"{_ranks(sorted(per))} issued {top} of {label}")
        elif qname == "job" or any(q.get("open") for q in per.values()):
            lines.append(f"every rank that reported issued {top} of {label}")
        for r in sorted(per):
            if behind and r in behind and issued[r] == min(issued[b] for b in behind):
                continue
            if per[r].get("open"):
                lines.append("  " + _rank_line(r, per[r], at.get(r) or known[r].get("at"),
                                               now, cwd, waits=known[r].get("waits") or ()))
        opens = {r: per[r]["open"][-1] for r in per if per[r].get("open")}
        same_seq = {}
        for r, e in opens.items():
            same_seq.setdefault(e.get("seq"), []).append(r)
        for seq, rs in same_seq.items():
            calls = {_call(opens[r]) for r in rs}
            if len(calls) > 1:
                lines.append(f"  they differ at #{seq}: " + "; ".join(
                    f"rank {r}: {_call(opens[r])}" for r in sorted(rs)))
    quiet = [r for r in silent if r in unanswered]
    silent = [r for r in silent if r not in unanswered]
    for r in quiet:
        where = _where(at.get(r), cwd)
        lines.append(f"rank {r} did not answer (stuck outside Python?)"
                     + (f"; its C-level stack: {where}" if where else ""))
    if silent:
        lines.append(f"no flight record from {_ranks(silent)} (it exited without one, or "
                     "was killed)")
    if dumps:
        lines.append("dumps: " + " ".join(dumps))
    return lines


def _rank_line(r: int, q: Mapping, at: Mapping | None, now: float | None, cwd: str | None,
               waits: Sequence[Mapping] = ()) -> str:
    parts = [f"rank {r}:"]
    if q.get("open"):
        e = q["open"][-1]
        state = e.get("state", "?")
        since = e.get("started") or e.get("queued")
        age = _age(since, now)
        parts.append(f"{_call(e)} {state}" + (f" for {age}" if age and state != "failed" else ""))
        if e.get("error"):
            parts.append(f"({e['error']})")
    elif q.get("done"):
        e = q["done"][-1]
        # a call done on the caller's thread has no end time of its own when it is the last
        ended = _age(e.get("ended"), now)
        began = None if ended else _age(e.get("started") or e.get("queued"), now)
        parts.append(f"last finished {_call(e)}" + (f", {ended} earlier" if ended else
                                                     f", begun {began} earlier" if began else ""))
    for w in waits[:1]:
        parts.append(f"waiting on rank {w.get('peer')} (its engine step {w.get('peer_step')}, "
                     f"this rank's {w.get('step')})")
    where = _where(at, cwd)
    return " ".join(parts) + (f"; now at {where}" if where else "")
