"""Backends build argv lists; tests assert on them without launching anything."""

import os
import shlex

import pytest

from ddlrun.backends import LaunchOptions, get_backend
from ddlrun.backends.mpirun import parse_mpiargs
from ddlrun.errors import UsageError
from ddlrun.hosts import HostSpec
from ddlrun.plan import Request, make_plan


def plan(hosts=(("a", 2), ("b", 2))):
    req = Request(("python", "t.py", "--x", "a b"), tuple(HostSpec(n, s) for n, s in hosts))
    return make_plan(req, {}, "j1", 29500, {})


def test_ssh_command_is_argv_with_options_and_end_of_options():
    opts = LaunchOptions(ssh_port=2222, ssh_identity="/k/id", ssh_config="/k/cfg",
                         remote_python="/opt/py/bin/python", start_timeout=7)
    b = get_backend("ssh", opts)
    cmd = b.get_cmd(HostSpec("node1", 2, "alice"))
    assert cmd[:2] == ["ssh", "-T"]
    assert "ConnectTimeout=7" in cmd and "BatchMode=yes" in cmd
    i = cmd.index("--")
    assert cmd[i + 1] == "node1"
    assert cmd[cmd.index("-p") + 1] == "2222" and cmd[cmd.index("-i") + 1] == "/k/id"
    assert cmd[cmd.index("-F") + 1] == "/k/cfg" and cmd[cmd.index("-l") + 1] == "alice"
    assert shlex.split(cmd[-1]) == ["/opt/py/bin/python", "-m", "ddlrun.agent"]
    probe = b.probe_cmd(HostSpec("node1"), (29500, 29501), "eth0")
    assert shlex.split(probe[-1])[-7:] == ["--probe", "--port", "29500", "--port", "29501",
                                           "--iface", "eth0"]


def test_ssh_spec_carries_argv_and_env_not_the_command_line():
    b = get_backend("ssh", LaunchOptions())
    p = plan()
    spec = b.spec(p, p.hosts[1])
    assert spec["host_index"] == 1 and spec["job_id"] == "j1"
    assert [r["rank"] for r in spec["ranks"]] == [2, 3]
    assert spec["ranks"][0]["argv"] == ["python", "t.py", "--x", "a b"]
    assert spec["ranks"][0]["env"]["LOCAL_RANK"] == "0"
    assert all("MASTER_PORT" not in " ".join(c) for c in b.commands(p))


@pytest.mark.parametrize("field", ["ssh_identity", "ssh_config", "remote_python"])
def test_paths_with_spaces_or_dashes_are_rejected(field):
    for bad in ("-oProxyCommand=x", "/a b/c"):
        b = get_backend("ssh", LaunchOptions(**{field: bad}))
        with pytest.raises(UsageError):
            b.get_cmd(HostSpec("h"))


def test_mpirun_command_line():
    opts = LaunchOptions(ssh_port=2222, ssh_config="/k/cfg", is_root=True,
                         network_interface="ddl0", mpiargs=parse_mpiargs(["--mca foo 'x y'"]),
                         remote_python="/py")
    b = get_backend("mpirun", opts)
    cmd = b.get_cmd(plan(), "/tmp/rf")
    s = " ".join(cmd)
    assert cmd[0].endswith("mpirun") and cmd[1:5] == ["-np", "4", "--host", "a:2,b:2"]
    assert "--map-by rankfile:file=/tmp/rf" in s and "--bind-to none" in s
    assert "--allow-run-as-root" in cmd
    assert "--prtemca plm_ssh_args" in s and "-F /k/cfg -p 2222" in s
    assert "--prtemca oob_tcp_if_include ddl0" in s and "btl_tcp_if_include ddl0" in s
    assert "--mca pml ob1 --mca btl tcp,sm,self" in s
    assert cmd[cmd.index("foo") + 1] == "x y"
    assert "-x MASTER_ADDR" in s and "-x DDLRUN_RANK_HOSTS" in s and "29500" not in s
    assert cmd[cmd.index("ddlrun.rankenv") + 1:] == ["--", "python", "t.py", "--x", "a b"]
    assert "--allow-run-as-root" not in get_backend("mpirun", LaunchOptions()).get_cmd(plan(),
                                                                                     "/rf")
    assert b.job_env(plan())["DDLRUN_RANK_HOSTS"] == "0,0,1,1"
    with pytest.raises(UsageError):
        parse_mpiargs(["'unterminated"])


def test_slurm_and_lsf_commands():
    cmd = get_backend("slurm", LaunchOptions(remote_python="/py")).get_cmd(plan())
    assert cmd[0] == "srun" and "--ntasks=4" in cmd and "--nodes=2" in cmd
    assert "--ntasks-per-node=2" in cmd and "--kill-on-bad-exit=1" in cmd
    assert "--nodelist=a,b" in cmd and "--label" in cmd
    assert cmd[-6:] == ["ddlrun.rankenv", "--", "python", "t.py", "--x", "a b"]
    lsf = get_backend("lsf", LaunchOptions(remote_python="/py"))
    assert lsf.get_cmd(HostSpec("hB", 2)) == ["blaunch", "-no-shell", "hB", "/py", "-m",
                                              "ddlrun.agent"]


