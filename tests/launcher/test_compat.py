"""Familiar flags and forms from torchrun, horovodrun, mpirun, DeepSpeed and IBM ddlrun
(the doc's "Coming from" table is run row by row in test_coming_from.py)."""

import json
import os
import stat
import subprocess
import sys

import pytest
from ddlrun_testlib import PY, ddlrun_argv, run_ddlrun

from ddlrun.cli import config_from_args, parse_args
from ddlrun.errors import UsageError
from ddlrun.preflight import pick_free_pair


def cfg(*argv, environ=None):
    return config_from_args(parse_args(list(argv)), environ or {})


# ---------------------------------------------------------------------------- parsing
def test_no_abbreviations():
    assert cfg("--host", "h1:2", "p").request.hosts[0].slots == 2  # not --hostfile
    c = cfg("--mpi", "python", "x.py")
    assert c.launcher == "mpirun" and c.request.program == ("python", "x.py")
    with pytest.raises(SystemExit):
        parse_args(["--hostf", "f", "p"])


def test_option_values_may_start_with_a_dash():
    assert cfg("--ddloption", "-mode b:2x2", "-n", "4", "p").request.ddloptions == (
        "-mode b:2x2",)
    assert cfg("--ddloption=-dump_iter 5", "p").request.ddloptions == ("-dump_iter 5",)
    assert cfg("--mpiarg", "-x FOO", "--launcher", "mpirun", "p").options.mpiargs == (
        "-x", "FOO")
    # the program's own arguments are never rewritten
    assert cfg("-n", "1", "prog", "--ddloption", "-x").request.program == (
        "prog", "--ddloption", "-x")


def test_user_mode_in_ddloption_is_the_mode(tmp_path):
    res = run_ddlrun("--dry-run", "-n", "4", "--ddloption", "-mode b:2x2", "python", "x.py")
    assert res.returncode == 0, res.stderr
    assert "DDL_OPTIONS='-mode b:2x2'" in res.stdout


def test_aliases_mean_the_same():
    assert cfg("-np", "3", "p").request.nproc == 3
    for flag in ("--nproc-per-node", "--nproc_per_node", "--num_gpus"):
        assert cfg(flag, "2", "p").request.accelerators == 2
    assert cfg("-p", "2222", "-H", "a", "p").options.ssh_port == 2222
    assert cfg("--gloo", "-H", "a", "p").launcher == "ssh"
    slurm = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert cfg("--gloo", "p", environ=slurm).launcher == "local"  # never the allocation's
    with pytest.raises(UsageError, match="not both"):
        cfg("--mpi", "--launcher", "ssh", "p")
    assert [h.name for h in cfg("-H", "a,b,c", "--nnodes", "2", "p").request.hosts] == ["a", "b"]
    with pytest.raises(UsageError, match="only 1 host"):
        cfg("-H", "a", "--num_nodes", "2", "p")


def test_rejected_flag_is_one_line_naming_ddlruns_spelling():
    res = run_ddlrun("--oversubscribe", "-n", "2", "true")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "--accelerators" in res.stderr and "Traceback" not in res.stderr


def test_per_node_mode_plan():
    c = cfg("--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr",
            "10.0.0.1", "p")
    assert c.per_node and c.launcher == "local" and c.master_port == 29500
    for bad, msg in ((("--nnodes", "2", "p"), "--master-addr"),
                     (("--node-rank", "0", "p"), "--nnodes"),
                     (("--nnodes", "2", "--node-rank", "2", "--master-addr", "a", "p"), "outside"),
                     (("-H", "a", "--node-rank", "0", "p"), "one ddlrun per node"),
                     (("--standalone", "-H", "a", "p"), "one node")):
        with pytest.raises(UsageError, match=msg):
            cfg(*bad)


