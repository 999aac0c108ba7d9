"""ddl-perf calibrate's fit, the cost model's limits, cost profiles (DDL_COST_PROFILE) and
the simulator's presets: pure code, no processes."""

from __future__ import annotations

import json
import math

import pytest

from ddl import config, cost
from ddl.errors import DDLConfigError
from ddl.perf import calibrate, simulate
from ddl.perf.cli import main
from ddl.perf.presets import PRESETS

SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


@pytest.mark.parametrize("alg,n", [("native", 2), ("shm", 4), ("ring", 8), ("hd", 4)])
def test_fit_recovers_a_known_link_from_synthetic_times(alg, n):
    truth = cost.Link(alpha=37e-6, beta=1 / 0.9e9)
    times = [cost.allreduce_time(alg, n, s, truth) for s in SIZES]
    got = calibrate.fit_link(alg, n, SIZES, times)
    assert got.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert got.beta == pytest.approx(truth.beta, rel=1e-6)


def test_fit_tolerates_noise_and_never_returns_negative_terms():
    truth = cost.Link(alpha=20e-6, beta=1 / 2e9)
    noise = [1.05, 0.95, 1.04, 0.97, 1.03, 0.98]
    times = [cost.allreduce_time("native", 2, s, truth) * k for s, k in zip(SIZES, noise)]
    got = calibrate.fit_link("native", 2, SIZES, times)
    assert got.alpha == pytest.approx(truth.alpha, rel=0.3)
    assert got.beta == pytest.approx(truth.beta, rel=0.1)
    # time falling with size (pure noise): no negative bandwidth cost, only latency
    flat = calibrate.fit_link("native", 2, [1e3, 1e6], [2e-3, 1e-3])
    assert flat.beta == 0.0 and flat.alpha > 0
    with pytest.raises(ValueError, match="two or more"):
        calibrate.fit_link("native", 2, [1e6, 1e6], [1e-3, 1e-3])


def test_fit_profile_makes_one_link_per_dimension():
    links = {0: cost.Link(5e-6, 1 / 4e9), 1: cost.Link(80e-6, 1 / 0.1e9)}
    rows = [{"dim": d, "engine": eng, "size": 2, "algorithm": alg, "bytes": s,
             "seconds": cost.allreduce_time(alg, 2, s, links[d])}
            for d, eng, alg in ((0, "shm", "shm"), (1, "gloo", "native")) for s in SIZES]
    prof = calibrate.fit_profile(rows, "box")
    assert [(d.index, d.engine, d.algorithm) for d in prof.dims] == [
        (0, "shm", "shm"), (1, "gloo", "native")]
    assert prof.dims[1].link.beta == pytest.approx(links[1].beta, rel=1e-6)
    assert "0.0%" in calibrate.format_profile(prof)  # worst fit error on exact data


def test_the_fit_holds_the_measured_reduction_speed():
    """A host that reduces 4x faster than the model's default gamma (one core's np.add at
    3 GB/s) made the shared-memory fit collapse (beta 0, errors of 100-200% on one host):
    calibrate now measures gamma and fits alpha and beta with it."""
    fast = cost.Link(1e-6, 1 / 20e9, gamma=1 / 12e9)
    times = [cost.allreduce_time("shm", 2, s, fast) for s in SIZES]
    got = calibrate.fit_link("shm", 2, SIZES, times, gamma=fast.gamma)
    assert got.alpha == pytest.approx(fast.alpha, rel=1e-6)
    assert got.beta == pytest.approx(fast.beta, rel=1e-6)
    wrong = calibrate.fit_link("shm", 2, SIZES, times)  # the default gamma: too slow
    assert wrong.beta == 0.0
    rows = [{"dim": 0, "engine": "shm", "size": 2, "algorithm": "shm", "bytes": s, "seconds": t}
            for s, t in zip(SIZES, times, strict=True)]
    link = calibrate.fit_profile(rows, "box", fast.gamma).dims[0].link
    assert (link.alpha, link.beta, link.gamma) == pytest.approx((fast.alpha, fast.beta,
                                                                  fast.gamma))
    ticks = iter([0.0, 2e-3, 0.0, 1e-3, 0.0, 3e-3])  # 2 ms, 1 ms, 3 ms
    barriers = []
    g = calibrate.reduce_gamma(lambda: barriers.append(1), nbytes=1 << 20, reps=3,
                               clock=lambda: next(ticks))
    assert g == pytest.approx(1e-3 / (1 << 20)) and len(barriers) == 3  # the best of 3


