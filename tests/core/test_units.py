"""Pure logic of the core: option strings, env registry, world, reduction kernel."""

import numpy as np
import pytest

from ddl import config, options, topology
from ddl.dtypes import BY_NAME
from ddl.errors import DDLConfigError
from ddl.ops import Average, Max, Min, Product, Sum, check_op, parse_op, reduce_into


@pytest.mark.parametrize("text,mode,grid", [
    ("", "r", None),
    ("-mode b:4x2", "b", (4, 2)),
    ("-mode p:4x8x8 -dump_iter 100 -dbg_level 2", "p", (4, 8, 8)),
    ("-mode n", "n", None),
    ("-mode r:8", "r", (8,)),
    ("-mode rb:4x2", "rb", (4, 2)),
])
def test_options_parse(text, mode, grid):
    o = options.parse(text)
    assert (o.mode, o.grid) == (mode, grid)
    assert options.parse(o.to_string()) == o


@pytest.mark.parametrize("text,msg", [
    ("-mode x:4", "unknown mode letter"),
    ("-mode b:4xa", "positive integers"),
    ("-mode b:0x2", ">= 1"),
    ("-mode rbn:4x2", "3 mode letters for 2 dimensions"),
    ("-mode rb", "needs a grid"),
    ("-mode", "needs a value"),
    ("-dump_iter -1", ">= 0"),
    ("-dbg_level 3", "in 0..2"),
    ("-frobnicate 1", "unknown option"),
    ("-mode 'b:4", "DDL_OPTIONS"),
])
def test_options_errors(text, msg):
    with pytest.raises(DDLConfigError, match=msg):
        options.parse(text)


def test_grid_must_match_world():
    options.check_grid(options.parse("-mode b:4x2"), 8)
    with pytest.raises(DDLConfigError, match="describes 8 ranks but the job has 6"):
        options.check_grid(options.parse("-mode b:4x2"), 6)


def test_config_parses_and_names_bad_values():
    env = {"DDL_SHM_SLOT_BYTES": "2M", "DDL_TIMEOUT": "2.5", "DDL_SHM_FENCES": "1"}
    assert config.get("DDL_SHM_SLOT_BYTES", env) == 2 << 20
    assert config.get("DDL_TIMEOUT", env) == 2.5
    assert config.get("DDL_SHM_FENCES", env) is True
    assert config.get("DDL_SHM_FENCES", {}) is None
    with pytest.raises(DDLConfigError, match="DDL_SHM_WAIT='busy' is invalid"):
        config.get("DDL_SHM_WAIT", {"DDL_SHM_WAIT": "busy"})
    with pytest.raises(DDLConfigError, match="DDL_TIMEOUT"):
        config.get("DDL_TIMEOUT", {"DDL_TIMEOUT": "soon"})
    names = [row.name for row in config.describe()]
    assert len(names) == len(set(names)) and "DDL_OPTIONS" in names


def test_world_from_env():
    w = topology.world_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                 "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                                 "DDL_JOB_ID": "j1"})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.cross_rank, w.cross_size) == (
        3, 4, 1, 2, 1, 2)
    alone = topology.world_from_env({})
    assert (alone.rank, alone.size, alone.local_size) == (0, 1, 1)
    # Started by hand: no id yet (ddl.init agrees a random one through the rendezvous).
    assert topology.world_from_env({"WORLD_SIZE": "2", "MASTER_PORT": "1234"}).job_id == ""


def test_job_id_from_the_process_manager_is_per_job():
    def world(ns, rank):
        return topology.world_from_env({"OMPI_COMM_WORLD_SIZE": "2",
                                        "OMPI_COMM_WORLD_RANK": str(rank),
                                        "PMIX_NAMESPACE": ns})

    a0, a1, b0 = world("prterun-h-101@1", 0), world("prterun-h-101@1", 1), world(
        "prterun-h-202@1", 0)
    assert a0.job_id == a1.job_id != b0.job_id
    assert a0.job_id.startswith("pm") and a0.launched_by_mpi
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
             "SLURM_NTASKS": "2"}
    assert topology.world_from_env(slurm).job_id == topology.world_from_env(
        dict(slurm, SLURM_PROCID="0")).job_id != ""
    # Ranks started by hand inside an mpirun task inherit its variables but are another job.
    assert world("prterun-h-101@1", 0).job_id != topology.world_from_env(
        {"PMIX_NAMESPACE": "prterun-h-101@1", "RANK": "0", "WORLD_SIZE": "2"}).job_id


