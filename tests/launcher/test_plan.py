"""Planning is pure: placement, env contract, DDL_OPTIONS, rankfile."""

import pytest

from ddlrun.errors import UsageError
from ddlrun.hosts import HostSpec
from ddlrun.plan import (
    HostFacts,
    Request,
    assign,
    describe,
    grid,
    make_plan,
    parse_rankfile,
    rankfile_lines,
)

PROG = ("python", "train.py")


def hosts(*spec):
    return tuple(HostSpec(n, s) for n, s in spec)


def plan_of(req, facts=None, environ=None):
    return make_plan(req, facts or {}, "job_1", 29500, environ or {})


def test_fill_host_by_host_and_not_enough_slots_message():
    req = Request(PROG, hosts(("a", 2), ("b", 2)), nproc=3)
    assert assign(req, {}) == [(0, 0), (0, 1), (1, 0)]
    with pytest.raises(UsageError, match=r"asked for 5 ranks .* only 4 slots \(a:2, b:2\)"):
        assign(Request(PROG, hosts(("a", 2), ("b", 2)), nproc=5), {})


def test_horovodruns_worker_env_for_every_rank():
    """What ``horovodrun --gloo`` gives each worker, so Horovod code that reads it (its own
    test suite) sees a launched job; the cross rank counts the hosts that have a rank of
    this local rank, as Horovod's does on uneven hosts."""
    p = plan_of(Request(PROG, hosts(("a", 2), ("b", 1), ("c", 2))))
    got = [{k[len("HOROVOD_"):]: v for k, v in r.env_dict().items() if k.startswith("HOROVOD_")}
           for r in p.ranks]
    expect = [(0, 0, 2, 0, 3), (1, 1, 2, 0, 2), (2, 0, 1, 1, 3), (3, 0, 2, 2, 3),
              (4, 1, 2, 1, 2)]
    assert got == [{"RANK": str(r), "SIZE": "5", "LOCAL_RANK": str(lr), "LOCAL_SIZE": str(ls),
                    "CROSS_RANK": str(cr), "CROSS_SIZE": str(cs)}
                   for r, lr, ls, cr, cs in expect]


def test_slot_defaults_accelerators_gpus_nproc():
    two = hosts(("a", None), ("b", None))
    assert len(assign(Request(PROG, two), {})) == 2  # one per host
    assert len(assign(Request(PROG, two), {"a": HostFacts(gpus=4), "b": HostFacts(gpus=4)})) == 8
    assert len(assign(Request(PROG, two, accelerators=3), {})) == 6
    assert len(assign(Request(PROG, hosts(("localhost", None)), nproc=5), {})) == 5


def test_env_contract_for_every_rank():
    facts = {"a": HostFacts(cores=8, gpus=2), "b": HostFacts(cores=8, gpus=2)}
    p = plan_of(Request(PROG, hosts(("a", 2), ("b", 2))), facts)
    assert p.world_size == 4 and p.master_addr == "a" and p.ddl_options == "-mode r:2x2"
    envs = [r.env_dict() for r in p.ranks]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["DDL_HOST_INDEX"] for e in envs] == ["0", "0", "1", "1"]
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in envs)  # all GPUs visible
    assert [e["ROLE_RANK"] for e in envs] == ["0", "1", "2", "3"]
    for e in envs:
        assert e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2"
        assert e["MASTER_ADDR"] == "a" and e["MASTER_PORT"] == "29500"
        assert e["DDL_JOB_ID"] == "job_1" and e["DDL_HOSTS"] == "a,b"
        assert e["OMP_NUM_THREADS"] == "4"
        assert e["TORCHELASTIC_RUN_ID"] == "job_1" and e["GROUP_WORLD_SIZE"] == "2"
        assert e["ROLE_WORLD_SIZE"] == "4" and e["ROLE_NAME"] == "default"
        assert "TORCHELASTIC_USE_AGENT_STORE" not in e
    assert all(r.argv == PROG for r in p.ranks)


def test_no_gpus_no_cuda_visible_devices_and_user_omp_wins():
    req = Request(PROG, hosts(("localhost", 2)), env=(("OMP_NUM_THREADS", "3"), ("FOO", None)))
    p = plan_of(req, {"localhost": HostFacts(cores=2)}, {"FOO": "bar"})
    for r in p.ranks:
        e = r.env_dict()
        assert "CUDA_VISIBLE_DEVICES" not in e
        assert e["OMP_NUM_THREADS"] == "3" and e["FOO"] == "bar"
        assert e["MASTER_ADDR"] == "127.0.0.1"
    p = plan_of(Request(PROG, hosts(("localhost", 2))), {}, {"OMP_NUM_THREADS": "7"})
    assert all("OMP_NUM_THREADS" not in r.env_dict() for r in p.ranks)  # inherited as is


def test_ddl_options_from_the_environment_are_kept_not_replaced():
    """DDL_OPTIONS set where ddlrun runs (``DDL_OPTIONS='-dump_iter 4' ddlrun ...``) reach
    the ranks after the grid's -mode and before --ddloption; a -mode in it is the job's
    mode unless -m/--mode says otherwise."""
    eight = hosts(*[(f"h{i}", 4) for i in range(8)])
    env = {"DDL_OPTIONS": "-dump_iter 4"}
    assert plan_of(Request(PROG, eight), environ=env).ddl_options == "-mode r:4x8 -dump_iter 4"
    req = Request(PROG, eight, ddloptions=("-dbg_level 1",))
    assert plan_of(req, environ=env).ranks[0].env_dict()["DDL_OPTIONS"] == (
        "-mode r:4x8 -dump_iter 4 -dbg_level 1")
    env = {"DDL_OPTIONS": "-dump_iter 4 -mode b:8x4"}
    assert plan_of(Request(PROG, eight), environ=env).ddl_options == "-dump_iter 4 -mode b:8x4"
    assert plan_of(Request(PROG, eight, mode="p"), environ=env).ddl_options == (
        "-mode p:4x8 -dump_iter 4")
    assert plan_of(Request(PROG, eight, no_ddloptions=True), environ=env).ddl_options is None