def test_each_path_of_the_engine_gets_its_own_line():
    """The shared-memory engine runs one step up to 64 KiB, stages through its slots below
    8 MiB and reads its peers' buffers from there: three costs one line cannot follow (one
    host's simulator missed 16 and 64 MiB by a third). With the engine's bounds the fit
    gives each measured path its own alpha and beta, and the model prices each size on its
    path; a path measured at one size goes through it with the whole fit's alpha; one not
    measured at all takes the whole fit's line."""
    paths = [(0, 65537, cost.Link(2e-6, 1 / 9e9)), (65537, 8 << 20, cost.Link(4e-6, 1 / 50e9)),
             (8 << 20, math.inf, cost.Link(2e-6, 1 / 8e9))]
    sizes = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]

    def truth(s):
        link = next(lk for lo, hi, lk in paths if lo <= s < hi)
        return cost.allreduce_time("shm", 2, s, link)

    times = [truth(s) for s in sizes]
    bounds = (65537, 8 << 20)
    got = calibrate.fit_link("shm", 2, sizes, times, bounds=bounds)
    assert [(lo, hi) for lo, hi, *_ in got.regimes] == [(lo, hi) for lo, hi, _ in paths]
    for (_, _, alpha, beta, _), (_, _, lk) in zip(got.regimes, paths, strict=True):
        assert (alpha, beta) == pytest.approx((lk.alpha, lk.beta), rel=1e-6)
    for s in sizes + [3 << 10, 2 << 20, 256 << 20]:  # between and beyond the measured sizes
        assert cost.allreduce_time("shm", 2, s, got) == pytest.approx(truth(s), rel=1e-6)
    one_line = calibrate.fit_link("shm", 2, sizes, times)
    assert not one_line.regimes
    assert max(abs(cost.allreduce_time("shm", 2, s, one_line) / t - 1)
               for s, t in zip(sizes, times, strict=True)) > 0.25  # what the paths fix
    # 16 MiB the only size from 8 MiB: through it, with the whole fit's alpha
    cut = calibrate.fit_link("shm", 2, sizes[:-1], times[:-1], bounds=bounds)
    lo, hi, alpha, beta, _ = cut.regimes[-1]
    assert (lo, hi, alpha) == (8 << 20, math.inf, cut.alpha)
    assert cost.allreduce_time("shm", 2, 16 << 20, cut) == pytest.approx(truth(16 << 20))
    # nothing below 64 KiB measured: those sizes take the whole line
    upper = calibrate.fit_link("shm", 2, sizes[2:], times[2:], bounds=bounds)
    assert [r[0] for r in upper.regimes] == [65537, 8 << 20]
    assert upper.at(1024) is upper
    assert cost.allreduce_time("shm", 2, 1024, upper) == pytest.approx(
        cost.allreduce_time("shm", 2, 1024, cost.Link(upper.alpha, upper.beta, upper.gamma)))
    # the profile keeps them (JSON has no infinity: the open end is null) and says them
    rows = [{"dim": 0, "engine": "shm", "size": 2, "algorithm": "shm", "bytes": s,
             "seconds": t} for s, t in zip(sizes, times, strict=True)]
    prof = calibrate.fit_profile(rows, "box", bounds={0: bounds})
    assert prof.dims[0].link == got
    text = json.dumps(prof.to_json(), allow_nan=False)
    assert cost.profile_from_json(json.loads(text), "doc") == prof
    report = calibrate.format_profile(prof)
    assert "<= 64 KiB:" in report and "> 64 KiB, < 8 MiB:" in report and ">= 8 MiB:" in report
    assert "0.0%" in report  # every size on its own path's line
    assert calibrate.shm_bounds(object()) == ()  # not the shared-memory engine: one line
    # in the caches the reduction outruns np.add measured from memory: that path's slope
    # is all reduction (its own gamma, beta 0), not all latency (a flat line)
    cached = cost.Link(5e-6, 0.0, gamma=1 / 40e9)
    mid = [256 << 10, 1 << 20, 4 << 20]
    fast = calibrate.fit_link("shm", 2, mid, [cost.allreduce_time("shm", 2, s, cached)
                                              for s in mid], gamma=1 / 12e9, bounds=bounds)
    assert fast.regimes[0][2:] == pytest.approx((cached.alpha, 0.0, cached.gamma))
    # one size on that path: through it all the same (its own gamma, the whole alpha)
    alone = calibrate.fit_link("shm", 2, [16 << 10, 1 << 20, 64 << 20],
                               [cost.allreduce_time("shm", 2, s, lk) for s, lk in
                                ((16 << 10, cost.Link(3e-6, 1 / 9e9)), (1 << 20, cached),
                                 (64 << 20, cost.Link(3e-6, 1 / 8e9)))],
                               gamma=1 / 12e9, bounds=bounds)
    assert cost.allreduce_time("shm", 2, 1 << 20, alone) == pytest.approx(
        cost.allreduce_time("shm", 2, 1 << 20, cached))
    # bounds that are no sizes are dropped, not written into a profile it would refuse
    assert calibrate.fit_link("shm", 2, sizes, times, bounds=(0, -5)) == one_line
    # the cache's edge: 2 x ranks x size past the last-level cache, as a power of two
    assert calibrate.cache_edge(2, 32 << 20) == 8 << 20
    assert calibrate.cache_edge(4, 32 << 20) == 4 << 20
    assert calibrate.cache_edge(3, 36 << 20) == 4 << 20  # 6 MiB, rounded down
    assert calibrate.cache_edge(1024, 1 << 10) == 1  # never below a byte


