"""One ddlrun per node across hosts for real (torchrun's elastic shape): each node's ddlrun
runs in a network namespace of its own, the first one serving the rendezvous on its
address. A node is lost with its ddlrun (SIGKILL to its group, as when a host dies): the
other two tell it lost by its heartbeat and go on as a job of 4 ranks after one restart,
with exact results (the worker
checks every allreduce against the world size). Skipped only where namespaces cannot be
made."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from netns_cluster import IFACE, Cluster, unavailable
from test_node_elastic import Node, assert_clean

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(f"multi-host tests need network namespaces and sshd: {why}")
    c = Cluster(tmp_path_factory.mktemp("cluster"), nhosts=3)
    try:
        yield c.start()
    finally:
        c.close()


def test_a_lost_node_leaves_the_job_to_the_nodes_on_other_hosts(cluster, marker):
    job = f"nh_{marker[-8:]}"
    host0 = cluster.addrs[0]

    def node(i: int) -> Node:
        return Node(job, 29411, marker, "2:3", 1, host=host0,
                    prefix=("ip", "netns", "exec", cluster.host_ns[i]),
                    extra=("--network-interface", IFACE), STEPS="100",
                    SLOW="0.1")

    a = node(0)
    time.sleep(0.5)  # the first one serves the rendezvous, on its host's address
    b, c = node(1), node(2)
    for n in (a, b, c):
        n.wait_for("round 0: 3 node(s)", others=(a, b, c))
        n.wait_ready()
    os.killpg(c.proc.pid, signal.SIGKILL)
    c.proc.wait(10)
    assert (a.wait(200), b.wait(200)) == (0, 0), a.err + b.err
    assert a.done() + b.done() == [f"done rank {r} of 4 restart 1 run {job} max 1"
                                   for r in range(4)]
    assert f"rendezvous: serving {host0}:29411" in a.err
    assert "round 1: 2 node(s)" in a.err and "round 1: 2 node(s)" in b.err
    # told from a slow node by its heartbeat, not by waiting FOLLOW seconds for its report
    assert re.search(rf"node\(s\) \S+:{c.proc.pid} of round 0 stopped beating for 2 s",
                     a.err + b.err), a.err + b.err
    assert_clean(job, marker, 1)