def test_segment_token_depends_on_the_secret():
    from ddl import identity

    assert identity.segment_token("j", b"s1") != identity.segment_token("j", b"s2")
    assert identity.segment_token("j", None) != identity.segment_token("k", None)
    assert 0 < identity.segment_token("j", b"s1") < 1 << 63


def test_segment_names_carry_a_key_only_the_secret_gives():
    import re

    from ddl.engines import orphans, segments

    assert segments.segment_name("j", 0, "heap1-0") == "ddl-j-h0-heap1-0"  # no secret
    keyed = segments.segment_name("j", 0, "heap1-0", b"s1")
    assert re.fullmatch(r"ddl-j-h0-heap1-0-k[0-9a-f]{16}", keyed)
    # another secret, another segment of the job: another key (one name reveals no other)
    assert keyed != segments.segment_name("j", 0, "heap1-0", b"s2")
    assert keyed[-16:] != segments.segment_name("j", 0, "heap1-1", b"s1")[-16:]
    assert keyed[-16:] != segments.segment_name("j", 1, "heap1-0", b"s1")[-16:]
    # a keyed name still says whose it is (cleanup by job id, and people, find it)
    match = orphans._PARTS.fullmatch(keyed)
    assert match and match.groups() == ("j", "0", "heap1-0", keyed[-16:])


@pytest.mark.parametrize("env,msg", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside"),
    ({"WORLD_SIZE": "0"}, r"WORLD_SIZE='0' is out of range \(allowed: 1\.\.1048576\)"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "5"}, "LOCAL_WORLD_SIZE=5"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "LOCAL_RANK=2"),
    ({"RANK": "one"}, "RANK='one' is invalid"),
])
def test_world_errors(env, msg):
    with pytest.raises(DDLConfigError, match=msg):
        topology.world_from_env(env)


def test_ops_parse_and_check():
    assert parse_op("sum") is Sum and parse_op(2) is Average and parse_op(Max) is Max
    with pytest.raises(DDLConfigError):
        parse_op("median")
    check_op(Average, BY_NAME["float16"])
    check_op(Product, BY_NAME["complex64"])
    with pytest.raises(DDLConfigError, match="Average is not defined for int64"):
        check_op(Average, BY_NAME["int64"])
    with pytest.raises(DDLConfigError, match="Min is not defined for complex"):
        check_op(Min, BY_NAME["complex128"])


def test_reduce_into_aliases_first_term():
    a = np.array([1, 5, 3], np.int32)
    b = np.array([4, 2, 6], np.int32)
    reduce_into(a, [a, b, b], Sum, BY_NAME["int32"])
    assert a.tolist() == [9, 9, 15]
    f = np.array([1.0, 2.0], np.float32)
    reduce_into(f, [f, np.array([3.0, 4.0], np.float32)], Average, BY_NAME["float32"], 2)
    assert f.tolist() == [2.0, 3.0]


def test_bfloat16_matches_torch_rounding():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(10_000, generator=g).to(torch.bfloat16) for _ in range(3)]
    bits = [x.view(torch.int16).numpy().view(np.uint16) for x in xs]
    out = np.empty(10_000, np.uint16)
    reduce_into(out, bits, Sum, BY_NAME["bfloat16"])
    want = (xs[0].float() + xs[1].float() + xs[2].float()).to(torch.bfloat16)
    assert np.array_equal(out, want.view(torch.int16).numpy().view(np.uint16))
    nan = torch.tensor([float("nan"), 1.0]).to(torch.bfloat16).view(torch.int16).numpy()
    reduce_into(out[:2], [nan.view(np.uint16)] * 2, Max, BY_NAME["bfloat16"])
    back = torch.from_numpy(out[:2].view(np.int16)).view(torch.bfloat16)
    assert torch.isnan(back[0]) and back[1] == 1.0