@pytest.mark.parametrize("regimes,why", [
    ({"from_bytes": 0}, "must be a list"),
    ([{"from_bytes": 0, "to_bytes": 10}], "each needs from_bytes"),
    ([{"from_bytes": 10, "to_bytes": 10, "alpha_s": 0, "beta_s_per_byte": 0}], "from_bytes <"),
    ([{"from_bytes": 0, "to_bytes": 10, "alpha_s": -1, "beta_s_per_byte": 0}], "from_bytes <"),
    ([{"from_bytes": 0, "to_bytes": 10, "alpha_s": 0, "beta_s_per_byte": 0,
       "gamma_s_per_byte": float("inf")}], "gamma finite"),
    ([{"from_bytes": 0, "to_bytes": None, "alpha_s": 0, "beta_s_per_byte": 0},
      {"from_bytes": 5, "to_bytes": 10, "alpha_s": 0, "beta_s_per_byte": 0}], "overlap")])
def test_a_profile_with_bad_regimes_is_refused(regimes, why):
    doc = {"version": 1, "dims": [{"engine": "shm", "size": 2, "alpha_s": 1e-6,
                                   "beta_s_per_byte": 1e-10, "regimes": regimes}]}
    with pytest.raises(DDLConfigError, match=why) as err:
        cost.profile_from_json(doc, "doc")
    assert "DDLConfigError(" not in str(err.value)  # its own message, not wrapped in another


@pytest.mark.parametrize("alg", ["ring", "hd", "native", "shm"])
def test_one_rank_communicates_nothing(alg):
    assert cost.allreduce_time(alg, 1, 1 << 30, cost.NETWORK) == 0.0
    assert cost.pipeline_time([("shm", 1, cost.SHARED_MEMORY), (alg, 1, cost.NETWORK)],
                              1 << 30, 8 << 20) == 0.0


def test_huge_rank_counts_stay_finite_and_grow():
    times = [cost.allreduce_time("ring", n, 100e6, cost.NETWORK) for n in
             (2, 16, 256, 4096, 65536, 1 << 20)]
    assert all(math.isfinite(t) for t in times)
    assert times == sorted(times) and times[-1] > times[0]
    hd = [cost.allreduce_time("hd", 1 << k, 1e6, cost.NETWORK) for k in (1, 10, 20)]
    assert hd == sorted(hd) and math.isfinite(hd[-1])
    # the bandwidth term of a ring is bounded by 2 x size x beta however many ranks
    no_latency = cost.Link(alpha=0.0, beta=1e-9, gamma=0.0)
    assert cost.allreduce_time("ring", 1 << 20, 1e6, no_latency) < 2e6 * 1e-9


