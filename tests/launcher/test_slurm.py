"""Slurm for real: Debian's slurm-wlm (slurmctld + one slurmd per node, munge) on network
namespaces with their own hostnames (``slurm_cluster.SlurmCluster``). ddl jobs run across
the nodes through ``salloc ... ddlrun``, ``sbatch``, plain ``srun`` and ``srun --mpi=pmix``.

The unit tests at the end (ddl reading Slurm's step variables) need no cluster.
"""

from __future__ import annotations

import io
import json
import os
import re
import time

import pytest
from ddlrun_testlib import PY, REPO, wait_gone
from slurm_cluster import SlurmCluster, unavailable

from ddl import topology
from ddlrun.backends import Backend, LaunchOptions
from ddlrun.backends.slurm import SlurmBackend, task_failure
from ddlrun.events import JobExit
from ddlrun.hosts import HostSpec
from ddlrun.output import OutputSink
from ddlrun.plan import Request, make_plan
from ddlrun.run import supervise


def cluster_test(fn):
    """A test on the Slurm cluster: slow, and needs slurm-wlm, munge and namespaces."""
    return pytest.mark.slow(pytest.mark.slurm(pytest.mark.netns(fn)))


# The job: every rank contributes rank + 1 to an allreduce and prints, as one JSON line,
# who it is (ddl's view), where it ran and which Slurm variables it saw. "fail R CODE":
# rank R exits with CODE while the others sleep.
JOB = '''\
import json, os, socket, sys, time

if sys.argv[1:2] == ["fail"]:  # no ddl: the step's teardown is what is tested
    r = int(os.environ["RANK"])
    if r == int(sys.argv[2]):
        time.sleep(1.0)
        print(f"rank {r} fails now", flush=True)
        sys.exit(int(sys.argv[3]))
    print(f"rank {r} waits", flush=True)
    time.sleep(120)
    sys.exit(0)

import numpy as np
import ddl

ddl.init()
r, n = ddl.rank(), ddl.size()
y = ddl.allreduce(np.full(1000, r + 1, dtype=np.float64), op=ddl.Sum)
engine = ddl.engine_name()  # "ddl/gloo" or "ddl/mpi": what carries the hosts' part
job_id = ddl.api.session().world.job_id  # scopes the job's shared memory
env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "DDL_HOSTS",
       "MASTER_ADDR", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NODEID",
       "SLURMD_NODENAME", "PMIX_RANK", "DDL_JOB_ID")}
print("RESULT " + json.dumps({
    "rank": r, "size": n, "local_rank": ddl.local_rank(), "local_size": ddl.local_size(),
    "cross_rank": ddl.cross_rank(), "cross_size": ddl.cross_size(),
    "host": socket.gethostname(), "sum": float(y[0]), "same": bool((y == y[0]).all()),
    "engine": engine, "job_id": job_id, "env": env}), flush=True)
ddl.shutdown()
'''


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(f"Slurm tests need slurm-wlm, munge, root and network namespaces: {why}")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    (c.tmp / "job.py").write_text(JOB)
    try:
        yield c.start()
    finally:
        c.close()


def job(slurm: SlurmCluster) -> str:
    return str(slurm.tmp / "job.py")


def results(out: str) -> dict[int, dict]:
    """The RESULT lines (a ``--label``/``[rank]`` prefix allowed), by rank."""
    found = {}
    for line in out.splitlines():
        _, sep, data = line.partition("RESULT ")
        if sep:
            got = json.loads(data)
            found[got["rank"]] = got
    return found


