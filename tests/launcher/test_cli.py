"""The command line: parsing, validation, --dry-run; nothing is started on bad input."""

import json
import os

import pytest
from ddlrun_testlib import PY, WORKER, run_ddlrun

from ddlrun.cli import build_parser, config_from_args
from ddlrun.errors import UsageError


def cfg(*argv, environ=None):
    return config_from_args(build_parser().parse_args(list(argv)), environ or {})


def test_program_arguments_pass_through_untouched_also_after_double_dash():
    c = cfg("-n", "2", "python", "train.py", "-n", "5", "--lr=0.1", "-x")
    assert c.request.program == ("python", "train.py", "-n", "5", "--lr=0.1", "-x")
    assert cfg("-n", "2", "--", "python", "-v").request.program == ("python", "-v")
    assert cfg("-n", "2", "python").launcher == "local"


def test_launcher_auto_selection():
    assert cfg("-H", "nodeA:2,nodeB:2", "p").launcher == "ssh"
    assert cfg("-H", "localhost:2", "p").launcher == "local"
    slurm = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}
    c = cfg("p", environ=slurm)
    assert c.launcher == "slurm" and [h.name for h in c.request.hosts] == ["n1", "n2"]
    lsf = {"LSB_JOBID": "1", "LSB_MCPU_HOSTS": "a 2 b 2"}
    assert cfg("p", environ=lsf).launcher == "lsf"
    assert cfg("-H", "x:1", "p", environ=slurm).launcher == "ssh"  # -H wins


@pytest.mark.parametrize(
    "argv",
    [
        ("-H", "a,b", "--hostfile", "f", "p"),
        ("-n", "0", "p"),
        ("-x", "A-B=1", "p"),
        ("--ssh-port", "0", "p"),
        ("--network-interface", "eth0;id", "p"),
        ("--launcher", "local", "-H", "remote1:2", "p"),
        ("--timeout", "0", "p"),
    ],
)
def test_bad_options_are_usage_errors(argv):
    with pytest.raises(UsageError):
        cfg(*argv)


def test_hostfile_injection_is_rejected_with_line_number_and_nothing_runs(tmp_path):
    hostfile = tmp_path / "hosts"
    victim = tmp_path / "x"
    hostfile.write_text(f"# ok\nnodeA slots=2\na;touch {victim}\n")
    res = run_ddlrun("--hostfile", str(hostfile), "touch", str(victim))
    assert res.returncode == 2
    assert f"{hostfile}:3" in res.stderr and "invalid host name" in res.stderr
    assert not victim.exists()
    res = run_ddlrun("-H", "a,-oProxyCommand=touch", "touch", str(victim))
    assert res.returncode == 2 and "must not start with '-'" in res.stderr
    assert not victim.exists()


def test_dry_run_prints_commands_and_env_and_starts_nothing(tmp_path):
    victim = tmp_path / "ran"
    res = run_ddlrun("--dry-run", "-H", "nodeA:2,nodeB:2", "--ssh-port", "2222",
                     "--network-interface", "eth1", "--job-id", "dry1", "-x", "FOO=bar",
                     "touch", str(victim))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "job dry1: 4 ranks on 2 host(s)" in out
    assert "DDL_OPTIONS='-mode r:2x2'" in out
    assert "[3] env: the remote login environment + common env + DDL_HOST_INDEX=1 GROUP_RANK=1 " \
        "HOROVOD_CROSS_RANK=1 HOROVOD_CROSS_SIZE=2 HOROVOD_LOCAL_RANK=1 HOROVOD_LOCAL_SIZE=2 " \
        "HOROVOD_RANK=3 LOCAL_RANK=1" in out
    assert "FOO=bar" in out and "GLOO_SOCKET_IFNAME=eth1" in out
    assert out.count("command: ssh -T") == 2 and "-- nodeB" in out
    assert not victim.exists()
    res = run_ddlrun("--dry-run", "--launcher", "mpirun", "-H", "nodeA:2,nodeB:2", "true")
    assert "mpirun -np 4 --host nodeA:2,nodeB:2" in res.stdout, res.stderr