def test_zero_latency_and_zero_bandwidth_cost():
    pure_bw = cost.Link(alpha=0.0, beta=1e-9, gamma=0.0)
    assert cost.allreduce_time("ring", 4, 0, pure_bw) == 0.0
    assert cost.allreduce_time("ring", 4, 1e6, pure_bw) == pytest.approx(2 * 3 / 4 * 1e6 * 1e-9)
    pure_lat = cost.Link(alpha=1e-5, beta=0.0, gamma=0.0)
    assert cost.allreduce_time("ring", 4, 1e9, pure_lat) == pytest.approx(6e-5)
    assert cost.allreduce_time("hd", 4, 1e9, pure_lat) == pytest.approx(4e-5)
    # zero latency: hd and ring cost the same, and the tie is broken by name, stably
    assert cost.allreduce_time("hd", 8, 1e6, pure_bw) == cost.allreduce_time(
        "ring", 8, 1e6, pure_bw)
    assert cost.best(["ring", "hd"], 8, 1e6, pure_bw) == "hd"
    # zero bandwidth cost: only steps count, and hd takes log2(n) of them
    assert cost.best(["ring", "hd"], 8, 1e9, pure_lat) == "hd"


def test_pipeline_matches_the_schedule_bounds():
    dims = [("shm", 2, cost.Link(0, 1 / 2e9, 0)), ("native", 2, cost.Link(0, 1 / 0.1e9, 0))]
    nbytes = 64 << 20
    serial = cost.multidim_time(dims, nbytes)
    piped = cost.pipeline_time(dims, nbytes, 8 << 20)
    slow_stage = cost.allreduce_time("native", 2, nbytes / 2, dims[1][2])
    assert slow_stage < piped < serial  # overlap, but never faster than the slow link
    # one chunk: nothing overlaps
    assert cost.pipeline_time(dims, 1 << 20, 8 << 20) == pytest.approx(
        cost.multidim_time(dims, 1 << 20))


def _profile_doc():
    return {"version": 1, "machine": "m", "dims": [
        {"engine": "shm", "size": 2, "alpha_s": 1e-5, "beta_s_per_byte": 2e-10},
        {"engine": "gloo", "size": 2, "alpha_s": 1e-4, "beta_s_per_byte": 8e-9}],
        "measured": []}


def test_the_identity_round_is_priced_where_a_call_crosses_hosts():
    """ddl's call across hosts checks its identity first (engines/identity_round.py): one
    shared-memory step, then one fixed-size row per host along the line; on any other grid
    rows from every rank over the slowest link; one host pays nothing."""
    from ddl.engines.identity_round import ROW_BYTES

    shm, net = cost.Link(alpha=1e-4, beta=1e-10), cost.Link(alpha=1e-3, beta=1e-8)
    assert cost.identity_round_time([("shm", 4, shm)]) == 0.0
    assert cost.identity_round_time([("shm", 2, shm), ("ring", 3, net)]) == pytest.approx(
        1e-4 + 2 * (1e-3 + ROW_BYTES * 1e-8))
    assert cost.identity_round_time([("ring", 1, shm), ("ring", 2, net)]) == pytest.approx(
        1e-3 + ROW_BYTES * 1e-8)
    # the host's ranks, then two dimensions across hosts: one row per host (4 hosts)
    three = [("shm", 2, shm), ("ring", 2, net), ("ring", 2, net)]
    assert cost.identity_round_time(three) == pytest.approx(1e-4 + 3 * (1e-3 + ROW_BYTES * 1e-8))
    # two dimensions inside a host: rows from every rank (8) over the slowest link
    two_inside = [("shm", 2, shm), ("shm", 2, shm), ("ring", 2, net)]
    assert cost.identity_round_time(two_inside) == pytest.approx(7 * (1e-3 + ROW_BYTES * 1e-8))
    links = [("shm", shm), ("net", net)]
    row = simulate.allreduce_row([2, 3], links, 1 << 20, 1 << 18)
    dims = simulate.plan_dims([2, 3], links, 1 << 20)
    assert row["pipelined_s"] == pytest.approx(cost.pipeline_time(dims, 1 << 20, 1 << 18)
                                               + cost.identity_round_time(dims))
    # up to 8 KiB the data rides on the round: the round is the whole call
    small = simulate.allreduce_row([2, 3], links, 4096, 1 << 18, call_overhead=1.0)
    assert small["pipelined_s"] == small["multidim_s"] == pytest.approx(
        cost.identity_round_time(simulate.plan_dims([2, 3], links, 4096)))


