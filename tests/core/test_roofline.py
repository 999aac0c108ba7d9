"""The memory roofline of ddl-perf's reports: the bound's arithmetic, the per-host
measurement and its cache, and the agreement of every rank on one figure."""

import json
import platform
from pathlib import Path

import pytest

from ddl.perf import plot, roofline, sizes


def test_traffic_is_every_input_read_and_every_output_written_on_the_busiest_host():
    s = 1 << 20
    assert roofline.traffic_bytes("allreduce", s, 4, 4) == 8 * s
    assert roofline.traffic_bytes("allreduce", s, 4, 4, in_place=True) == 8 * s
    assert roofline.traffic_bytes("alltoall", s, 8, 4) == 8 * s
    assert roofline.traffic_bytes("reduce_scatter", s, 4, 2) == 2 * (s + s / 4)
    assert roofline.traffic_bytes("allgather", s, 4, 2) == 2 * (s / 4 + s)
    assert roofline.traffic_bytes("broadcast", s, 4, 4) == 5 * s
    # in place, what is already where it belongs does not move
    assert roofline.traffic_bytes("allgather", s, 4, 2, in_place=True) == 2 * s
    assert roofline.traffic_bytes("alltoall", s, 2, 2, in_place=True) == 2 * s
    assert roofline.traffic_bytes("broadcast", s, 4, 4, in_place=True) == 4 * s
    assert roofline.traffic_bytes("allreduce", s, 1, 1, in_place=True) == 0
    with pytest.raises(ValueError):
        roofline.traffic_bytes("gather", s, 2, 2)


def test_fraction_is_the_bounds_time_over_the_measured_time():
    bw = roofline.Bandwidth(copy=40.0, add=50.0, ranks_per_host=2, array_bytes=1 << 26,
                            host="h", cached=False)
    assert bw.peak == 50.0
    bound = roofline.bound_seconds(bw, "allreduce", 1 << 24, 2)
    assert bound == pytest.approx(4 * (1 << 24) / 50e9)
    assert roofline.fraction(bw, "allreduce", 1 << 24, 2, 2 * bound) == pytest.approx(0.5)
    assert roofline.fraction(None, "allreduce", 1 << 24, 2, 1.0) is None
    assert roofline.fraction(bw, "allreduce", 1 << 24, 2, 0.0) is None
    assert roofline.fraction(bw, "allreduce", 1 << 24, 1, 1.0, in_place=True) is None


def test_arrays_follow_streams_rule_of_four_times_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(roofline, "llc_bytes", lambda: 32 << 20)
    assert roofline.array_bytes(1) == 128 << 20
    assert roofline.array_bytes(2) == 64 << 20
    assert roofline.array_bytes(64) == roofline.MIN_ARRAY  # never below 32 MiB
    monkeypatch.setattr(roofline, "llc_bytes", lambda: 1 << 30)
    assert roofline.array_bytes(1) == roofline.MAX_ARRAY


class FakeJob:
    """Rank ``rank`` of a job whose other ranks answer each gather with the given lines
    (``others``: one list per gather, its own line put at ``rank``)."""

    def __init__(self, rank: int, hosts: list[str], *others: list[str], missing: int = 0):
        self.rank, self.size = rank, len(hosts)
        self._answers = [hosts, *others]
        self.missing = missing  # ranks elsewhere whose host has no cached figure
        self.barriers = 0

    def barrier(self) -> None:
        self.barriers += 1

    def total(self, value: int) -> int:
        return value + self.missing

    def gather_lines(self, line: str) -> list[str]:
        lines = list(self._answers.pop(0))
        lines[self.rank] = line
        return lines


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(roofline, "array_bytes", lambda per_host: 1 << 20)  # fast
    return tmp_path / "ddl" / "stream.json"


def test_the_last_level_cache_is_read_from_sysfs_whatever_else_the_folder_holds(
        monkeypatch, tmp_path):
    base = tmp_path / "cache"
    for name, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "96M")):
        (base / name).mkdir(parents=True)
        (base / name / "size").write_text(size + "\n")
    (base / "uevent").write_text("")  # listed first on some kernels: not a cache
    real = roofline.os.path.join
    monkeypatch.setattr(roofline.os, "listdir", lambda p: ["uevent", "index2", "index0",
                                                           "index3"])
    monkeypatch.setattr(roofline.os.path, "join", lambda a, *b: real(
        str(base) if a == "/sys/devices/system/cpu/cpu0/cache" else a, *b))
    assert roofline.llc_bytes() == 96 << 20


def test_measured_once_then_read_from_the_hosts_cache(cache):
    me = roofline.host_id()
    job = FakeJob(0, [me], [""], [""])
    first = roofline.host_bandwidth(job, "auto")
    assert not first.cached and first.ranks_per_host == 1 and job.barriers == 2 * roofline.REPS
    assert first.copy > 0 and first.add > 0 and first.host == me
    doc = json.loads(cache.read_text())
    assert list(doc) == [roofline.cache_key(platform.node(), 1)]
    again_job = FakeJob(0, [me], [""])  # no spans gathered: nothing measured
    again = roofline.host_bandwidth(again_job, "auto")
    assert again.cached and (again.copy, again.add) == (first.copy, first.add)
    assert again_job.barriers == 0
    fresh = roofline.host_bandwidth(FakeJob(0, [me], [""], [""]), "fresh")
    assert not fresh.cached
    assert roofline.host_bandwidth(FakeJob(0, [me]), "off") is None