def test_handle_done_callbacks_run_once_on_the_finishing_thread_or_at_once():
    import threading

    from ddl.runtime import Runtime

    rt = Runtime()
    gate = threading.Event()
    seen = []
    h = rt.submit(lambda: gate.wait(5) and 42, "job")
    h.add_done_callback(lambda x: seen.append(("late", x.wait(), threading.current_thread().name)))
    assert seen == []
    gate.set()
    assert h.wait(5) == 42
    rt.drain()
    assert seen == [("late", 42, "ddl-runtime")]
    h.add_done_callback(lambda x: seen.append(("now", x.poll())))  # already done: at once
    assert seen[-1] == ("now", True)
    bad = rt.submit(lambda: 1 / 0, "fails")
    errors = []
    bad.add_done_callback(lambda x: errors.append(x._error))
    rt.drain()
    assert isinstance(errors[0], ZeroDivisionError)
    rt.close()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_average_is_the_sum_divided_bit_for_bit(dtype, n):
    """Average multiplies by 1/n when n is a power of two: that must be x / n exactly,
    subnormals, infinities and NaNs included."""
    fi = np.finfo(dtype)
    rng = np.random.default_rng(n)
    with np.errstate(over="ignore"):
        terms = [rng.standard_normal(4099).astype(dtype) * fi.max / 8 for _ in range(n)]
    terms[0][:6] = [fi.tiny, fi.tiny / 3, fi.max, np.inf, np.nan, -0.0]
    out = np.empty_like(terms[0])
    with np.errstate(all="ignore"):  # overflow to inf is part of the check
        reduce_into(out, terms, Average, BY_NAME[dtype], n)
        want = terms[0].copy()
        for t in terms[1:]:
            np.add(want, t, out=want)
        np.divide(want, n, out=want, casting="unsafe")
    assert np.array_equal(out.view(np.uint8), want.view(np.uint8))


def test_pieces_read_and_write_as_their_concatenation():
    from ddl.tensors import Pieces, copy_flat

    arrays = [np.arange(s, dtype=np.int32) + 100 * k for k, s in enumerate([3, 0, 5, 1, 0, 4])]
    whole = np.concatenate(arrays)
    p = Pieces(arrays)
    assert (p.size, p.nbytes, p.starts[-1]) == (13, 52, 13)
    for lo in range(14):
        for hi in range(lo, 14):
            cuts = p.cuts(lo, hi)
            assert all(s < e for s, e, _ in cuts)  # empty pieces give no cut
            assert [s for s, _, _ in cuts][:1] == ([lo] if hi > lo else [])
            got = np.concatenate([v for _, _, v in cuts]) if cuts else np.zeros(0, np.int32)
            assert np.array_equal(got, whole[lo:hi])
            out = np.empty(hi - lo, np.int32)
            p.copy_to(lo, hi, out)
            assert np.array_equal(out, whole[lo:hi])
    p.copy_from(2, 9, -np.arange(7, dtype=np.int32))
    whole[2:9] = -np.arange(7)
    assert np.array_equal(np.concatenate(arrays), whole)
    flat = np.empty(13, np.int32)
    copy_flat(p, flat)
    assert np.array_equal(flat, whole)
    with pytest.raises(TypeError):
        copy_flat(flat, p)


def test_a_dtype_is_its_table_entry_whatever_copies_it():
    """Dtypes compare by identity (every call's checks); a copy or a pickle round trip
    gives the table's own entry back, so they still compare equal."""
    import copy
    import pickle

    for d in BY_NAME.values():
        assert pickle.loads(pickle.dumps(d)) is d and copy.deepcopy(d) is d
        assert copy.copy(d) is d and d == BY_NAME[d.name]
    assert BY_NAME["float32"] != BY_NAME["float64"]
    assert len({hash(d) for d in BY_NAME.values()}) == len(BY_NAME)