def test_calibrate_finds_the_per_call_overhead_and_simulate_adds_it(tmp_path, capsys):
    """Whole calls timed by calibrate, less the model's price for them on the fitted links
    (pipeline and identity round): the median is the profile's call_overhead_s, never below
    0; simulate adds it to ddl's calls on the grid it was measured on, and only there."""
    prof = cost.profile_from_json(_profile_doc(), "doc")
    dims = [(d.algorithm, d.size, d.link) for d in prof.dims]

    class Engine:
        class multidim:
            chunk_bytes = 8 << 20

    def whole(extra):
        return [{"dim": "call", "bytes": b, "seconds": cost.pipeline_time(dims, b, 8 << 20)
                 + cost.identity_round_time(dims) + e} for b, e in zip([16384, 65536, 262144],
                                                                        extra, strict=True)]

    got = calibrate.with_call_overhead(prof, whole([3e-3, 5e-3, 40e-3]), Engine)
    assert got.call_overhead_s == pytest.approx(5e-3)  # the median: one slow call moves nothing
    assert "per call beyond the dimensions and the identity round: 5000 us (whole calls of "\
        "16 KiB to 256 KiB)" in calibrate.format_profile(got)
    assert calibrate.with_call_overhead(prof, whole([-1e-4] * 3), Engine).call_overhead_s == 0
    path = tmp_path / "p.json"
    cost.save_profile(got, str(path))
    assert cost.load_profile(str(path)) == got
    for grid, added in (("2x2", 5.0), ("2x4", 0.0)):
        assert main(["simulate", "--profile", str(path), "--grid", grid, "--sizes", "1M",
                     "--json", str(tmp_path / "r.json")]) == 0
        row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
        sizes = [int(x) for x in grid.split("x")]
        links = simulate.links_from_profile(got, 2)
        bare = simulate.allreduce_row(sizes, links, 1 << 20, config.get("DDL_CHUNK_BYTES"))
        assert (row["pipelined_s"] - bare["pipelined_s"]) * 1e3 == pytest.approx(added)
    capsys.readouterr()
    doc = got.to_json()
    for bad in (-1, True, "1", float("nan")):
        doc["call_overhead_s"] = bad
        with pytest.raises(DDLConfigError, match="call_overhead_s"):
            cost.profile_from_json(doc, "doc")
    doc["call_overhead_s"] = None  # as absent
    assert cost.profile_from_json(doc, "doc").call_overhead_s == 0.0


def test_a_call_that_rides_on_the_round_is_priced_as_calibrate_measured_it(tmp_path):
    """Up to 8 KiB the data travels in the identity round's rows: calibrate times a 1 KiB
    call (Profile.round_s, the median), and the simulator prices every riding call at that
    instead of at the round's price on links fitted from 16 KiB-16 MiB (which missed the
    2 x 2 netns cluster's 1 KiB call by 57%)."""
    prof = cost.profile_from_json(_profile_doc(), "doc")
    dims = [(d.algorithm, d.size, d.link) for d in prof.dims]

    class Engine:
        class multidim:
            chunk_bytes = 8 << 20

    rows = [{"dim": "call", "bytes": calibrate.RIDE_BYTES, "seconds": t}
            for t in (1.7e-3, 1.6e-3, 9e-3)]
    rows += [{"dim": "call", "bytes": 16384, "seconds": cost.pipeline_time(dims, 16384, 8 << 20)
              + cost.identity_round_time(dims) + 2e-3}]
    got = calibrate.with_call_overhead(prof, rows, Engine)
    assert got.round_s == pytest.approx(1.7e-3)  # the median of the riding calls
    assert got.call_overhead_s == pytest.approx(2e-3)  # from the others only
    assert "rides on the identity round: 1700 us" in calibrate.format_profile(got)
    path = tmp_path / "p.json"
    cost.save_profile(got, str(path))
    assert cost.load_profile(str(path)).round_s == pytest.approx(1.7e-3)
    links = simulate.links_from_profile(got, 2)
    for nbytes in (8, 1024, 8192):
        row = simulate.allreduce_row([2, 2], links, nbytes, 8 << 20, got.call_overhead_s,
                                     got.round_s)
        assert row["pipelined_s"] == pytest.approx(1.7e-3)
    big = simulate.allreduce_row([2, 2], links, 16384, 8 << 20, got.call_overhead_s,
                                 got.round_s)
    assert big["pipelined_s"] > 2e-3  # priced from the links, plus call_overhead_s
    doc = got.to_json()
    for bad in (-1, "x", float("inf")):
        with pytest.raises(DDLConfigError, match="round_s"):
            cost.profile_from_json(dict(doc, round_s=bad), "doc")
    assert cost.profile_from_json(dict(doc, round_s=None), "doc").round_s == 0.0