def test_ddl_options_grid_racks_aisles_mode_and_opt_out():
    eight = hosts(*[(f"h{i}", 4) for i in range(8)])
    assert plan_of(Request(PROG, eight)).ddl_options == "-mode r:4x8"
    assert plan_of(Request(PROG, eight, racks=2, mode="b")).ddl_options == "-mode b:4x4x2"
    assert plan_of(Request(PROG, eight, racks=4, aisles=2)).ddl_options == "-mode r:4x2x2x2"
    req = Request(PROG, eight, mode="r:32", ddloptions=("-dump_iter 10", "-dbg_level 1"))
    assert plan_of(req).ddl_options == "-mode r:32 -dump_iter 10 -dbg_level 1"
    assert plan_of(Request(PROG, eight, no_ddloptions=True)).ddl_options is None
    assert "DDL_OPTIONS" not in plan_of(Request(PROG, eight, no_ddloptions=True)).ranks[0].env
    uneven = hosts(("a", 3), ("b", 1))
    assert plan_of(Request(PROG, uneven)).ddl_options == "-mode r:4"
    for bad in (dict(mode="x"), dict(mode="b:4x4"), dict(racks=3)):
        with pytest.raises(UsageError):
            plan_of(Request(PROG, eight, **bad))
    # the core's own rule and words (options.grid_mismatch), before anything starts
    with pytest.raises(UsageError, match=r"^--mode 'b:4x4': -mode b:4x4 describes 16 ranks "
                                         r"but the job has 32$"):
        plan_of(Request(PROG, eight, mode="b:4x4"))
    assert grid(1, 2, None, None) == [2] and grid(1, 1, None, None) == [1]


def test_network_interface_and_tcp_env():
    req = Request(PROG, hosts(("a", 1), ("b", 1)), network_interface="eth1", tcp=True)
    p = plan_of(req, {"a": HostFacts(address="10.0.0.1")})
    e = p.ranks[1].env_dict()
    assert e["MASTER_ADDR"] == "10.0.0.1"
    assert e["GLOO_SOCKET_IFNAME"] == "eth1" == e["NCCL_SOCKET_IFNAME"]
    assert e["NCCL_IB_DISABLE"] == "1"


def test_rankfile_roundtrip_and_user_rankfile_placement():
    p = plan_of(Request(PROG, hosts(("a", 2), ("b", 2))))
    lines = rankfile_lines(p, {"a": 1, "b": 8})
    assert lines == ["rank 0=a slot=0", "rank 1=a slot=0", "rank 2=b slot=0", "rank 3=b slot=1"]
    placed = parse_rankfile(["# mine", "rank 0=b slot=0", "rank 1=a slot=1", "rank 2=b slot=1"])
    p = plan_of(Request(PROG, hosts(("a", None), ("b", None)), rankfile=placed))
    assert [(r.rank, r.host, r.local_rank) for r in p.ranks] == [(1, "a", 0), (0, "b", 0),
                                                                 (2, "b", 1)]
    assert p.layout == (1, 0, 1)
    with pytest.raises(UsageError, match="rankfile:2"):
        parse_rankfile(["rank 0=a", "rank 1=a;rm"])
    with pytest.raises(UsageError, match="not in the hosts"):
        plan_of(Request(PROG, hosts(("a", None)), rankfile=((0, "z"),)))


def test_plan_validation():
    with pytest.raises(UsageError, match="job id"):
        make_plan(Request(PROG, hosts(("a", 1))), {}, "bad/id", 29500, {})
    with pytest.raises(UsageError, match="master-port"):
        make_plan(Request(PROG, hosts(("a", 1))), {}, "j", 70000, {})
    with pytest.raises(UsageError, match="-x"):
        plan_of(Request(PROG, hosts(("a", 1)), env=(("A B", "1"),)))
    with pytest.raises(UsageError, match="no program"):
        plan_of(Request((), hosts(("a", 1))))
    text = describe(plan_of(Request(PROG, hosts(("a", 1), ("b", 1)))))
    assert "host 1 b: ranks 1" in text and "[1] argv: python train.py" in text
    assert "DDL_HOST_INDEX=1" in text.split("[1] env:")[1]


@pytest.mark.parametrize("mode,ddloptions,inherited,want", [
    (None, (), None, None),
    ("r", (), None, None),
    ("r:2x3", (), None, "r:2x3"),
    # the core takes the last -mode: --ddloption's comes after --mode's
    ("r", ("-mode r:2x2",), None, "r:2x2"),
    ("r:2x2", ("-mode b",), None, None),
    # DDL_OPTIONS' -mode yields to --mode, and comes before --ddloption
    ("r", (), "-mode b:4", None),
    (None, ("-mode r",), "-mode r:2x2", None),
    (None, (), "-dbg 0 -mode p:2x2", "p:2x2"),
])
def test_fixed_grid_is_the_last_mode_the_ranks_would_get(mode, ddloptions, inherited, want):
    from ddlrun.plan_options import fixed_grid

    req = Request(PROG, hosts(("a", 2)), nproc=2, mode=mode, ddloptions=ddloptions)
    assert fixed_grid(req, inherited) == want
