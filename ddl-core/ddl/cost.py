"""The alpha-beta(-gamma) cost model: one formula per algorithm, shared by algorithm
selection (mode ``b``), calibration (mode ``p`` measures instead) and ddl-perf's simulator.

T = steps * alpha + bytes_on_the_wire * beta + bytes_reduced * gamma, per dimension.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from . import config
from .engines.identity_round import ROW_BYTES
from .errors import DDLConfigError
from .grid import chunk_sizes  # the engine's own chunking


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message step (latency + software overhead)
    beta: float  # seconds per byte on the wire
    gamma: float = 1 / 3e9  # seconds per byte reduced (one core's np.add)
    # Message sizes that cost otherwise: (from bytes, to bytes, alpha, beta, gamma), sizes
    # in [from, to) priced with those. The shared-memory engine reduces in one step up to
    # DDL_SHM_SMALL_BYTES and reduce-scatters above; from some MiB its data leaves the
    # last-level cache (and with cross-memory copies it reads its peers' buffers from 8 MiB); one
    # line alpha + beta x size follows none of these well across all of them
    # (docs/performance.md, simulator validation). Empty: one line for every size.
    regimes: tuple[tuple[float, float, float, float, float], ...] = ()

    def at(self, nbytes: float) -> Link:
        """The link as a message of ``nbytes`` sees it (its regime's alpha, beta, gamma)."""
        for lo, hi, alpha, beta, gamma in self.regimes:
            if lo <= nbytes < hi:
                return Link(alpha, beta, gamma)
        return self


# Defaults for a dimension before anything is measured.
SHARED_MEMORY = Link(alpha=10e-6, beta=1 / 5e9)
NETWORK = Link(alpha=150e-6, beta=1 / 1.0e9)


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def allreduce_time(alg: str, n: int, nbytes: float, link: Link) -> float:
    """Predicted time of an allreduce of ``nbytes`` over ``n`` ranks with algorithm ``alg``
    ('ring', 'hd' = recursive halving-doubling, 'native' = the engine's own, a ring)."""
    if n <= 1:
        return 0.0
    if link.regimes:
        link = link.at(nbytes)
    wire = 2 * (n - 1) / n * nbytes
    reduced = (n - 1) / n * nbytes
    if alg == "hd":
        if not is_pow2(n):
            return math.inf
        steps = 2 * math.log2(n)
    elif alg in ("ring", "native", "shm"):
        steps = 2 * (n - 1)
    else:
        raise ValueError(f"unknown algorithm {alg!r}")
    if alg == "native":
        # The engine's own collective (Gloo's, MPI's) overlaps reducing one piece with
        # receiving the next; ddl's ring and halving-doubling reduce between exchanges.
        # Measured on 2 hosts x 2 ranks at 1 Gbit/s: native 1.06-1.12x faster than hd.
        reduced = 0.0
    return steps * link.alpha + wire * link.beta + reduced * link.gamma


def reduce_scatter_time(alg: str, n: int, nbytes: float, link: Link) -> float:
    return allreduce_time(alg, n, nbytes, link) / 2


def best(candidates: list[str], n: int, nbytes: float, link: Link) -> str:
    return min(candidates, key=lambda a: (allreduce_time(a, n, nbytes, link), a))


def multidim_time(dims: list[tuple[str, int, Link]], nbytes: float) -> float:
    """DDL multi-dimensional allreduce without pipelining: reduce-scatter along each
    dimension in turn (each sees 1/(product of inner sizes) of the data), the outermost
    allreduce, then allgather back. ``dims`` = [(algorithm, size, link)], innermost first."""
    total = 0.0
    share = float(nbytes)
    for i, (alg, n, link) in enumerate(dims):
        if i == len(dims) - 1:
            total += allreduce_time(alg, n, share, link)
        else:
            total += 2 * reduce_scatter_time(alg, n, share, link)
            share /= n
    return total


def pipelined_time(dims: list[tuple[str, int, Link]], nbytes: float, chunks: int) -> float:
    """With the buffer cut into ``chunks`` pipelined through the dimensions, the slowest
    dimension sets the pace once the pipeline is full (a closed-form estimate;
    ``pipeline_time`` plays out ddl's actual chunks and schedule)."""
    if chunks <= 1:
        return multidim_time(dims, nbytes)
    stage = [multidim_time(dims[: i + 1], nbytes) - multidim_time(dims[:i], nbytes)
             for i in range(len(dims))]
    return max(stage) + sum(stage) / chunks


def pipeline_time(dims: list[tuple[str, int, Link]], nbytes: float, chunk_bytes: int,
                  itemsize: int = 4) -> float:
    """The multi-dimensional allreduce as ddl runs it (algorithms/multidim.py): the buffer
    cut into ``chunk_sizes`` chunks, one worker per dimension running its fixed schedule
    (reduce-scatter chunk i, then allgather chunk i-1 once the outer dimensions are done
    with it; the outermost allreduces each chunk). Each dimension is modelled as one
    server that does one operation at a time, and the schedule is played out exactly,
    so fill, drain and the ramp chunks at both ends are counted, not approximated."""
    dims = [d for d in dims if d[1] > 1]
    if not dims or nbytes <= 0:
        return 0.0
    if len(dims) == 1:
        alg, n, link = dims[0]
        return allreduce_time(alg, n, nbytes, link)
    elems = max(1, int(nbytes) // itemsize)
    chunks = [c * itemsize for c in chunk_sizes(elems, max(1, chunk_bytes // itemsize))]
    k = len(dims)
    inner = [math.prod(n for _, n, _ in dims[:j]) for j in range(k)]

    def cost_of(j: int, i: int) -> float:
        alg, n, link = dims[j]
        share = chunks[i] / inner[j]
        if j == k - 1:
            return allreduce_time(alg, n, share, link)
        return reduce_scatter_time(alg, n, share, link)

    # ready[j][i]: chunk i reduce-scattered along dimension j; done[j][i]: gathered back
    ready = [[math.nan] * len(chunks) for _ in range(k)]
    done = [[math.nan] * len(chunks) for _ in range(k)]
    queues = []
    for j in range(k):
        if j == k - 1:
            ops = [("ar", i) for i in range(len(chunks))]
        else:
            ops = [("rs", 0)]
            for i in range(1, len(chunks)):
                ops += [("rs", i), ("ag", i - 1)]
            ops.append(("ag", len(chunks) - 1))
        queues.append(ops)
    clock = [0.0] * k
    pos = [0] * k
    while any(pos[j] < len(queues[j]) for j in range(k)):
        progressed = False
        for j in range(k):
            while pos[j] < len(queues[j]):
                kind, i = queues[j][pos[j]]
                dep = ready[j - 1][i] if kind in ("rs", "ar") and j else 0.0
                if kind == "ag":
                    dep = done[j + 1][i]
                if math.isnan(dep):
                    break
                end = max(clock[j], dep) + cost_of(j, i)
                clock[j] = end
                (done if kind in ("ag", "ar") else ready)[j][i] = end
                pos[j] += 1
                progressed = True
        if not progressed:  # cannot happen for this schedule; guards the loop
            raise RuntimeError("pipeline schedule deadlocked")
    return max(done[0])


def identity_round_time(dims: list[tuple[str, int, Link]]) -> float:
    """What a call on the multi-host engine pays before its data crosses a host: the identity
    round (engines/identity_round.py), one fixed-size row per host gathered along the line
    after one shared-memory step inside the host (a grid of the host's ranks, then
    dimensions across hosts), or on any other grid gathered from every rank, over the
    slowest link. Nothing on one host (the shared-memory engine checks its ranks itself)."""
    dims = [d for d in dims if d[1] > 1]
    if all(alg == "shm" for alg, _, _ in dims):
        return 0.0
    host = 0.0
    if dims[0][0] == "shm" and all(alg != "shm" for alg, _, _ in dims[1:]):
        host = dims[0][2].alpha
        dims = dims[1:]
    n = math.prod(size for _, size, _ in dims)
    link = max((lk for _, _, lk in dims), key=lambda lk: (lk.beta, lk.alpha))
    return host + (n - 1) * (link.alpha + ROW_BYTES * link.beta)


# --------------------------------------------------------------------------- profiles
# A cost profile is what ``ddl-perf calibrate`` measured on a cluster: one fitted Link per
# grid dimension and engine. ``DDL_COST_PROFILE=path`` makes mode ``b`` and ``ddl-perf
# simulate`` use it instead of the defaults above.

PROFILE_VERSION = 1


@dataclass(frozen=True)
class DimProfile:
    index: int  # grid dimension, innermost (ranks in a host) first
    engine: str  # 'shm', 'gloo', 'mpi'
    size: int  # ranks along the dimension when it was measured
    algorithm: str  # what was timed: 'shm' or 'native'
    link: Link


@dataclass(frozen=True)
class Profile:
    machine: str
    dims: tuple[DimProfile, ...]
    measured: tuple[dict, ...] = ()
    # what a whole call took beyond its dimensions' fitted costs and its identity round,
    # when the dimensions run together (threads and processes handing each chunk on):
    # measured by calibrate on calls of one chunk, added once per call by the simulator
    call_overhead_s: float = 0.0
    # a whole allreduce small enough to ride on the identity round (engines/identity_round:
    # the data travels in the round's fixed-size rows), measured by calibrate; 0: not
    # measured (the simulator then prices the round from the fitted links)
    round_s: float = 0.0

    def link(self, index: int | None, engine: str) -> Link | None:
        """The link measured for this dimension and engine; else (or with ``index`` None: a
        sub-group's one dimension across hosts) for this engine on any dimension, the
        outermost such: a job with more dimensions than were measured crosses at least that
        slow a link; None when the engine was never measured."""
        found = self.exact(index, engine) if index is not None else None
        if found is not None:
            return found
        same = [d for d in self.dims if d.engine == engine]
        return max(same, key=lambda d: d.index).link if same else None

    def exact(self, index: int, engine: str) -> Link | None:
        """The link measured for this dimension on this engine, None if it was not."""
        return next((d.link for d in self.dims if d.index == index and d.engine == engine),
                    None)

    def rows(self, d: DimProfile) -> list[dict]:
        """What was measured for ``d``: its dimension on its engine (rows without an
        engine, from profiles of one engine per dimension, are their dimension's)."""
        return [r for r in self.measured
                if r.get("dim") == d.index and r.get("engine", d.engine) == d.engine]

    def job_dims(self) -> list[DimProfile]:
        """One DimProfile per dimension, by index: the engine the job ran it on (listed
        first; a second engine measured beside it, Gloo beside MPI, follows it)."""
        seen: dict[int, DimProfile] = {}
        for d in self.dims:
            seen.setdefault(d.index, d)
        return [seen[i] for i in sorted(seen)]

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, "machine": self.machine,
                "dims": [{"index": d.index, "engine": d.engine, "size": d.size,
                          "algorithm": d.algorithm, "alpha_s": d.link.alpha,
                          "beta_s_per_byte": d.link.beta,
                          "gamma_s_per_byte": d.link.gamma,
                          **({"regimes": [{"from_bytes": lo, "to_bytes": _finite_or_none(hi),
                                           "alpha_s": a, "beta_s_per_byte": b,
                                           "gamma_s_per_byte": g}
                                          for lo, hi, a, b, g in d.link.regimes]}
                             if d.link.regimes else {})} for d in self.dims],
                "call_overhead_s": self.call_overhead_s, "round_s": self.round_s,
                "measured": list(self.measured)}


def profile_from_json(doc: object, where: str) -> Profile:
    """``where`` names the source in errors (a path)."""
    def bad(why: str) -> DDLConfigError:
        return DDLConfigError(f"cost profile {where}: {why} (write one with "
                              "`ddlrun ... ddl-perf calibrate -o PATH`)")

    if not isinstance(doc, dict) or doc.get("version") != PROFILE_VERSION:
        raise bad(f"expected a JSON object with \"version\": {PROFILE_VERSION}")
    rows = doc.get("dims")
    if not isinstance(rows, list) or not rows:
        raise bad("\"dims\" must be a non-empty list")
    dims = []
    for k, row in enumerate(rows):
        try:
            alpha, beta = float(row["alpha_s"]), float(row["beta_s_per_byte"])
            gamma = float(row.get("gamma_s_per_byte", Link(0, 0).gamma))
            regimes = _regimes_from_json(row.get("regimes", []), bad, k, gamma)
            dim = DimProfile(int(row.get("index", k)), str(row["engine"]), int(row["size"]),
                             str(row.get("algorithm", "native")),
                             Link(alpha, beta, gamma, regimes))
        except DDLConfigError:
            raise  # the regimes' own message (it is a ValueError too)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise bad(f"dims[{k}] needs engine, size, alpha_s, beta_s_per_byte: "
                      f"{exc!r}") from None
        if min(alpha, beta, gamma) < 0 or not all(map(math.isfinite, (alpha, beta, gamma))):
            raise bad(f"dims[{k}]: alpha, beta and gamma must be finite and >= 0")
        dims.append(dim)
    seconds = []
    for key in ("call_overhead_s", "round_s"):
        raw = doc.get(key)  # absent or null: a profile without it
        value = 0.0 if raw is None else raw
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise bad(f"\"{key}\" must be a finite number >= 0")
        seconds.append(float(value))
    return Profile(str(doc.get("machine", "")), tuple(dims), tuple(doc.get("measured", ())),
                   *seconds)


def _regimes_from_json(rows: object, bad, k: int, gamma: float
                       ) -> tuple[tuple[float, float, float, float, float], ...]:
    """A dimension's ``regimes`` (Link.regimes): from_bytes < to_bytes (null: no upper
    end), alpha, beta and gamma (default: the dimension's) finite and >= 0, in order and
    not overlapping."""
    if not isinstance(rows, list):
        raise bad(f"dims[{k}].regimes must be a list")
    out = []
    for row in rows:
        try:
            lo, hi, alpha, beta, g = _regime(row, gamma)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise bad(f"dims[{k}].regimes: each needs from_bytes, to_bytes, alpha_s, "
                      f"beta_s_per_byte: {exc!r}") from None
        if not (0 <= lo < hi and math.isfinite(lo) and min(alpha, beta, g) >= 0
                and all(map(math.isfinite, (alpha, beta, g)))):
            raise bad(f"dims[{k}].regimes: want 0 <= from_bytes < to_bytes and alpha, beta, "
                      f"gamma finite and >= 0, got {row!r}")
        if out and lo < out[-1][1]:
            raise bad(f"dims[{k}].regimes must be in order of size and not overlap")
        out.append((lo, hi, alpha, beta, g))
    return tuple(out)


def _regime(row: dict, gamma: float) -> tuple[float, float, float, float, float]:
    hi = math.inf if row["to_bytes"] is None else float(row["to_bytes"])
    return (float(row["from_bytes"]), hi, float(row["alpha_s"]),
            float(row["beta_s_per_byte"]), float(row.get("gamma_s_per_byte", gamma)))


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no infinity


def load_profile(path: str) -> Profile:
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as exc:
        raise DDLConfigError(f"cost profile {path}: cannot read it: {exc.strerror}") from None
    except ValueError as exc:
        raise DDLConfigError(f"cost profile {path}: not JSON: {exc}") from None
    return profile_from_json(doc, path)


def save_profile(profile: Profile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.write("\n")


_loaded: dict[str, Profile] = {}


def env_profile() -> Profile | None:
    """The profile named by DDL_COST_PROFILE (read once per path), or None."""
    path = config.get("DDL_COST_PROFILE")
    if not path:
        return None
    if path not in _loaded:
        _loaded[path] = load_profile(path)
    return _loaded[path]


def link_for(index: int | None, engine: str, default: Link = NETWORK) -> Link:
    """The Link mode ``b`` plans dimension ``index`` (None: across hosts, see
    ``Profile.link``) on ``engine`` with: measured when DDL_COST_PROFILE has it, else
    ``default``."""
    profile = env_profile()
    found = profile.link(index, engine) if profile else None
    return found or default
