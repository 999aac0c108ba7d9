"""The DDL multi-dimensional allreduce across "hosts" simulated on one machine: each rank
is told its host (DDL_HOST_INDEX, LOCAL_RANK, LOCAL_WORLD_SIZE), so dimensions inside a
host run on shared memory and dimensions across hosts on Gloo over loopback. The real
multi-host runs (network namespaces + sshd through ddlrun) are in test_netns_ddl.py."""

import pytest

from tests.core.util import hosts_env, reports, run_worker

pytest.importorskip("torch")
SIZES = "0,3,1000,70001"


def _hosts(n, per, options, sizes=SIZES, **env):
    pre = hosts_env(n, per, DDL_OPTIONS=options)
    res = run_worker("collectives.py", n, sizes, per_rank_env=pre,
                     env=dict(dict(DDL_CHUNK_BYTES="64K"), **env), timeout=400)
    reps = reports(res)
    assert len({r["digest"] for r in reps}) == 1, "ranks got different bytes"
    assert {r["engine"] for r in reps} == {"ddl/gloo"}
    assert all(r["checks"] > 0 for r in reps), reps
    return reps


FEW = "bool,int8,float16,float64,complex64"


def test_two_hosts_of_two_every_dtype():
    _hosts(4, 2, "-mode r:2x2")


@pytest.mark.parametrize("options", ["-mode n:2x2", "-mode b:2x2", "-mode p:2x2",
                                     "-mode rn:2x2 -dump_iter 7", ""])
def test_two_hosts_of_two_every_mode(options):
    _hosts(4, 2, options, CHECK_DTYPES=FEW)


@pytest.mark.parametrize("options", ["-mode b:1x4", "-mode b:4x1"])
def test_degenerate_grids(options):
    _hosts(4, 2, options, "0,3,70001", CHECK_DTYPES=FEW)


@pytest.mark.slow
def test_three_dimensions_oversubscribed():
    _hosts(8, 2, "-mode r:2x2x2", "0,3,1000,70001", CHECK_DTYPES=FEW)


@pytest.mark.slow
def test_three_hosts_of_two_with_many_chunks():
    _hosts(6, 2, "-mode b:2x3", "0,7,100001", DDL_CHUNK_BYTES="32K", CHECK_DTYPES=FEW)


@pytest.mark.parametrize("env", [{}, {"DDL_DEVICE_ENGINE": "gloo"}], ids=["host", "device"])
def test_shutdown_leaves_no_communication_thread(env):
    """Gloo's worker threads must be gone when ddl.shutdown() returns: left to the
    interpreter's exit, one that drops a tensor then aborts the process (seen in CI as
    "terminate called without an active exception" after every rank had finished)."""
    for r in reports(run_worker("threads_left.py", 4, per_rank_env=hosts_env(4, 2), env=env)):
        assert r["during"] > r["before"], r
        # rank 0's rendezvous store (and its thread) goes with the session too: the next
        # init() opens its own on the same port
        assert r["after"] == r["before"], r


def test_grid_that_does_not_match_the_job_is_refused():
    res = run_worker("collectives.py", 2, "1", env=dict(DDL_OPTIONS="-mode b:2x2"))
    assert [r.returncode for r in res] == [1, 1], [r.stderr for r in res]
    assert all("describes 4 ranks but the job has 2" in r.stderr for r in res)


def test_bad_mode_string_is_refused():
    res = run_worker("collectives.py", 2, "1", env=dict(DDL_OPTIONS="-mode q:2"))
    assert [r.returncode for r in res] == [1, 1], [r.stderr for r in res]
    assert all("unknown mode letter 'q'" in r.stderr for r in res)


def test_rank_killed_on_another_host_makes_everyone_raise():
    pre = hosts_env(4, 2, DDL_OPTIONS="-mode r:2x2")
    res = run_worker("failures.py", 4, "kill", "300000", per_rank_env=pre,
                     env=dict(DDL_TIMEOUT="60"), timeout=120)
    assert res[3].returncode == -9
    for r in reports([x for x in res if x.rank != 3]):
        assert r["kind"] in ("DDLPeerError", "DDLTimeoutError"), r
        assert r["took"] < 20, "a dead peer across hosts must be noticed long before the timeout"
        assert r["later"] in ("DDLError", "DDLPeerError", "DDLTimeoutError"), r  # stays failed


def _without_mpi4py(tmp_path):
    shadow = tmp_path / "mpi4py"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('mpi4py is not installed here')\n")
    return str(tmp_path)


def test_mpirun_job_without_mpi4py_falls_back_to_gloo(tmp_path):
    # launched by mpirun (its env says so) but mpi4py cannot be imported: the cross-host
    # dimension runs on Gloo instead, with the same results
    reps = _hosts(4, 2, "-mode b:2x2", "0,3,70001", CHECK_DTYPES=FEW,
                  PYTHONPATH=_without_mpi4py(tmp_path), OMPI_COMM_WORLD_SIZE="4")
    assert len(reps) == 4


def test_asking_for_mpi_without_mpi4py_is_a_clear_error(tmp_path):
    pre = hosts_env(2, 1)
    res = run_worker("collectives.py", 2, "1", per_rank_env=pre,
                     env=dict(DDL_TRANSPORT="mpi", PYTHONPATH=_without_mpi4py(tmp_path)))
    assert [r.returncode for r in res] == [1, 1], [r.stderr for r in res]
    assert all("the mpi engine needs mpi4py" in r.stderr for r in res)