def test_profile_round_trip_and_env_lookup(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile_doc()))
    prof = cost.load_profile(str(path))
    again = tmp_path / "q.json"
    cost.save_profile(prof, str(again))
    assert cost.load_profile(str(again)) == prof
    monkeypatch.setenv("DDL_COST_PROFILE", str(again))
    assert config.get("DDL_COST_PROFILE") == str(again)
    assert cost.link_for(1, "gloo").beta == 8e-9
    assert cost.link_for(2, "gloo").beta == 8e-9  # an outer dimension never measured
    assert cost.link_for(1, "mpi") == cost.NETWORK  # an engine never measured: default
    monkeypatch.delenv("DDL_COST_PROFILE")
    assert cost.link_for(1, "gloo") == cost.NETWORK


@pytest.mark.parametrize("text,why", [
    ("not json", "not JSON"), ('{"version": 2, "dims": []}', "version"),
    ('{"version": 1, "dims": []}', "non-empty"),
    ('{"version": 1, "dims": [{"engine": "gloo", "size": 2}]}', "dims\\[0\\]"),
    ('{"version": 1, "dims": [{"engine": "gloo", "size": 2, "alpha_s": -1, '
     '"beta_s_per_byte": 0}]}', ">= 0")])
def test_a_bad_profile_names_the_path(tmp_path, text, why):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(DDLConfigError, match=why) as err:
        cost.load_profile(str(path))
    assert str(path) in str(err.value)
    with pytest.raises(DDLConfigError, match="cannot read"):
        cost.load_profile(str(tmp_path / "missing.json"))


def test_simulate_reads_the_profile_and_reports_a_bad_one(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile_doc()))
    assert main(["simulate", "--profile", str(path), "--grid", "2x2", "--sizes", "16M"]) == 0
    out = capsys.readouterr().out
    assert f"profile {path}" in out and "shm,native" in out
    path.write_text("{")
    assert main(["simulate", "--profile", str(path), "--grid", "2x2"]) == 2
    assert str(path) in capsys.readouterr().err


def test_mode_b_plans_from_the_profile(tmp_path, monkeypatch):
    from ddl.algorithms.dims import GroupDim

    doc = _profile_doc()
    doc["dims"][1]["alpha_s"] = 1.0  # a link where every step costs a second
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("DDL_COST_PROFILE", str(path))

    class Group:
        size, rank, name = 8, 0, "d1l0"

    slow = GroupDim(Group(), 1, "b", cost.link_for(1, "gloo"))
    assert slow.choose(64 << 20) == "hd"  # latency-bound: log2(8) steps beat 7
    assert GroupDim(Group(), 1, "b").choose(64 << 20) == "native"


def test_a_sub_group_across_hosts_plans_on_the_profiles_outermost_link(tmp_path, monkeypatch):
    from ddl.groups import GroupMaker

    doc = _profile_doc()
    doc["dims"].append({"index": 2, "engine": "gloo", "size": 2, "alpha_s": 1.0,
                        "beta_s_per_byte": 3e-8})  # the rack level: the slowest
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("DDL_COST_PROFILE", str(path))
    assert cost.link_for(None, "gloo") == cost.Link(1.0, 3e-8)

    class Net:
        size, rank, name = 8, 0, "gloo"

    maker = GroupMaker(None, None, None, timeout=5.0, chunk_bytes=1 << 20, shm_kwargs={})
    dim = maker._network(Net(), 0, 8).multidim.dims[0]
    assert dim.link == cost.Link(1.0, 3e-8)
    assert dim.choose(64 << 20) == "hd"  # the latency-bound plan the measured link asks for
    monkeypatch.delenv("DDL_COST_PROFILE")
    assert maker._network(Net(), 0, 8).multidim.dims[0].link == cost.NETWORK