def test_overlap_checks_agree_with_numpy_for_owners_views_and_borrowed_memory():
    """An out= call asks whether the input and the output share memory; two arrays that
    each own theirs are told apart without numpy's exact solver, every other pair (views,
    memory borrowed from a buffer or a tensor) still goes to it."""
    torch = pytest.importorskip("torch")

    from ddl.tensors import overlaps, same_memory

    a, b = np.ones(64, np.float32), np.zeros(64, np.float32)
    raw = bytearray(256)
    x, y = np.frombuffer(raw, np.float32), np.frombuffer(raw, np.float32)[8:]
    t = torch.zeros(64)
    tv = t.numpy()
    pairs = [(a, a), (a, b), (a, a[:]), (a[3:40], a[20:]), (a[:10], a[10:]), (x, y), (x, x),
             (x[:8], y), (tv, t.numpy()), (tv[:5], tv[5:]), (a[:0], a), (np.ones(0), b)]
    for p, q in pairs:
        assert overlaps(p, q) == (np.shares_memory(p, q) if p.size and q.size else False)
        ptr = p.__array_interface__["data"][0]
        same = p.size > 0 and np.may_share_memory(p, q) and ptr == q.__array_interface__["data"][0]
        assert same_memory(p, q) == same


@pytest.mark.parametrize("text,kind", [
    ("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 2000ms for recv operation", "timeout"),
    ("Wait timeout for key ddl/x after 2000 ms", "timeout"),
    ("Connection closed by peer [127.0.0.1]:1234", "peer"),
])
def test_torch_errors_are_classified_case_insensitively(text, kind):
    from ddl.engines.torch_pg import classify
    from ddl.errors import DDLPeerError, DDLTimeoutError

    err = classify(RuntimeError(text + "\nmore"), "rank 1: allreduce on g failed")
    assert isinstance(err, DDLTimeoutError if kind == "timeout" else DDLPeerError)
    assert str(err) == "rank 1: allreduce on g failed: " + text


def test_even_split_is_the_one_rule_of_every_split():
    from ddl import grid, split_rows
    from ddl.algorithms.multidim import chunk_sizes
    from ddl.hvd.fusion import split_evenly

    assert grid.even_split(10, 4) == [3, 3, 2, 2] and grid.even_split(3, 5) == [1, 1, 1, 0, 0]
    assert grid.even_split(0, 2) == [0, 0] and grid.even_split(8, 4) == [2] * 4
    for n in range(20):
        for parts in range(1, 7):
            counts = grid.even_split(n, parts)
            assert sum(counts) == n and max(counts) - min(counts) <= 1
            assert counts == sorted(counts, reverse=True) == split_rows(n, parts)
    assert [len(g) for g in split_evenly(7, 3)] == [3, 2, 2]
    assert sum(chunk_sizes(1000, 64)) == 1000


def test_busbw_has_one_formula():
    from ddl.perf.allreduce import busbw

    assert busbw(10**9, 1.0, 4) == pytest.approx(1.5) and busbw(10**9, 1.0, 1) == 0.0