def test_per_node_mode_two_launchers_make_one_job(tmp_path):
    """Two ddlruns as two nodes on this host: RANK = K*nproc + local, one world, ddl agrees
    one job id at init (none given), the secret comes from the user's environment."""
    port = pick_free_pair()
    script = tmp_path / "job.py"
    script.write_text(
        "import json, os, numpy as np, ddl\n"
        "ddl.init()\n"
        "x = np.full(4, float(ddl.rank() + 1))\n"
        "x = ddl.allreduce(x, op=ddl.Sum)\n"
        "print(json.dumps({'rank': ddl.rank(), 'size': ddl.size(), 'sum': x.tolist(),\n"
        "  'job': os.environ.get('DDL_JOB_ID'), 'role': os.environ['ROLE_RANK']}), flush=True)\n"
        "ddl.shutdown()\n")
    env = {**os.environ, "DDL_JOB_SECRET": "s3cret-shared-by-both-nodes"}
    procs = [subprocess.Popen(
        ddlrun_argv("--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1",
                    "--master-addr", "127.0.0.1", "--master-port", str(port),
                    "--no-tag-output", str(script)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for k in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    reps = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["rank"] for r in reps] == [0, 1] and {r["size"] for r in reps} == {2}
    assert all(r["sum"] == [3.0] * 4 for r in reps)
    assert [r["role"] for r in reps] == ["0", "1"] and {r["job"] for r in reps} == {None}


def test_per_node_mode_without_a_secret_warns_once_per_job(tmp_path):
    """Two nodes' ddlruns and no secret: the open rendezvous is told once, by rank 0's ddl,
    not by each node's ddlrun besides."""
    port = pick_free_pair()
    script = tmp_path / "job.py"
    script.write_text("import ddl\nddl.init()\nddl.barrier()\nddl.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_JOB_SECRET")}
    procs = [subprocess.Popen(
        ddlrun_argv("--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1",
                    "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for k in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    said = "".join(out + err for out, err in outs)
    assert said.count("rendezvous") == 1 and "is open" in said, said


# ---------------------------------------------------------------------------- programs
def test_py_program_without_interpreter_runs_with_ddlruns_python(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("import sys, os\nprint(os.environ['RANK'], sys.executable)\n")
    res = run_ddlrun("-n", "2", "--no-tag-output", str(script))
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split()) == sorted(["0", PY, "1", PY])
    # an executable script with a shebang runs as it is
    script.write_text("#!/bin/sh\necho shebang $RANK\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    res = run_ddlrun("-n", "1", "--no-tag-output", str(script))
    assert res.stdout.strip() == "shebang 0", res.stderr


def test_python_without_ddl_fails_in_preflight_in_one_line(tmp_path):
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named ddl' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:/usr/bin:/bin"}
    res = run_ddlrun("-n", "2", "python", "x.py", env=env)
    assert res.returncode == 3, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "preflight:" in ln]
    assert len(lines) == 1 and str(fake) in lines[0] and "import ddl" in lines[0]
    assert PY in lines[0]  # the fix: ddlrun's own python


def test_unset_x_variable_warns(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DDL_TEST_UNSET"}
    res = run_ddlrun("--dry-run", "-n", "1", "-x", "DDL_TEST_UNSET", "true", env=env)
    assert res.returncode == 0
    assert "warning: -x DDL_TEST_UNSET: DDL_TEST_UNSET is not set here" in res.stderr


def test_closed_pipe_is_a_quiet_exit():
    for args in (("--dry-run", "-n", "300", "true"),
                 ("-n", "1", PY, "-c", "for i in range(200000): print(i)")):
        p = subprocess.Popen(ddlrun_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.readline()
        p.stdout.close()  # `| head -1`
        err = p.stderr.read().decode()
        p.wait(timeout=60)
        assert "Traceback" not in err and "BrokenPipe" not in err, err
        assert p.returncode in (0, 141)


def test_torchrun_env_makes_torch_see_torchelastic(marker):
    torch = pytest.importorskip("torch")
    del torch
    code = ("import os, json, torch.distributed as d; print(json.dumps({k: os.environ.get(k) "
            "for k in ('TORCHELASTIC_RUN_ID', 'GROUP_WORLD_SIZE', 'ROLE_RANK', "
            "'ROLE_WORLD_SIZE', 'ROLE_NAME', 'TORCHELASTIC_USE_AGENT_STORE')} | "
            "{'launched': d.is_torchelastic_launched()}))")
    res = run_ddlrun("-n", "2", "--job-id", "te1", "--no-tag-output", PY, "-c", code, marker)
    assert res.returncode == 0, res.stderr
    reps = sorted((json.loads(ln) for ln in res.stdout.splitlines()),
                  key=lambda r: r["ROLE_RANK"])
    for rank, r in enumerate(reps):
        assert r == {"TORCHELASTIC_RUN_ID": "te1", "GROUP_WORLD_SIZE": "1",
                     "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default",
                     "TORCHELASTIC_USE_AGENT_STORE": None, "launched": True}


# ---------------------------------------------------------------------------- dry runs
def test_dry_run_over_ssh_shows_every_ranks_argv_cwd_env_quoted(tmp_path):
    res = subprocess.run(ddlrun_argv("--dry-run", "-H", "h1:2,h2", "-x", "EVIL=a\nrank 9 forged",
                                     "-x", "SP=a b", "python", "t.py", "--lr", "it's"),
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "[2] argv: python t.py --lr 'it'\"'\"'s'" in out
    assert f"[0] cwd: {tmp_path}" in out
    assert "EVIL=$'a\\nrank 9 forged'" in out and "SP='a b'" in out
    assert not any(line.startswith("rank 9") for line in out.splitlines())
    assert "DDL_JOB_SECRET=<secret>" in out
    assert "slots of h2 are unknown" in out and "slots of h1" not in out
    assert "[1] env: the remote login environment + common env + " in out


def test_remote_hosts_probe_the_programs_python_too():
    from ddlrun.backends import LaunchOptions
    from ddlrun.backends.ssh import SshBackend
    from ddlrun.hosts import HostSpec
    from ddlrun.preflight import ProbeResult, check

    cmd = SshBackend(LaunchOptions(remote_python="/py")).probe_cmd(HostSpec("h1"), (), None,
                                                                   "python3")
    assert cmd[-1] == "/py -m ddlrun.agent --probe --python python3"
    bad = ProbeResult("h1", {"python_problem": "the program's interpreter 'python3' cannot "
                             "import ddl: ..."}, None)
    assert check([bad]) == ["h1: the program's interpreter 'python3' cannot import ddl: ..."]


def test_torchrun_module_and_no_python():
    c = cfg("--nproc-per-node", "2", "-m", "pkg.train", "--mode", "x")
    assert c.request.program == (sys.executable, "-m", "pkg.train", "--mode", "x")
    assert c.request.mode is None  # after the module, the module's
    assert cfg("--module", "pkg").request.program == (sys.executable, "-m", "pkg")
    assert cfg("--no-python", "train.py", "-v").request.program == ("train.py", "-v")
    assert cfg("train.py").request.program == (sys.executable, "train.py")
    for bad, says in ((("-m",), "needs a module"), (("-m", "--no-python", "p"), "not both"),
                      # ddlrun's -m once took DDL's mode letters: refused, not "python -m b"
                      (("-m", "b", "-n", "2", "train.py"), "--mode b"),
                      (("-m", "b:4x2", "train.py"), "--mode b:4x2")):
        with pytest.raises(UsageError, match=says):
            cfg(*bad)


def test_ddl_mode_keeps_mode_and_ibms_dash_mode():
    assert cfg("--mode", "b", "p").request.mode == "b"
    assert cfg("-mode", "b:2x2", "-n", "4", "p").request.mode == "b:2x2"
    assert cfg("-mode=n", "p").request.mode == cfg("--mode=n", "p").request.mode == "n"


def test_open_mpi_placement_flags():
    for flag in ("-npernode", "--npernode", "-N"):
        assert cfg(flag, "2", "p").request.accelerators == 2
    assert cfg("--bind-to", "none", "--map-by", "slot", "p").request.program == ("p",)
    for argv, says in ((("--bind-to", "core"), "--bind-gpus"),
                       (("--bind-to", "socket"), "--bind-gpus"),
                       (("--map-by", "node"), "--npernode N"),
                       (("--map-by", "ppr:2:node"), "--rankfile"),
                       (("-npernodes", "2"), "unknown option -npernodes"),
                       (("-np2",), "unknown option -np2")):
        with pytest.raises(UsageError, match=says):
            cfg(*argv, "p")
    assert cfg("-n4", "p").request.nproc == 4  # a value glued on a short option still is


def test_config_from_args_reads_no_file(tmp_path, monkeypatch):
    """The hostfile's lines come from ``steps.read_files``; config_from_args opens nothing."""
    from ddlrun.config import Files
    from ddlrun.steps import read_files

    path = str(tmp_path / "hosts")
    opened = []
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a) or 1 / 0)
    c = config_from_args(parse_args(["--hostfile", path, "p"]), {},
                         Files({path: ("h1 slots=2", "h2:3")}))
    assert [(h.name, h.slots) for h in c.request.hosts] == [("h1", 2), ("h2", 3)]
    assert opened == []
    monkeypatch.undo()
    with pytest.raises(UsageError, match=f"cannot read --hostfile {path}"):
        read_files([(path, "--hostfile")])


def test_what_a_python_command_runs_is_read_as_python_reads_it():
    """The program check before any rank starts (steps.check_program) reads python's own
    options, combined ones included: a valid command is never refused as a missing file."""
    from ddlrun.steps import python_target

    cases = {
        ("-um", "pkg.train"): ("module", "pkg.train"),
        ("-Esm", "x"): ("module", "x"),
        ("-uc", "print(1)"): None,
        ("-c", "x"): None,
        ("-",): None,
        ("-W", "ignore", "t.py"): ("file", "t.py"),
        ("-Wignore", "t.py"): ("file", "t.py"),
        ("-X", "dev", "-u", "t.py"): ("file", "t.py"),
        ("-OO", "t.py", "-m", "x"): ("file", "t.py"),
        ("--check-hash-based-pycs", "always", "t.py"): ("file", "t.py"),
        ("--", "t.py"): ("file", "t.py"),
    }
    got = {args: python_target(("python", *args)) for args in cases}
    assert got == cases
