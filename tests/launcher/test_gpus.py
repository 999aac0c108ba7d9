"""GPUs: ranks see every GPU the user left visible (local_rank indexes them, as under torchrun
and horovodrun); the user's CUDA_VISIBLE_DEVICES is the set to use; --bind-gpus narrows each
rank to its GPU; DeepSpeed's --include/--exclude pick hosts and GPUs. Tested with a fake
nvidia-smi on PATH, no GPU needed."""

import json
import os
import stat

import pytest
from ddlrun_testlib import PY, WORKER, run_ddlrun

from ddlrun.cli import build_parser, config_from_args
from ddlrun.errors import UsageError
from ddlrun.hosts import HostSpec, parse_selection
from ddlrun.plan import HostFacts, HostGpus, Request, make_plan
from ddlrun.preflight import count_gpus

PROG = ("python", "train.py")


def plan_of(req, facts, environ=None):
    return make_plan(req, facts, "job_1", 29500, environ or {})


def cvd(plan):
    return [r.env_dict().get("CUDA_VISIBLE_DEVICES") for r in plan.ranks]


def four(*names):
    return {n: HostFacts(cores=8, gpus=4) for n in names}


def test_default_leaves_cuda_visible_devices_alone_one_rank_per_gpu():
    p = plan_of(Request(PROG, (HostSpec("a"), HostSpec("b"))), four("a", "b"))
    assert p.world_size == 8 and cvd(p) == [None] * 8
    assert [r.local_rank for r in p.ranks] == [0, 1, 2, 3] * 2  # set_device(local_rank)