def test_unknown_backend():
    with pytest.raises(UsageError, match="choose from"):
        get_backend("pbs", LaunchOptions())


def test_rankenv_computes_contract_from_layout():
    from ddlrun.rankenv import compute

    env = {"OMPI_COMM_WORLD_RANK": "3", "DDLRUN_RANK_HOSTS": "0,0,1,1",
           "DDLRUN_HOST_GPUS": "leave:0,1;leave:0,1"}
    got = compute(env, cores=8)
    assert got["RANK"] == "3" and got["LOCAL_RANK"] == "1" and got["GROUP_RANK"] == "1"
    assert got["LOCAL_WORLD_SIZE"] == "2" and got["ROLE_RANK"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in got  # left as the user has it: all GPUs visible
    assert got["OMP_NUM_THREADS"] == "4"
    assert (got["HOROVOD_RANK"], got["HOROVOD_LOCAL_RANK"], got["HOROVOD_LOCAL_SIZE"],
            got["HOROVOD_CROSS_RANK"], got["HOROVOD_CROSS_SIZE"]) == ("3", "1", "2", "1", "2")
    uneven = compute({"PMI_RANK": "2", "DDLRUN_RANK_HOSTS": "0,0,1,2,2"}, cores=8)
    assert (uneven["HOROVOD_CROSS_RANK"], uneven["HOROVOD_CROSS_SIZE"]) == ("1", "3")
    got = compute({**env, "DDLRUN_HOST_GPUS": "leave:;bind:2,3"}, cores=8)
    assert got["CUDA_VISIBLE_DEVICES"] == "3"  # --bind-gpus: local rank 1's GPU
    got = compute({**env, "DDLRUN_HOST_GPUS": "leave:;set:1,3"}, cores=8)
    assert got["CUDA_VISIBLE_DEVICES"] == "1,3"  # --include hB:1,3
    got = compute({"SLURM_PROCID": "0", "DDLRUN_RANK_HOSTS": "0", "OMP_NUM_THREADS": "2"}, 8)
    assert "OMP_NUM_THREADS" not in got and "CUDA_VISIBLE_DEVICES" not in got


def test_rankenv_has_open_mpi_yield_on_oversubscribed_hosts():
    """ddlrun's mpirun gets --host h:N, so Open MPI sees a slot per rank and spins even
    with more ranks than cores; the rank then asks it to yield (unless the user chose)."""
    from ddlrun.rankenv import compute

    four = {"OMPI_COMM_WORLD_RANK": "1", "DDLRUN_RANK_HOSTS": "0,0,0,0"}
    assert compute(four, cores=2)["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert "OMPI_MCA_mpi_yield_when_idle" not in compute(four, cores=4)
    mine = compute({**four, "OMPI_MCA_mpi_yield_when_idle": "0"}, cores=2)
    assert "OMPI_MCA_mpi_yield_when_idle" not in mine  # the user's 0 stays


def test_mpirun_rankfile_paths_never_spell_pe(tmp_path, monkeypatch):
    # Open MPI 5 reads "pe" anywhere in --map-by as PE=<list> and then refuses
    # --bind-to none: the generated rankfile's folder must not contain it
    from ddlrun.backends import mpirun

    assert mpirun.prrte_safe("/tmp/ddlrun-abc/rankfile")
    assert not mpirun.prrte_safe("/tmp/ddlrun-x2pe7/rankfile")
    assert not mpirun.prrte_safe("/home/PEte/rf")
    bad = tmp_path / "pe-tmp"
    bad.mkdir()
    monkeypatch.setattr(mpirun.tempfile, "tempdir", str(bad))
    assert mpirun.prrte_safe(mpirun.safe_tmp_base())
    # a job id that spells "pe" still gets a folder that does not (hex digest)
    job = make_plan(Request(("p",), (HostSpec("a", 2),)), {}, "pepe.pe", 29500, {})
    rf = mpirun.plan_rankfile(job, None)
    assert mpirun.prrte_safe(rf.path) and rf.lines == ("rank 0=a slot=0", "rank 1=a slot=1")
    assert mpirun.plan_rankfile(job, None) == rf  # the same path at --dry-run and at start
    mine = mpirun.plan_rankfile(job, "/home/PEte/rf")
    assert mine.copy_of == "/home/PEte/rf" and mpirun.prrte_safe(mine.path)
    assert mpirun.plan_rankfile(job, "/srv/rf") == mpirun.Rankfile("/srv/rf")


def test_mpirun_rankfile_is_written_in_a_new_private_folder(tmp_path):
    from ddlrun.backends import mpirun

    job = make_plan(Request(("p",), (HostSpec("a", 2),)), {}, "jw", 29500, {})
    rf = mpirun.plan_rankfile(job, None, base=str(tmp_path))
    mpirun.write_rankfile(rf)
    with open(rf.path) as f:
        assert f.read() == "rank 0=a slot=0\nrank 1=a slot=1\n"
    assert os.stat(rf.folder).st_mode & 0o777 == 0o700
    with pytest.raises(UsageError, match="exists"):
        mpirun.write_rankfile(rf)  # never into a folder somebody made before us
