"""The simulator's allreduce model, what ``simulate`` (the table) and ``plot`` (a calibrate
profile's fit) both draw on: each grid dimension's algorithm as mode ``b`` picks it
(``plan_dims``), one message size played out chunk by chunk as ddl runs it against a flat
ring (``allreduce_row``), and the links of each dimension from ``--links`` or a profile.
Pure, over ``ddl.cost``.
"""

from __future__ import annotations

import math

from .. import cost
from ..engines.identity_round import FOLD_BYTES


def network_candidates(n: int) -> list[str]:
    """What mode b chooses among on a network dimension (algorithms/dims.py GroupDim)."""
    return ["ring", "native"] + (["hd"] if cost.is_pow2(n) else [])


def plan_dims(sizes: list[int], links: list[tuple[str, cost.Link]], nbytes: float
              ) -> list[tuple[str, int, cost.Link]]:
    """(algorithm, size, link) per dimension, innermost first: shared memory runs 'shm',
    a network dimension mode b's pick for the share of the buffer it sees."""
    out = []
    share = float(nbytes)
    for n, (engine, link) in zip(sizes, links, strict=True):
        if engine == "shm":
            alg = "shm"
        elif engine in ("ring", "hd", "native"):
            # a fixed algorithm (presets); halving-doubling needs a power of two, as in ddl
            alg = "ring" if engine == "hd" and not cost.is_pow2(n) else engine
        else:
            alg = cost.best(network_candidates(n), n, share, link)
        out.append((alg, n, link))
        share /= n
    return out


def allreduce_row(sizes: list[int], links: list[tuple[str, cost.Link]], nbytes: float,
                  chunk_bytes: int, call_overhead: float = 0.0, round_s: float = 0.0) -> dict:
    """One size: a flat ring on the slowest link against ddl's multi-dimensional call, which
    also pays its identity round and ``call_overhead`` (a profile's measured per-call cost
    beyond its dimensions, ``Profile.call_overhead_s``). ``round_s``: a whole call that
    rides on the round, as measured (``Profile.round_s``; 0: priced from the links)."""
    world = math.prod(sizes)
    dims = plan_dims(sizes, links, nbytes)
    slowest = max((link for _, link in links), key=lambda lk: (lk.beta, lk.alpha))
    round_measured = round_s
    round_s = cost.identity_round_time(dims)  # ddl's call pays it, a flat ring does not
    if round_s and nbytes <= FOLD_BYTES:
        # the data rides on the round (one step in the host, one message along the line):
        # no pipeline, and none of the hand-offs the measured overhead is made of
        multidim = pipelined = round_measured or round_s
    else:
        multidim = cost.multidim_time(dims, nbytes) + round_s + call_overhead
        pipelined = cost.pipeline_time(dims, nbytes, chunk_bytes) + round_s + call_overhead
    return {"bytes": int(nbytes), "ranks": world,
            "flat_s": cost.allreduce_time("ring", world, nbytes, slowest),
            "multidim_s": multidim, "pipelined_s": pipelined,
            "algorithms": [a for a, n, _ in dims if n > 1]}


def links_from_spec(text: str) -> list[tuple[str, cost.Link]]:
    """--links: ``name,alpha seconds,bytes/s[,reduce bytes/s]`` per dimension,
    ';'-separated. The optional fourth field is how fast one rank reduces (a GPU's: about
    its memory bandwidth / 3); without it, one CPU core's ``np.add``."""
    out = []
    for spec in text.split(";"):
        try:
            name, alpha, bw, *rest = spec.split(",")
            if len(rest) > 1 or float(alpha) < 0 or float(bw) <= 0:
                raise ValueError
            gamma = {"gamma": 1 / float(rest[0])} if rest else {}
            out.append((name.strip(), cost.Link(alpha=float(alpha), beta=1 / float(bw),
                                                **gamma)))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"--links {spec!r}: want name,alpha_seconds,bytes_per_second"
                             "[,reduce_bytes_per_second] (e.g. net,50e-6,12.5e9)") from None
    return out


def links_from_profile(profile: cost.Profile, ndims: int) -> list[tuple[str, cost.Link]]:
    """Dimension k takes the profile's dimension k (its engine and link); dimensions beyond
    what was measured take the outermost one."""
    by_index = profile.job_dims()
    return [(d.engine, d.link) for d in
            (by_index[min(k, len(by_index) - 1)] for k in range(ndims))]