def test_presets_have_a_row_per_gpu_count_and_their_published_figure():
    for name, c in PRESETS.items():
        counts = simulate.gpu_counts(c)
        assert counts[0] == 1 and counts[-1] >= 10_000
        weak = [simulate.step(c, n, strong=False) for n in counts]
        strong = [simulate.step(c, n, strong=True) for n in counts]
        assert weak[0].efficiency == pytest.approx(1.0)
        assert all(0 < p.efficiency <= 1.0 + 1e-9 for p in weak + strong), name
        # beyond the batch cap strong scaling shrinks each GPU's batch, and efficiency
        assert strong[-1].batch_per_gpu < c.batch_per_gpu
        assert strong[-1].efficiency < weak[-1].efficiency
    assert PRESETS["powerai-2017"].published.efficiency == 0.95
    assert PRESETS["goyal-2017"].published.efficiency == 0.89


def test_simulate_preset_prints_the_published_number(capsys):
    assert main(["simulate", "--preset", "powerai-2017", "--scaling", "weak"]) == 0
    out = capsys.readouterr().out
    assert "published 95%" in out and "10240" in out
    assert main(["simulate", "--preset", "goyal-2017"]) == 0
    out = capsys.readouterr().out
    assert "against 8 GPUs" in out and "published 89%" in out and "strong" in out


def test_calibrate_times_calls_back_to_back_the_same_count_on_every_rank():
    # a link that is fast for a lone call (a token bucket's burst) and slower sustained:
    # the sustained cost is what back-to-back collectives see, and what is measured
    now = [0.0]
    state = {"since_barrier": 0, "agreed": []}

    def barrier():
        state["since_barrier"] = 0
        now[0] += 1.0  # the bucket refills while the ranks meet

    def run(buf):
        state["since_barrier"] += 1
        now[0] += 0.001 if state["since_barrier"] == 1 else 0.004

    def agree(t):
        state["agreed"].append(t)
        return 0.002  # another rank was slower: its count is the one used

    target = calibrate.Target(1, "gloo", 2, "native", run)
    rows = calibrate.measure(target, [4096, 8192], 3, barrier, agree, clock=lambda: now[0],
                             min_seconds=0.1)
    assert state["agreed"] == pytest.approx([0.001, 0.001])  # each size's first timed call, agreed
    # 0.1 s / 0.002 s = 50 calls per repetition: one burst call, 49 sustained
    assert [b for b, _ in rows] == [4096, 8192]
    for _, t in rows:
        assert t == pytest.approx((0.001 + 49 * 0.004) / 50)


def _scaling_json(tmp_path, *flags: str) -> dict:
    path = tmp_path / "s.json"
    assert main(["simulate", "--scaling", "both", "--json", str(path), *flags]) == 0
    return json.loads(path.read_text())