def test_process_manager_variables_are_registered_and_read_through_config():
    from ddl import identity

    for name in ("OMPI_COMM_WORLD_RANK", "PMI_SIZE", "SLURM_PROCID", "PMIX_NAMESPACE",
                 "SLURM_STEP_ID", "MPI_LOCALNRANKS"):
        assert name in config.REGISTRY
    w = topology.world_from_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                                 "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.launched_by_mpi) == (2, 4, 0, 2, True)
    # horovodrun's workers (ddl under Horovod's own launcher): its variables, read last
    hvd = {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
           "HOROVOD_LOCAL_SIZE": "2"}
    w = topology.world_from_env(hvd)
    assert (w.rank, w.size, w.local_rank, w.local_size, w.host_index) == (3, 4, 1, 2, 1)
    assert topology.world_from_env({**hvd, "RANK": "0", "WORLD_SIZE": "1"}).size == 1
    assert identity.manager_job_id({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": ""}) is None
    assert identity.manager_job_id({"PMIX_NAMESPACE": ""}) is None
    assert identity.manager_job_id({"PMIX_NAMESPACE": "ns"}).startswith("pm")


def test_diagnostics_print_their_line_on_stderr_when_logging_is_unconfigured(capsys):
    import logging

    from ddl import api

    log = logging.getLogger("ddl")
    saved = log.level, list(log.handlers)
    try:
        log.handlers.clear()
        log.setLevel(logging.NOTSET)
        api._show_diagnostics()
        api._show_diagnostics()  # idempotent: one handler
        log.info("[ddl] a line")
        assert capsys.readouterr().err == "[ddl] a line\n" and len(log.handlers) == 1
    finally:
        log.setLevel(saved[0])
        log.handlers[:] = saved[1]


def test_every_spelling_is_a_documented_def_and_runs():
    """api.SPELLINGS: each is a public function of ddl, a real ``def`` with a docstring,
    whose last arguments are name and group; in-place spellings take no ``out``; async
    ones return a Handle whose result is the blocking one's (1-rank world, numpy)."""
    import inspect

    import ddl
    from ddl import api
    from ddl.runtime import Handle

    labels = [fn.__name__ for fn in api.SPELLINGS]
    assert len(set(labels)) == len(labels) == 14
    ddl.init()
    try:
        for spelling in api.SPELLINGS:
            label = spelling.__name__
            async_ = "_async" in label
            fn = getattr(ddl, label)
            assert fn is spelling and fn.__doc__ and inspect.getsourcefile(fn) == api.__file__
            params = list(inspect.signature(fn).parameters)
            assert params[-2:] == ["name", "group"], (label, params)
            assert ("out" in params) == (label in ("allreduce", "allreduce_async")), label
            x = np.arange(6.0).reshape(3, 2)
            arg = [x.copy()] if label.startswith("grouped") else x.copy()
            got = fn(arg, name=f"t.{label}")
            if async_:
                assert isinstance(got, Handle)
                got = got.wait()
            got = got[0] if label.startswith("grouped") else got
            np.testing.assert_array_equal(got, x)  # one rank: every collective is identity
            with pytest.raises(TypeError, match=f"{label}\\(\\) got an unexpected"):
                fn(x, bogus=1)
    finally:
        ddl.shutdown()


def test_a_setting_that_differs_is_named_alike_on_every_rank():
    from ddl.engines import agreement

    def rows(*per_rank):
        return np.array([[s.word for s in r] for r in per_rank], np.int64)

    def mine(chunk, profile):
        return [agreement.number("DDL_CHUNK_BYTES", chunk),
                agreement.digest("DDL_COST_PROFILE links", (1e-3, profile), f"/p{profile}")]

    same = rows(mine(1 << 20, 1.0), mine(1 << 20, 1.0), mine(1 << 20, 1.0))
    assert agreement.disagreement(mine(1 << 20, 1.0), same, (4, 5, 6), 4) is None
    # the first setting that differs, the first rank that differs from the group's first
    odd = rows(mine(1 << 20, 1.0), mine(1 << 20, 2.0), mine(64 << 10, 2.0))
    why = agreement.disagreement(mine(1 << 20, 1.0), odd, (4, 5, 6), 5)
    assert why.startswith("rank 5: ") and "different DDL_CHUNK_BYTES" in why
    assert "rank 4 has 1048576, rank 6 has 65536" in why
    odd = rows(mine(1 << 20, 1.0), mine(1 << 20, 2.0), mine(1 << 20, 2.0))
    why = agreement.disagreement(mine(1 << 20, 2.0), odd, (4, 5, 6), 6)
    assert "rank(s) [5, 6] read other values than rank 4; this rank: /p2.0" in why
    # the digest is a non-negative int64 and the same for the same value
    d = agreement.digest("x", (1e-3, 0.5), "")
    assert 0 <= d.word < 1 << 63 and d.word == agreement.digest("y", (1e-3, 0.5), "").word