def test_a_broken_cache_is_measured_again(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    me = roofline.host_id()
    assert not roofline.host_bandwidth(FakeJob(0, [me], [""], [""]), "auto").cached
    for bad in ({"copy": -1, "add": "x"}, {"copy": True, "add": 1.0, "array_bytes": 8},
                {"copy": float("inf"), "add": 1.0, "array_bytes": 8}):
        cache.write_text(json.dumps({roofline.cache_key(platform.node(), 1): bad}))
        assert not roofline.host_bandwidth(FakeJob(0, [me], [""], [""]), "auto").cached


def test_every_rank_measures_when_any_host_lacks_its_figure(cache):
    me = roofline.host_id()
    roofline.host_bandwidth(FakeJob(0, [me], [""], [""]), "auto")  # now cached here
    job = FakeJob(0, [me, "other"], ["", "1 2 " * 10], ["", "0.001 0.002 1048576"], missing=1)
    bw = roofline.host_bandwidth(job, "auto")
    assert not bw.cached and job.barriers == 2 * roofline.REPS  # it streamed with the rest
    assert bw.host == "other" and (bw.copy, bw.add) == (0.001, 0.002)  # the slower host


def test_the_jobs_bound_is_the_host_with_the_most_ranks_per_bandwidth(cache):
    me = roofline.host_id()
    # here 1 rank (measured now, 1 MiB arrays: GB/s at least); "b" 2 ranks at 0.004 GB/s,
    # "c" 3 ranks at 0.003 GB/s: c has the most ranks per GB/s
    hosts = [me, "b", "b", "c", "c", "c"]
    figs = ["", *["0.001 0.004 8"] * 2, *["0.002 0.003 8"] * 3]
    bw = roofline.host_bandwidth(FakeJob(0, hosts, [""] * 6, figs, missing=5), "fresh")
    assert (bw.host, bw.ranks_per_host, bw.peak) == ("c", 3, 0.003)


def test_two_machines_of_one_name_are_two_hosts(monkeypatch):
    monkeypatch.setattr(roofline.platform, "node", lambda: "localhost")
    me = roofline.host_id()
    assert me.startswith("localhost")
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    assert me == f"localhost#{boot}"
    monkeypatch.setattr(roofline.platform, "node", lambda: "my host")
    assert " " not in roofline.host_id()


def test_a_hosts_rate_is_its_ranks_bytes_over_the_hosts_span():
    """Two ranks on two cores stream side by side: twice one rank's bytes over the same
    second. Two ranks taking turns on one core: twice the bytes over two seconds. Summing
    each rank's own rate would call both 2 units."""
    mb = 10**9  # 1 GB per rank per kernel: rates read in GB/s
    side = [[(0.0, 1.0)] * 2, [(0.0, 1.0)] * 2]
    turns = [[(0.0, 1.0)] * 2, [(1.0, 2.0)] * 2]
    assert roofline.host_rates(side, mb, reps=1) == pytest.approx((4.0, 6.0))
    assert roofline.host_rates(turns, mb, reps=1) == pytest.approx((2.0, 3.0))
    # the best repetition counts
    two = [[(0.0, 2.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0)]]
    assert roofline.host_rates(two, mb, reps=2) == pytest.approx((2.0, 3.0))


def test_stream_spans_time_every_repetition_after_a_barrier():
    calls = []
    spans = roofline.stream_spans(1 << 16, lambda: calls.append(1), reps=3)
    assert len(spans) == 6 and len(calls) == 6
    assert all(b >= a for a, b in spans)


def test_plot_labels_sizes_in_binary_units_and_draws_the_roofline(tmp_path):
    assert [sizes.size_label(n) for n in (8, 1024, 3 << 19, 1 << 20, 64 << 20, 1 << 30)] == [
        "8 B", "1 KiB", "1.5 MiB", "1 MiB", "64 MiB", "1 GiB"]
    pytest.importorskip("matplotlib")
    rows = [{"engine": "ddl", "ranks": 2, "size": s, "count": s // 4, "type": "float",
             "redop": "sum", "root": -1, "experiment_name": "allreduce",
             "out_of_place": {"time": 10.0, "alg_bw": 1.0, "bus_bw": 1.0 * s / 1024,
                              "nwrong": 0, "roofline": 0.5},
             "in_place": {"time": 10.0, "alg_bw": 1.0, "bus_bw": 1.0, "nwrong": 0,
                          "roofline": None}}
            for s in (1024, 4096)]
    doc = {"version": 2, "tool": "ddl-perf", "collective": "allreduce", "results": rows,
           "memory_bandwidth": {"bound_gbs": 45.0}, "config": {"datatype": "float"},
           "devices": ["#  Rank  0 Group  0 Pid      1 on      node7 device  0 [cpu] x"]}
    assert plot.roofline_series([doc]) == {
        "memory roofline, 2 ranks (45 GB/s per host)": [(1024, 2.0), (4096, 8.0)]}
    assert plot.roofline_series([doc], in_place=True) == {}
    title = plot.collective_title([doc], False)
    assert title.startswith("allreduce, 2 ranks on node7 (float, out of place)")
    path = tmp_path / "p.png"
    plot.render([("collective", doc)], str(path))
    assert path.stat().st_size > 0
