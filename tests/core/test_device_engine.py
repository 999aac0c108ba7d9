"""The device engine (torch process groups per grid line): NCCL for CUDA tensors, and the
same code over Gloo on CPU tensors (DDL_DEVICE_ENGINE=gloo), which is how it runs here."""

import pytest

from tests.core.util import hosts_env, reports, run_worker

torch = pytest.importorskip("torch")
SIZES = "0,1,33,7001"


def _run(n, per, options="", device="cpu", **env):
    pre = hosts_env(n, per, DDL_OPTIONS=options)
    res = run_worker("device_collectives.py", n, device, SIZES, per_rank_env=pre,
                     env=dict(dict(DDL_CHUNK_BYTES="8K"), **env), timeout=300)
    reps = reports(res)
    for r in reps:
        assert r["failed"] == [], r
    assert len({r["digest"] for r in reps}) == 1, "ranks got different bytes"
    return reps


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_device_path_on_one_host(n):
    reps = _run(n, n, DDL_DEVICE_ENGINE="gloo")
    assert reps[0]["device"] == f"gloo: dim0 x{n} gloo"


def test_gloo_device_path_pipelined_over_two_hosts_of_two():
    reps = _run(4, 2, "-mode n:2x2", DDL_DEVICE_ENGINE="gloo")
    assert reps[0]["device"] == "gloo: dim0 x2 gloo -> dim1 x2 gloo"


@pytest.mark.slow
def test_gloo_device_path_three_hosts_of_two():
    reps = _run(6, 2, "-mode n:2x3", DDL_DEVICE_ENGINE="gloo")
    assert reps[0]["device"] == "gloo: dim0 x2 gloo -> dim1 x3 gloo"


def test_host_dtypes_mix_with_the_device_path():
    # int16 has no torch-group reduction: it is staged through the shared-memory engine
    # in the same job, in order with the rest.
    for r in reports(run_worker("torch_tensors.py", 3, env=dict(DDL_DEVICE_ENGINE="gloo"))):
        assert r["failed"] == []


def test_cpu_tensors_stay_on_the_host_engines_by_default():
    reps = reports(run_worker("torch_tensors.py", 2))
    assert all(r["failed"] == [] for r in reps)


needs_gpus = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
         and torch.distributed.is_nccl_available()),
    reason="needs 2 CUDA devices and NCCL")


@pytest.mark.gpu
@needs_gpus
def test_nccl_every_collective_two_ranks():
    reps = _run(2, 2, device="cuda", DDL_DEVICE_ENGINE="nccl")
    assert reps[0]["device"] == "nccl: dim0 x2 nccl"


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 4
                         and torch.distributed.is_nccl_available()),
                    reason="needs 4 CUDA devices and NCCL")
def test_nccl_two_dimensions():
    reps = _run(4, 2, "-mode n:2x2", device="cuda", DDL_DEVICE_ENGINE="nccl")
    assert reps[0]["device"] == "nccl: dim0 x2 nccl -> dim1 x2 nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: NCCL can run")
def test_nccl_insisted_on_without_a_gpu_is_refused_at_init_on_every_rank():
    import subprocess
    import sys

    from ddl.engines.device import nccl_refusal

    why = nccl_refusal()
    expected = ("no CUDA GPU is visible" if torch.version.cuda else "is a CPU build")
    assert why and expected in why, why
    out = subprocess.run([sys.executable, "-m", "ddlrun", "-n", "2", sys.executable, "-c",
                          "import ddl; ddl.init(); print('initialised')"],
                         env={**__import__("os").environ, "DDL_DEVICE_ENGINE": "nccl"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stdout
    assert "initialised" not in out.stdout
    assert f"DDL_DEVICE_ENGINE=nccl: {why}" in out.stdout + out.stderr, out.stdout + out.stderr
