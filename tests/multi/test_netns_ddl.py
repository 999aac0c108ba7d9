"""The ddl library across real "hosts": network namespaces with their own hostnames and
sshd, started through ddlrun's ssh backend. Dimension 0 (ranks in a host) runs on shared
memory, dimension 1 on Gloo over the namespaces' network."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "launcher"))
from netns_cluster import Cluster, unavailable  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.slow]
pytest.importorskip("torch")
WORKER = os.path.join(HERE, "..", "core", "workers", "collectives.py")
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(f"multi-host tests need network namespaces and sshd: {why}")
    c = Cluster(tmp_path_factory.mktemp("ddlcluster"), nhosts=3)
    try:
        yield c.start()
    finally:
        c.close()


def _run(cluster, nhosts, *opts, timeout=300):
    job = f"mh{nhosts}x{os.getpid()}"
    argv = cluster.in_launcher([
        sys.executable, "-m", "ddlrun", *cluster.ddlrun_opts(), "-H", cluster.hosts(nhosts),
        "--job-id", job, *opts, "-x", "CHECK_DTYPES=int8,float16,float64,complex64",
        "-x", "DDL_CHUNK_BYTES=64K", sys.executable, WORKER, "0,3,1000,70001"])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    reports = [json.loads(m.group(1)) for m in re.finditer(r"^\[\d+\] (\{.*\})$", res.stdout,
                                                           re.M)]
    assert len(reports) == 2 * nhosts, res.stdout
    assert len({r["digest"] for r in reports}) == 1, "ranks got different bytes"
    assert not [n for n in os.listdir("/dev/shm") if job in n]
    return res


@pytest.mark.parametrize("nhosts,mode", [(2, "b"), (3, "r")])
def test_multidimensional_allreduce_across_hosts(cluster, nhosts, mode):
    _run(cluster, nhosts, "--mode", mode)


def test_flat_ring_across_hosts(cluster):
    _run(cluster, 2, "--no_ddloptions")


IDENTITY = os.path.join(HERE, "..", "core", "workers", "identity_fold.py")


@pytest.mark.parametrize("scenario,slots", [("calls", 2), ("mismatch", 1)])
def test_horovod_calls_carry_their_identity_across_hosts(cluster, scenario, slots):
    """Horovod-level calls over the namespaces' network: every identity rides on its call's
    first message across hosts (no exchange of its own), and calls that differ between the
    hosts raise on every rank (engines/identity_round.py)."""
    job = f"id{scenario}{os.getpid()}"
    argv = cluster.in_launcher([
        sys.executable, "-m", "ddlrun", *cluster.ddlrun_opts(), "-H", cluster.hosts(2, slots),
        "--job-id", job, sys.executable, IDENTITY, scenario])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    reports = [json.loads(m.group(1)) for m in re.finditer(r"^\[\d+\] (\{.*\})$", res.stdout,
                                                           re.M)]
    assert len(reports) == 2 * slots, res.stdout
    for r in reports:
        assert r["engine"] == "ddl/gloo", r
        if scenario == "calls":
            assert r["wrong"] == [] and r["separate"] == 0, r
        else:
            assert r["numel"]["type"] == r["kind"]["type"] == "DDLMismatchError", r
            assert "float32[512]" in r["numel"]["text"], r
            assert r["after_ok"] and r["separate_after"] == 0, r
