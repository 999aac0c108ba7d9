"""The command line: parsing, validation, --dry-run; nothing is started on bad input."""

import json

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
    assert "DDL_OPTIONS='-mode p:2x2'" in out
    assert "[3] DDL_HOST_INDEX=1 GROUP_RANK=1 LOCAL_RANK=1" in out
    assert "FOO=bar" in out and "GLOO_SOCKET_IFNAME=eth1" in out
    assert out.count("command: ssh -T") == 2 and "-- nodeB" in out
    assert not victim.exists()
    res = run_ddlrun("--dry-run", "--launcher", "mpirun", "-H", "nodeA:2,nodeB:2", "true")
    assert "mpirun -np 4 --host nodeA:2,nodeB:2" in res.stdout, res.stderr


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
        assert e["DDL_OPTIONS"] == "-mode p:3" and e["DDL_JOB_ID"] == "envjob"
        assert e["DDL_HOSTS"] == "localhost" and e["CUDA_VISIBLE_DEVICES"] is None
        assert int(e["OMP_NUM_THREADS"]) >= 1
        assert e["FROM_X"] == "inherited" and e["FROM_X_VAL"] == "v"