def test_users_cuda_visible_devices_is_the_set_to_use():
    local = (HostSpec("localhost"),)
    p = plan_of(Request(PROG, local), four("localhost"), {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert p.world_size == 2 and cvd(p) == [None, None]  # inherited as the user has it
    remote = Request(PROG, (HostSpec("a"), HostSpec("b")),
                     env=(("CUDA_VISIBLE_DEVICES", "1,2,3"),))
    p = plan_of(remote, four("a", "b"))
    assert p.world_size == 6 and set(cvd(p)) == {"1,2,3"}  # -x passes it on, unchanged
    p = plan_of(Request(PROG, local), four("localhost"), {"CUDA_VISIBLE_DEVICES": ""})
    assert p.world_size == 1  # the user hid every GPU
    # on a host without GPUs a CUDA_VISIBLE_DEVICES does not make slots
    p = plan_of(Request(PROG, local), {"localhost": HostFacts()}, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert p.world_size == 1


def test_bind_gpus_gives_each_rank_its_gpu():
    p = plan_of(Request(PROG, (HostSpec("a"),), bind_gpus=True), four("a"))
    assert cvd(p) == ["0", "1", "2", "3"]
    p = plan_of(Request(PROG, (HostSpec("localhost"),), bind_gpus=True), four("localhost"),
                {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert cvd(p) == ["2", "3"]
    p = plan_of(Request(PROG, (HostSpec("a", 3),), bind_gpus=True), {"a": HostFacts(gpus=2)})
    assert cvd(p) == ["0", "1", "0"]  # more ranks than GPUs: they share, round robin
    p = plan_of(Request(PROG, (HostSpec("a", 2),), bind_gpus=True), {})
    assert cvd(p) == [None, None]  # no GPUs known: nothing to bind


def test_include_exclude_deepspeed_syntax():
    assert parse_selection("h1:0,1@h2") == (("h1", ("0", "1")), ("h2", None))
    for bad in ("h1:a", "h1:0@h1", "-h:0", "h1:"):
        with pytest.raises(UsageError):
            parse_selection(bad)
    inc = Request(PROG, (HostSpec("a"), HostSpec("b")), include=(("a", ("0", "2")),))
    p = plan_of(inc, four("a", "b"))
    assert cvd(p) == ["0,2", "0,2", None, None, None, None]  # local_rank indexes 0,2
    exc = Request(PROG, (HostSpec("a"),), exclude=(("a", ("1",)),))
    assert cvd(plan_of(exc, four("a"))) == ["0,2,3"] * 3
    both = Request(PROG, (HostSpec("a"),), exclude=(("a", ("1",)),), bind_gpus=True)
    assert cvd(plan_of(both, four("a"))) == ["0", "2", "3"]
    slots = Request(PROG, (HostSpec("a", 4),), exclude=(("a", ("3",)),))
    assert cvd(plan_of(slots, {})) == ["0,1,2"] * 3  # not probed: slots are the GPUs
    with pytest.raises(UsageError, match="GPUs of a are unknown"):
        plan_of(Request(PROG, (HostSpec("a"),), exclude=(("a", ("1",)),)), {})


def cfg(*argv, environ=None):
    return config_from_args(build_parser().parse_args(list(argv)), environ or {})


def test_include_exclude_pick_hosts():
    assert [h.name for h in cfg("-H", "a,b,c", "--include", "a@c:1", "p").request.hosts] == [
        "a", "c"]
    assert [h.name for h in cfg("-H", "a,b,c", "--exclude", "b@c:0", "p").request.hosts] == [
        "a", "c"]
    with pytest.raises(UsageError, match="not one of the job's hosts"):
        cfg("-H", "a,b", "--include", "z", "p")
    with pytest.raises(UsageError, match="not both"):
        cfg("-H", "a", "--include", "a", "--exclude", "a:1", "p")
    assert cfg("--include", "localhost:1", "p").request.include == (("localhost", ("1",)),)


def test_rankenv_carries_the_gpu_rule():
    assert HostGpus.decode(HostGpus(("2", "3"), "bind").encode()) == HostGpus(("2", "3"), "bind")
    assert HostGpus.decode("leave:") == HostGpus()


# ---------------------------------------------------------------------------- end to end
@pytest.fixture
def fake_smi(tmp_path):
    """A fake ``nvidia-smi -L`` listing FAKE_GPUS (default 4) GPUs, first on PATH."""
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text('#!/bin/sh\n[ "$1" = "-L" ] || exit 2\ni=0\n'
                   'while [ $i -lt "${FAKE_GPUS:-4}" ]; do\n'
                   '  echo "GPU $i: NVIDIA H200 (UUID: GPU-fake-$i)"; i=$((i+1)); done\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{exe.parent}:{env.get('PATH', '/usr/bin')}"
    return env


def rank_envs(res):
    assert res.returncode == 0, res.stderr
    out = {}
    for line in res.stdout.splitlines():
        tag, _, body = line.partition(" ")
        out[int(tag.strip("[]"))] = json.loads(body)
    return [out[r] for r in sorted(out)]


def test_fake_nvidia_smi_is_counted(fake_smi, monkeypatch):
    monkeypatch.setenv("PATH", fake_smi["PATH"])
    assert count_gpus() == 4


def test_ranks_see_all_gpus_by_default_and_follow_the_users_set(fake_smi, marker):
    envs = rank_envs(run_ddlrun(PY, WORKER, "env", marker, env=fake_smi))
    assert len(envs) == 4  # one rank per GPU nvidia-smi lists
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [None] * 4
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    envs = rank_envs(run_ddlrun(PY, WORKER, "env", marker,
                                env={**fake_smi, "CUDA_VISIBLE_DEVICES": "2,3"}))
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2,3", "2,3"]  # the user's, untouched
    envs = rank_envs(run_ddlrun("--bind-gpus", PY, WORKER, "env", marker,
                                env={**fake_smi, "CUDA_VISIBLE_DEVICES": "2,3"}))
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "3"]
    envs = rank_envs(run_ddlrun("--exclude", "localhost:0", PY, WORKER, "env", marker,
                                env=fake_smi))
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1,2,3"] * 3