def test_dry_run_mpirun_prints_the_rankfile_it_will_use_and_the_port_it_took(tmp_path):
    from ddlrun.backends.mpirun import plan_rankfile
    from ddlrun.hosts import HostSpec
    from ddlrun.plan import Request, make_plan

    res = run_ddlrun("--dry-run", "--launcher", "mpirun", "-H", "nodeA:2,nodeB:1",
                     "--job-id", "dryrf", "true", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    # the path the run will write (planned the same way at start), not a placeholder
    job = make_plan(Request(("true",), (HostSpec("nodeA", 2), HostSpec("nodeB", 1))), {},
                    "dryrf", 29500, {})
    path = plan_rankfile(job, None, base=str(tmp_path)).path
    lines = res.stdout.splitlines()
    at = lines.index(f"rankfile: {path} (written at start):")
    assert lines[at + 1:at + 4] == ["  rank 0=nodeA slot=0", "  rank 1=nodeA slot=1",
                                    "  rank 2=nodeB slot=0"]
    assert f"--map-by rankfile:file={path} " in res.stdout
    assert not os.path.exists(path)  # --dry-run writes nothing
    # host 0 is not probed in --dry-run: the port it takes is said, not silent
    assert ("note: MASTER_PORT 29500 (and 29501 for ddl's store) on nodeA, not checked free: "
            "nodeA was not probed (--dry-run); give --master-port") in res.stderr
    quiet = run_ddlrun("--dry-run", "--launcher", "mpirun", "-H", "nodeA:2",
                       "--master-port", "29611", "true")
    assert "MASTER_PORT=29611" in quiet.stdout and "note: MASTER_PORT" not in quiet.stderr


def test_too_many_ranks_message():
    res = run_ddlrun("--dry-run", "-H", "a:1,b:1", "-n", "3", "true")
    assert res.returncode == 2
    assert "asked for 3 ranks but the hosts provide only 2 slots (a:1, b:1)" in res.stderr


def test_check_local_prints_versions_table():
    res = run_ddlrun("--check", "-n", "2")
    assert res.returncode == 0, res.stderr
    assert "powerddl" in res.stdout and "python" in res.stdout and "localhost" in res.stdout
    assert "preflight ok" in res.stderr


def test_env_contract_local(marker):
    res = run_ddlrun("-n", "3", "-x", "FROM_X", "-x", "FROM_X_VAL=v", "--job-id", "envjob",
                     PY, WORKER, "env", marker, env={"FROM_X": "inherited", "PATH": "/usr/bin"})
    assert res.returncode == 0, res.stderr
    envs = {}
    for line in res.stdout.splitlines():
        tag, _, body = line.partition(" ")
        envs[int(tag.strip("[]"))] = json.loads(body)
    assert sorted(envs) == [0, 1, 2]
    for r, e in envs.items():
        assert e["RANK"] == str(r) and e["LOCAL_RANK"] == str(r)
        assert e["WORLD_SIZE"] == "3" and e["LOCAL_WORLD_SIZE"] == "3"
        assert e["GROUP_RANK"] == "0" == e["DDL_HOST_INDEX"]
        assert e["MASTER_ADDR"] == "127.0.0.1" and int(e["MASTER_PORT"]) > 0
        assert e["DDL_OPTIONS"] == "-mode r:3" and e["DDL_JOB_ID"] == "envjob"
        assert e["DDL_HOSTS"] == "localhost" and e["CUDA_VISIBLE_DEVICES"] is None
        assert int(e["OMP_NUM_THREADS"]) >= 1
        assert e["FROM_X"] == "inherited" and e["FROM_X_VAL"] == "v"


# ---------------------------------------------------------------------------- job secret
def test_job_secret_is_new_per_job_unless_the_user_has_one():
    from ddlrun.steps import job_secret_env

    req = cfg("-n", "2", "p").request
    a, b = job_secret_env(req, {}), job_secret_env(req, {})
    assert set(a) == {"DDL_JOB_SECRET"} and len(a["DDL_JOB_SECRET"]) >= 32
    assert a != b
    assert job_secret_env(req, {"DDL_JOB_SECRET": "mine"}) == {"DDL_JOB_SECRET": "mine"}
    assert job_secret_env(req, {"DDL_JOB_SECRET_FILE": "/run/s"}) == {
        "DDL_JOB_SECRET_FILE": "/run/s"}
    assert job_secret_env(cfg("-x", "DDL_JOB_SECRET=x", "p").request, {}) == {}  # -x wins
    assert job_secret_env(req, {}, draw=lambda: "drawn") == {"DDL_JOB_SECRET": "drawn"}


def test_secret_is_masked_in_dry_run_and_verbose_and_never_in_commands():
    for launcher in ("ssh", "mpirun"):
        res = run_ddlrun("--dry-run", "-v", "--launcher", launcher, "-H", "nodeA:1,nodeB:1",
                         "true", env={**os.environ, "DDL_JOB_SECRET": "hunter2-secret"})
        assert res.returncode == 0, res.stderr
        assert "DDL_JOB_SECRET=<secret>" in res.stdout
        assert "hunter2-secret" not in res.stdout + res.stderr
    assert "-x DDL_JOB_SECRET" in res.stdout  # mpirun exports it by name only
    res = run_ddlrun("--dry-run", "-n", "2", "true")
    assert "DDL_JOB_SECRET=<secret>" in res.stdout


def test_secret_reaches_local_ranks_and_no_command_line(marker):
    res = run_ddlrun("-n", "2", PY, WORKER, "env", marker)
    assert res.returncode == 0, res.stderr
    envs = [json.loads(ln.split(" ", 1)[1]) for ln in res.stdout.splitlines()]
    secrets_seen = {e["DDL_JOB_SECRET"] for e in envs}
    assert len(secrets_seen) == 1 and len(secrets_seen.pop()) >= 32  # one per job, all ranks
    assert not any(e["secret_in_argv"] for e in envs)  # neither the rank's nor ddlrun's argv
    res = run_ddlrun("-n", "1", PY, WORKER, "env", marker,
                     env={**os.environ, "DDL_JOB_SECRET_FILE": "/run/their-file"})
    env = json.loads(res.stdout.split(" ", 1)[1])
    assert env["DDL_JOB_SECRET"] is None and env["DDL_JOB_SECRET_FILE"] == "/run/their-file"


def test_mpirun_command_carries_the_secret_by_name_only():
    from ddlrun.backends import LaunchOptions, get_backend
    from ddlrun.hosts import HostSpec
    from ddlrun.plan import Request, make_plan

    plan = make_plan(Request(("p",), (HostSpec("a", 1), HostSpec("b", 1))), {}, "j", 29500, {},
                     {"DDL_JOB_SECRET": "s3cr3t-value"})
    backend = get_backend("mpirun", LaunchOptions())
    cmd = backend.commands(plan)[0]
    assert "s3cr3t-value" not in " ".join(cmd)
    assert cmd[cmd.index("DDL_JOB_SECRET") - 1] == "-x"
    assert backend.job_env(plan)["DDL_JOB_SECRET"] == "s3cr3t-value"  # mpirun's own env


# ---------------------------------------------------------------------------- ports
def test_preflight_checks_the_ports_the_job_binds_and_names_the_taken_one():
    import socket

    from ddlrun.preflight import ProbeResult, check, pick_free_pair, port_free, probe
    from ddlrun.steps import job_ports

    c = cfg("-n", "2", "p")
    assert list(job_ports(c, 29500, {})) == [29500, 29501]
    assert list(job_ports(c, 29500, {"DDL_PORT": "31000"})) == [29500, 31000]  # inherited
    assert list(job_ports(cfg("-H", "a,b", "p"), 29500, {"DDL_PORT": "31000"})) == [29500,
                                                                                    29501]
    assert list(job_ports(cfg("-H", "a,b", "-x", "DDL_PORT=31000", "p"), None, {})) == [31000]
    assert job_ports(c, None, {}) == {}
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    given: list[int] = []
    for _ in range(5):
        p = pick_free_pair(avoid=given)
        assert port_free(p) and port_free(p + 1)
        assert p + 1 < ephemeral  # never a port the kernel may hand out as a source port
        assert all(abs(p - q) > 1 for q in given)  # another job's pair is not shared
        given.append(p)
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        taken = s.getsockname()[1]
        names = job_ports(c, taken - 1, {})
        problems = check([ProbeResult("h0", probe(list(names)), None)], None, names)
    assert (f"h0: ddl's store port {taken} (DDL_PORT, default MASTER_PORT+1) is in use; choose "
            "another --master-port (or DDL_PORT for the store)") in problems
