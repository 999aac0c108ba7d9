"""The simulator against reality (issue 12): calibrate on two network-namespace hosts with
1 Gbit/s tc-limited links, measure ddl's multi-dimensional allreduce (mode b planned from
the profile) and compare with ``ddl-perf simulate``'s prediction size by size
(benchmarks/sim_validation.py; the full tables are in docs/performance.md)."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "launcher"))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from netns_cluster import Cluster, unavailable  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.slow]
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(f"multi-host tests need network namespaces and sshd: {why}")
    from multihost_allreduce import limit

    c = Cluster(tmp_path_factory.mktemp("simcluster"), nhosts=2)
    try:
        c.start()
        limit(c, 2, "1gbit", None)
        yield c
    finally:
        c.close()


def test_simulator_predicts_2x2_allreduce_within_25_percent(cluster, tmp_path):
    from sim_validation import validate

    # calibrate as a user runs it: its default sizes, 16 KiB to 16 MiB
    profile, rows = validate(cluster, tmp_path, nhosts=2, per=2, sizes="1M,4M,16M",
                             iters=3, timeout=300)
    assert [(d.engine, d.size) for d in profile.dims] == [("shm", 2), ("gloo", 2)]
    # the link is what tc made it: 1 Gbit/s shared by the two lines of dimension 1
    assert 0.05e9 < 1 / profile.dims[1].link.beta < 0.15e9
    by_size = {r["bytes"]: r for r in rows}
    assert sorted(by_size) == [1 << 20, 4 << 20, 16 << 20] and all(r["correct"] for r in rows)
    # the target, where the model's link terms dominate
    for size in (4 << 20, 16 << 20):
        assert abs(by_size[size]["error"]) <= 0.25, rows
    # 1 MiB is one pipeline chunk, where a per-call floor the model does not price (the
    # hand-offs between the dimensions' threads and processes, each waiting for one of
    # 2 cores) weighs most: -2.6% to -21.5% in the runs of docs/performance.md, -25.4% in
    # one CI run. This bound says how far it may miss, without a fudge factor in the model
    assert -0.40 <= by_size[1 << 20]["error"] <= 0.25, rows