@pytest.mark.parametrize("n,per,mode,rows", [
    (2, 1, "", 2), (4, 2, "-mode r:2x2", 2),  # the second: ddlrun's grid for 2 hosts of 2
    # one rank per host, two dimensions across hosts: a row from every rank
    (4, 1, "-mode r:2x2", 4),
    # the host's ranks, then two dimensions across hosts: a row per host on its own line
    (8, 2, "-mode r:2x2x2", 4),
    # two dimensions inside a host: a row from every rank
    (8, 4, "-mode r:2x2x2", 8),
], ids=["2x1", "2x2", "2x2-across", "3d", "3d-two-inside"])
def test_core_calls_that_differ_across_hosts_raise_on_every_rank(n, per, mode, rows):
    """A core call carries a key across hosts (engines/identity_round.py): a float32 and an
    int32 allreduce of one size used to pair silently (garbage), two sizes aborted the
    process inside Gloo. Each case must raise on every rank, and the job go on."""
    env = {"DDL_TIMEOUT": "20", **({"DDL_OPTIONS": mode} if mode else {})}
    reps = reports(run_worker("cross_host_mismatch.py", n, env=env,
                              per_rank_env=hosts_env(n, per)))
    assert [r["round_rows"] for r in reps] == [rows] * n
    cases = ("dtype", "numel", "op", "numel_large", "dtype_large", "kind", "root", "rows",
             "reduce_scatter")
    for r in reps:
        for case in cases:
            assert r[case] == "DDLMismatchError", (r["rank"], case, r[case])
            assert r[f"{case}_after"], (r["rank"], case)
        assert "ranks on different hosts called different collectives" in r["dtype_msg"]


def _profile(path, alpha):
    import json

    path.write_text(json.dumps({"version": 1, "machine": path.stem, "dims": [
        {"index": 0, "engine": "gloo", "size": 4, "algorithm": "native", "alpha_s": alpha,
         "beta_s_per_byte": 1e-9, "gamma_s_per_byte": 3e-10}]}))
    return str(path)


@pytest.mark.parametrize("case", ["profile", "chunk", "grid", "dump_iter"])
def test_ranks_that_plan_with_different_settings_stop_at_start_on_every_rank(tmp_path, case):
    """Mode b prices the algorithms with the profile each host reads (DDL_COST_PROFILE):
    with rank 0's file a 4-rank dimension picks halving-doubling at 1 MiB, with rank 2's
    Gloo's own; the ranks then ran different steps for the same call and hung until the
    timeout. Every setting the steps follow from is compared at start instead."""
    from ddl import cost

    a, b = _profile(tmp_path / "a.json", 1e-3), _profile(tmp_path / "b.json", 0.0)
    picks = {cost.best(["ring", "native", "hd"], 4, 1 << 20, cost.load_profile(p).link(0, "gloo"))
             for p in (a, b)}
    assert picks == {"hd", "native"}  # the two files really make different choices
    mine, theirs = {
        "profile": ({"DDL_COST_PROFILE": a}, {"DDL_COST_PROFILE": b}),
        "chunk": ({"DDL_CHUNK_BYTES": "64K"}, {"DDL_CHUNK_BYTES": "1M"}),
        "grid": ({}, {"DDL_OPTIONS": "-mode r:4"}),
        "dump_iter": ({}, {"DDL_OPTIONS": "-mode b:4 -dump_iter 3"}),
    }[case]
    pre = [dict(e, **(mine if r < 2 else theirs)) for r, e in enumerate(hosts_env(4, 1))]
    res = run_worker("collectives.py", 4, "1000,300001", per_rank_env=pre,
                     env=dict(DDL_OPTIONS="-mode b:4", DDL_TIMEOUT="60"), timeout=120)
    named = {"profile": "DDL_COST_PROFILE", "chunk": "DDL_CHUNK_BYTES", "grid": "-mode",
             "dump_iter": "-dump_iter"}[case]
    for r in res:
        assert r.returncode == 1, r.stderr[-2000:]
        assert "DDLConfigError" in r.stderr and "Timeout" not in r.stderr, r.stderr[-2000:]
        assert f"plan collectives with different {named}" in r.stderr, r.stderr[-2000:]
    if case == "profile":
        assert "rank(s) [2, 3] read other values than rank 0" in res[0].stderr
    if case == "chunk":
        assert "rank 0 has 65536, rank 2 has 1048576" in res[3].stderr


def test_the_same_profile_in_two_files_is_the_same_plan(tmp_path):
    a = _profile(tmp_path / "a.json", 1e-3)
    b = _profile(tmp_path / "b.json", 1e-3)
    pre = [dict(e, DDL_COST_PROFILE=a if r < 2 else b) for r, e in enumerate(hosts_env(4, 1))]
    res = run_worker("collectives.py", 4, "1000,300001", per_rank_env=pre,
                     env=dict(DDL_OPTIONS="-mode b:4", CHECK_DTYPES=FEW), timeout=300)
    reps = reports(res)
    assert len({r["digest"] for r in reps}) == 1