def check_allreduce(got: dict[int, dict], nodes: list[str], per_node: int) -> None:
    """Every rank of ``len(nodes) * per_node`` reported, the sum is right everywhere, and
    ranks sit block-wise on the nodes (ranks 0..per_node-1 on nodes[0], ...)."""
    n = len(nodes) * per_node
    assert sorted(got) == list(range(n)), got
    for rank, g in got.items():
        node = rank // per_node
        assert g["size"] == n and g["sum"] == n * (n + 1) / 2 and g["same"], g
        assert (g["local_rank"], g["local_size"]) == (rank % per_node, per_node), g
        assert (g["cross_rank"], g["cross_size"]) == (node, len(nodes)), g
        assert g["host"] == nodes[node] == g["env"]["SLURMD_NODENAME"], g


def shm_left(got: dict[int, dict]) -> list[str]:
    """The job's shared-memory segments still in /dev/shm (every node shares this one)."""
    ids = {g["job_id"] for g in got.values()}
    assert len(ids) == 1 and all(ids), ids
    prefix = f"ddl-{ids.pop()}-"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


# ---------------------------------------------------------------------------- cluster
@cluster_test
def test_salloc_ddlrun_runs_ddl_across_both_nodes(slurm, marker):
    res = slurm.client(["salloc", "-N", "2", "--ntasks-per-node=2", "--job-name", marker,
                        PY, "-m", "ddlrun", "--job-id", f"sa_{marker[-6:]}", PY, job(slurm)],
                       cwd=str(REPO), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr + slurm.logs()
    got = results(res.stdout)
    check_allreduce(got, slurm.hostnames, 2)
    # placement came from the allocation: SLURM_JOB_NODELIST=node[1-2],
    # SLURM_TASKS_PER_NODE=2(x2); MASTER_ADDR is node 0's name, which every node resolves
    for g in got.values():
        assert g["env"]["DDL_HOSTS"] == "node1,node2" and g["env"]["MASTER_ADDR"] == "node1"
        assert g["env"]["GROUP_RANK"] == g["env"]["SLURM_NODEID"], g
        assert g["env"]["RANK"] == g["env"]["SLURM_PROCID"], g  # srun's order is ddlrun's
        assert g["env"]["DDL_JOB_ID"] == f"sa_{marker[-6:]}"
    assert re.search(r"running: srun --nodes=2 --ntasks=4 --nodelist=node1,node2 .*"
                     r"--kill-on-bad-exit=1 .*--ntasks-per-node=2 --label "
                     rf"{re.escape(PY)} -m ddlrun\.rankenv -- ", res.stderr), res.stderr
    assert "Granted job allocation" in res.stderr
    # a launcher that exits 0 is no failure: no "slurm exited with code 0" report
    assert "exited with code" not in res.stderr, res.stderr
    assert shm_left(got) == []


@cluster_test
def test_ddlrun_inside_an_allocation_picks_srun_and_its_layout(slurm):
    """--dry-run inside ``salloc -N2 -n3``: hosts and uneven slots (2,1) from SLURM_*, the
    slurm launcher, and an srun command without --ntasks-per-node; then the real run puts
    each rank where the plan says (SLURMD_NODENAME) and ddl's sum is right."""
    alloc = ["salloc", "-N", "2", "-n", "3", PY, "-m", "ddlrun"]
    dry = slurm.client([*alloc, "--dry-run", PY, job(slurm)], cwd=str(REPO), timeout=60)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "3 ranks on 2 host(s)" in dry.stdout, dry.stdout
    assert re.search(r"host 0 node1: ranks 0,1\b", dry.stdout), dry.stdout
    assert re.search(r"host 1 node2: ranks 2\b", dry.stdout), dry.stdout
    cmd = next(ln for ln in dry.stdout.splitlines() if ln.startswith("command: "))
    assert cmd.startswith("command: srun --nodes=2 --ntasks=3 --nodelist=node1,node2 "), cmd
    assert "--ntasks-per-node" not in cmd
    res = slurm.client([*alloc, PY, job(slurm)], cwd=str(REPO), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    got = results(res.stdout)
    assert sorted(got) == [0, 1, 2], res.stdout + res.stderr
    for rank, g in got.items():
        assert g["host"] == ("node1" if rank < 2 else "node2") == g["env"]["SLURMD_NODENAME"]
        assert g["sum"] == 6 and g["same"], g
        assert g["env"]["SLURM_STEP_ID"] is not None  # srun started it, not ssh
    assert (got[2]["local_rank"], got[2]["local_size"]) == (0, 1)


BATCH = """\
#!/bin/sh
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --job-name={name}
#SBATCH --output={out}
set -e
echo "batch on $(hostname) nodes $SLURM_JOB_NODELIST tasks $SLURM_TASKS_PER_NODE"
# ddl's rendezvous serves only ranks that know the secret: one per job, from the script
export DDL_JOB_SECRET="$({py} -c 'import secrets; print(secrets.token_hex(16))')"
# 1) ddlrun places the ranks from SLURM_* and starts them with srun
{py} -m ddlrun {py} {job}
# 2) the same script with srun as the process starter: ddl reads Slurm's variables
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
echo "--- plain srun"
srun --label {py} {job}
echo "batch done"
"""


@cluster_test
def test_sbatch_script_runs_ddlrun_and_plain_srun(slurm, marker):
    out = slurm.tmp / f"{marker}.out"
    script = slurm.tmp / f"{marker}.sh"
    script.write_text(BATCH.format(name=marker, out=out, py=PY, job=job(slurm)))
    sub = slurm.client(["sbatch", "--parsable", str(script)], cwd=str(REPO), timeout=30)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    state = wait_job(slurm, job_id, timeout=120)
    text = out.read_text() if out.exists() else "(no output file)"
    assert state == "COMPLETED", f"{state}\n{text}\n{slurm.logs()}"
    assert text.startswith("batch on node1 nodes node[1-2] tasks 2(x2)\n"), text
    assert text.rstrip().endswith("batch done"), text
    first, sep, second = text.partition("\n--- plain srun\n")
    assert sep, text
    check_allreduce(results(first), slurm.hostnames, 2)
    got = results(second)
    check_allreduce(got, slurm.hostnames, 2)
    assert shm_left(results(first)) == [] and shm_left(got) == []
    for g in got.values():  # nobody set RANK: ddl took the layout from Slurm's step
        assert g["env"]["RANK"] is None and g["env"]["GROUP_RANK"] is None
        assert g["env"]["DDL_JOB_ID"] is None and g["env"]["MASTER_ADDR"] == "node1"
    assert "is open: no DDL_JOB_SECRET" not in text  # the secret reached every rank


def wait_job(slurm: SlurmCluster, job_id: str, timeout: float) -> str:
    """The job's final state (COMPLETED, FAILED, ...) from scontrol, or TIMEOUT-WAITING."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = slurm.client(["scontrol", "-o", "show", "job", job_id], timeout=15)
        m = re.search(r"\bJobState=(\S+)", res.stdout)
        if m and m[1] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return m[1]
        time.sleep(0.5)
    slurm.client(["scancel", job_id], timeout=15)
    return "TIMEOUT-WAITING"


@cluster_test
def test_failing_rank_cancels_the_step(slurm, marker):
    t0 = time.monotonic()
    res = slurm.client(["salloc", "-N", "2", "--ntasks-per-node=2", PY, "-m", "ddlrun",
                        "--job-id", f"sf_{marker[-6:]}", PY, job(slurm), "fail", "3", "7",
                        marker], cwd=str(REPO), timeout=120)
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode == 7, out
    assert took < 60, f"the step was not cancelled ({took:.0f}s): {out}"
    assert "3: rank 3 fails now" in res.stdout and "0: rank 0 waits" in res.stdout, out
    assert re.search(r"srun: error: node2: task 3: Exited with exit code 7", res.stderr), out
    # srun itself exits 143 (the highest code: the others were terminated): ddlrun names
    # the first failure and exits with its code
    assert ("ddlrun: rank 3 on host node2 exited with code 7; srun stops the other ranks"
            in res.stderr), out
    assert "ddlrun: slurm exited with code 7" in res.stderr, out
    assert wait_gone(marker, 15) == [], "ranks left running after the step was cancelled"


@cluster_test
def test_plain_srun_starts_ddl_ranks_without_ddlrun(slurm):
    res = slurm.client(["srun", "-N2", "-n4", "--label", PY, job(slurm)], cwd=str(REPO),
                       timeout=120, env=slurm.env(MASTER_ADDR="node1", DDL_TIMEOUT="30"))
    assert res.returncode == 0, res.stdout + res.stderr
    got = results(res.stdout)
    check_allreduce(got, slurm.hostnames, 2)
    assert {g["engine"] for g in got.values()} == {"ddl/gloo"}
    job_ids = {g["env"]["SLURM_JOB_ID"] for g in got.values()}
    assert len(job_ids) == 1 and all(g["env"]["RANK"] is None for g in got.values())
    assert "is open: no DDL_JOB_SECRET" in res.stderr  # the one-line warning
    assert shm_left(got) == []


def pmix_unavailable(slurm: SlurmCluster) -> str | None:
    res = slurm.client(["srun", "--mpi=pmix", "-N1", "-n1", "true"], timeout=60)
    if res.returncode != 0:
        return ("srun --mpi=pmix does not work here (Debian's plugin dlopens libpmix.so "
                f"from libpmix-dev): {res.stderr.strip().splitlines()[-1:]}")
    return None


@cluster_test
def test_srun_mpi_pmix_starts_ddl_ranks(slurm):
    why = pmix_unavailable(slurm)
    if why:
        pytest.skip(why)
    res = slurm.client(["srun", "--mpi=pmix", "-N2", "-n4", "--label", PY, job(slurm)],
                       cwd=str(REPO), timeout=120,
                       env=slurm.env(MASTER_ADDR="node1", DDL_TIMEOUT="30",
                                     DDL_JOB_SECRET="pmix-test-secret"))
    assert res.returncode == 0, res.stdout + res.stderr
    got = results(res.stdout)
    check_allreduce(got, slurm.hostnames, 2)
    for rank, g in got.items():
        assert g["env"]["PMIX_RANK"] == str(rank), g
        assert g["engine"] == "ddl/mpi", g  # PMIx started it: mpi4py carries the hosts' part
    assert shm_left(got) == []


# ---------------------------------------------------------------------------- units
STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


@pytest.mark.parametrize("rank,node,local", [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)])
def test_ddl_reads_the_layout_of_an_srun_step(rank, node, local):
    w = topology.world_from_env(dict(STEP, SLURM_PROCID=str(rank), SLURM_NODEID=str(node),
                                     SLURM_LOCALID=str(local)))
    assert (w.rank, w.size, w.local_rank, w.local_size) == (rank, 4, local, 2)
    assert (w.host_index, w.num_hosts, w.launched_by_mpi) == (node, 2, False)
    assert w.job_id.startswith("pm")


def test_ddl_reads_uneven_tasks_per_node():
    w = topology.world_from_env(dict(STEP, SLURM_NTASKS="3", SLURM_PROCID="2",
                                     SLURM_NODEID="1", SLURM_LOCALID="0",
                                     SLURM_STEP_TASKS_PER_NODE="2,1"))
    assert (w.rank, w.size, w.local_rank, w.local_size, w.host_index) == (2, 3, 0, 1, 1)


def test_a_batch_scripts_own_process_is_not_rank_0_of_the_job():
    # sbatch's script has SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step
    w = topology.world_from_env({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                                 "SLURM_NODEID": "0", "SLURM_LOCALID": "0"})
    assert (w.rank, w.size, w.local_size, w.job_id) == (0, 1, 1, "")


def test_the_torchrun_contract_wins_over_slurm():
    # ddlrun (through ddlrun.rankenv) or torchrun inside an srun task set the layout
    w = topology.world_from_env(dict(STEP, SLURM_PROCID="3", SLURM_NODEID="1",
                                     SLURM_LOCALID="1", RANK="0", WORLD_SIZE="2",
                                     LOCAL_RANK="0", LOCAL_WORLD_SIZE="2"))
    assert (w.rank, w.size, w.local_rank, w.local_size, w.host_index) == (0, 2, 0, 2, 0)


def test_open_mpi_variables_win_over_slurm():
    # mpirun inside an allocation: the ranks inherit the daemons' srun step variables
    w = topology.world_from_env(dict(STEP, SLURM_PROCID="1", SLURM_NODEID="1",
                                     SLURM_LOCALID="0", OMPI_COMM_WORLD_RANK="5",
                                     OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
                                     OMPI_COMM_WORLD_LOCAL_SIZE="4"))
    assert (w.rank, w.size, w.local_rank, w.local_size, w.host_index) == (5, 8, 1, 4, 1)


def test_bad_tasks_per_node_names_the_variable():
    from ddl.errors import DDLConfigError

    with pytest.raises(DDLConfigError, match="SLURM_STEP_TASKS_PER_NODE='2x'"):
        topology.world_from_env(dict(STEP, SLURM_PROCID="0", SLURM_NODEID="0",
                                     SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="2x"))


class LauncherExits(Backend):
    """The seam: a single launcher (srun, mpirun) that exits with ``code``."""

    name = "slurm"

    def __init__(self, code: int) -> None:
        super().__init__(LaunchOptions())
        self.code = code

    def start(self, plan, sink, emit) -> None:
        sink.raw("stderr", "srun: a line of srun's\n")
        emit(JobExit(self.code, time.monotonic()))

    def close(self, timeout: float) -> None:
        pass


@pytest.mark.parametrize("code", [0, 7])
def test_a_launcher_exiting_0_is_not_reported_as_a_failure(code):
    plan = make_plan(Request(("prog",), (HostSpec("node1", 2),)), {}, "jx", 29500, {},
                     {"DDL_JOB_SECRET": "s"})
    err = io.StringIO()
    outcome = supervise(plan, LauncherExits(code), OutputSink(stdout=io.StringIO(), stderr=err))
    assert outcome.code == code
    reported = re.findall(r"ddlrun: slurm exited with code (\d+)", err.getvalue())
    assert reported == ([] if code == 0 else [str(code)]), err.getvalue()
    assert ("ended with exit code" in err.getvalue()) == (code == 7)


@pytest.mark.parametrize("line,want", [
    ("srun: error: node2: task 3: Exited with exit code 7", (3, "node2", 7)),
    ("srun: error: node1: tasks 0-1: Killed", (0, "node1", -9)),
    ("srun: error: gpu-07: task 12: Segmentation fault (core dumped)", (12, "gpu-07", -11)),
    ("srun: error: Unable to allocate resources: Invalid node name specified", None),
    ("3: srun: error: node2: task 1: Exited with exit code 1", None),  # a rank's own line
])
def test_srun_task_failure_lines(line, want):
    assert task_failure(line) == want


def test_the_first_failed_task_gives_the_job_its_code():
    backend = SlurmBackend(LaunchOptions())
    err = io.StringIO()
    sink = OutputSink(stdout=io.StringIO(), stderr=err)
    for line in ("srun: error: node2: task 3: Exited with exit code 7\n",
                 "srun: error: node1: tasks 0-1: Terminated\n"):
        backend.watch("stderr", line, sink)
    assert backend.job_code(143) == 7  # srun's own: the terminated ones' 128 + 15
    assert backend.job_code(0) == 0
    assert err.getvalue().count("ddlrun: rank ") == 1
    assert "ddlrun: rank 3 on host node2 exited with code 7" in err.getvalue()