def test_simulate_describes_a_cluster_and_a_model_of_ones_own(tmp_path, capsys):
    """Every figure of the training model comes from a flag when given: the grid, the links
    per dimension, the GPU's compute, the model's size and FLOPs; the preset's paper is
    then not printed as if it were this cluster's."""
    base = _scaling_json(tmp_path, "--preset", "powerai-2017")
    assert base["published"]["efficiency"] == 0.95
    doc = _scaling_json(tmp_path, "--grid", "8x32x4", "--links",
                        "nvlink,2e-6,450e9,1.1e12;ib,5e-6,50e9,1.1e12", "--peak-tflops",
                        "989", "--utilization", "0.4", "--params", "124M", "--grad-bytes",
                        "2", "--flops-per-sample", "1.5T", "--batch", "16", "--overlap",
                        "0.8", "--global-batch", "4096")
    out = capsys.readouterr().out
    assert doc["published"] is None and "published" not in out.split("custom cluster")[-1]
    assert "custom cluster (from powerai-2017: --grid 8x32x4" in doc["cluster"]
    assert "gradient 248.0 MB, 395.6 TFLOP/s achieved per GPU" in out
    weak = {p["gpus"]: p for p in doc["series"]["weak"]}
    assert weak[8]["grid"] == [8] and weak[256]["grid"] == [8, 32]
    assert weak[1024]["grid"] == [8, 32, 4]
    # compute per step: 1.5 TFLOP x 16 / (989 T x 0.4)
    assert weak[1]["compute_s"] == pytest.approx(1.5e12 * 16 / (989e12 * 0.4))
    # the allreduce is the cost model's on these links, for 124 M bf16 gradients
    c = PRESETS["powerai-2017"].with_(
        gpus_per_host=8, hosts_per_rack=32, racks=4, params=124_000_000, bytes_per_grad=2,
        links=(cost.Link(2e-6, 1 / 450e9, 1 / 1.1e12),) + (cost.Link(5e-6, 1 / 50e9,
                                                                     1 / 1.1e12),) * 2,
        algorithms=("best",) * 3)
    assert weak[1024]["comm_s"] == pytest.approx(simulate.comm_time(c, (8, 32, 4)))
    # strong scaling ends where a GPU would get less than one sample
    assert [p["gpus"] for p in doc["series"]["strong"]][-1] == 4096
    assert doc["series"]["strong"][-1]["batch_per_gpu"] == 1
    assert "strong scaling stops at 4096 GPUs" in out


def test_simulate_refuses_flags_it_would_ignore(tmp_path, capsys):
    assert main(["simulate", "--params", "25M"]) == 2
    assert "--params describes training scaling" in capsys.readouterr().err
    assert main(["simulate", "--preset", "goyal-2017", "--sizes", "1M"]) == 2
    assert "--sizes is for allreduce time" in capsys.readouterr().err
    assert main(["simulate", "--scaling", "weak", "--grid", "4x0"]) == 2
    assert "--grid '4x0'" in capsys.readouterr().err
    assert main(["simulate", "--scaling", "weak", "--grid", "4x2x2x2"]) == 2  # hosts, racks
    assert main(["simulate", "--grid", "4x2x2x2", "--sizes", "1M"]) == 0  # aisles: allreduce
    capsys.readouterr()
    assert main(["simulate", "--scaling", "weak", "--overlap", "1.5"]) == 2
    assert main(["simulate", "--grid", "2x2", "--links", "net,1e-6"]) == 2
    assert "want name,alpha_seconds,bytes_per_second" in capsys.readouterr().err


def test_simulate_plots_in_both_modes(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["simulate", "--grid", "2x2", "--sizes", "1M,16M", "--plot",
                 str(tmp_path / "a.svg")]) == 0
    assert "allreduce, grid 2x2: predicted (lines)" in (tmp_path / "a.svg").read_text()
    assert main(["simulate", "--preset", "goyal-2017", "--plot", str(tmp_path / "s.svg")]) == 0
    svg = (tmp_path / "s.svg").read_text()
    assert "predicted: DDL multi-dim, strong" in svg and "Goyal et al." in svg


def test_plot_draws_a_sim_validation_file(tmp_path, capsys):
    """benchmarks/sim_validation.py --json: per grid the prediction as a line and the
    measurement as markers, in the panel of its own kind."""
    pytest.importorskip("matplotlib")
    rows = [{"bytes": b, "measured_s": t, "predicted_s": t * 1.1, "error": 0.1,
             "round_errors": [0.1]} for b, t in ((1024, 5e-6), (1 << 20, 6e-5))]
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"kind": "sim-validation", "grid": "4x2", "hosts": 2,
                                "per_host": 4, "rows": rows}))
    from ddl.perf import plot

    assert plot.load(str(path))[0] == plot.VALIDATION
    assert main(["plot", str(path), "-o", str(tmp_path / "v.svg")]) == 0
    svg = (tmp_path / "v.svg").read_text()
    assert "2 hosts x 4 ranks: predicted" in svg and "2 hosts x 4 ranks: measured" in svg
    assert "simulator validation" in svg
    capsys.readouterr()
