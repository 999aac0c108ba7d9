"""op=hvd.Adasum: allreduce, grouped_allreduce and DistributedOptimizer on 2 and 4 real
ranks against the numpy reference in workers/hvd_adasum.py (each case: close to the
reference, bitwise the same on every rank), and the power-of-two error on every rank of 3;
plus the pairwise rule of ddl.hvd.adasum itself, in process."""

import pickle

import numpy as np
import pytest
from torch_util import reports, run_worker

from ddl import dtypes
from ddl.hvd import adasum

F32, F64 = dtypes.BY_NAME["float32"], dtypes.BY_NAME["float64"]


# ------------------------------------------------------------------ in process
def test_the_pairwise_rule_and_its_special_cases():
    a = np.array([3.0, 0.0, 0.0], np.float64)
    b = np.array([0.0, 4.0, 0.0], np.float64)
    assert np.array_equal(adasum.combine(a, b, [3], F64), a + b)  # orthogonal: the sum
    assert np.array_equal(adasum.combine(a, a, [3], F64), a)  # equal: not counted twice
    assert np.array_equal(adasum.combine(np.zeros(3), b, [3], F64), b)  # a zero side
    c = np.array([1.0, 1.0, 0.0])
    dot = 1.0 * 3.0
    want = (1 - dot / (2 * 9.0)) * a + (1 - dot / (2 * 2.0)) * c
    assert np.allclose(adasum.combine(a, c, [3], F64), want, rtol=0, atol=1e-15)


def test_coefficients_are_per_segment_not_over_the_fused_vector():
    a = np.array([1.0, 0.0, 5.0, 5.0], np.float32)
    b = np.array([0.0, 1.0, 5.0, 5.0], np.float32)
    got = adasum.combine(a, b, [2, 2], F32)
    assert np.array_equal(got, [1.0, 1.0, 5.0, 5.0])  # orthogonal part summed, equal kept
    fused = adasum.combine(a, b, [4], F32)
    assert not np.array_equal(fused, got)


def test_the_tree_pairs_lower_ranks_first_and_needs_a_power_of_two():
    rows = np.random.default_rng(1).standard_normal((4, 5))
    left = adasum.combine(rows[0], rows[1], [5], F64)
    right = adasum.combine(rows[2], rows[3], [5], F64)
    got, coefs = adasum.tree(rows, [5], F64)
    assert np.array_equal(got, adasum.combine(left, right, [5], F64))
    assert coefs.shape == (3, 1, 2)  # pairs (0,1), (2,3), then (01, 23)
    # the coefficients of another rank give that rank's result: exact scaled adds only
    other = coefs.copy()
    other[2, 0, 0] = 0.5
    redone, used = adasum.tree(rows, [5], F64, coefs=other)
    assert np.array_equal(used, other)
    assert np.array_equal(redone, 0.5 * left + other[2, 0, 1] * right)
    with pytest.raises(adasum.AdasumSizeError, match="power-of-two number of ranks.*got 3"):
        adasum.tree(rows[:3], [5], F64)
    with pytest.raises(NotImplementedError):  # Horovod's type for it
        adasum.check_size(6)
    with pytest.raises(dtypes.DDLConfigError, match="not int32"):
        adasum.check_dtype(dtypes.BY_NAME["int32"].code)


def test_half_types_combine_in_float32_and_round_once_per_level():
    a = np.array([1.0, 2.0, 3.0], np.float16)
    b = np.array([3.0, -1.0, 0.5], np.float16)
    got = adasum.combine(a, b, [3], dtypes.BY_NAME["float16"])
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    dot = a64 @ b64
    want = ((1 - dot / (2 * a64 @ a64)) * a64 + (1 - dot / (2 * b64 @ b64)) * b64)
    assert got.dtype == np.float16 and np.allclose(got, want.astype(np.float16), atol=2e-3)
    bits = np.array([0x3F80, 0x4000], np.uint16)  # bfloat16 1.0, 2.0
    same = adasum.combine(bits, bits, [2], dtypes.BFLOAT16)
    assert np.array_equal(same, bits)


def test_hvd_adasum_is_one_pickleable_constant():
    assert adasum.is_adasum(adasum.Adasum) and adasum.is_adasum("Adasum")
    assert not adasum.is_adasum("sum")
    assert pickle.loads(pickle.dumps(adasum.Adasum)) is adasum.Adasum


# ------------------------------------------------------------------ real ranks
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def job(request):
    return request.param, reports(run_worker("hvd_adasum.py", request.param, timeout=240))


@pytest.mark.timeout(300)
def test_allreduce_matches_the_reference_bitwise_the_same_on_every_rank(job):
    n, reps = job
    for rep in reps:
        assert rep["errors"] == {}, rep["errors"]
        c = rep["cases"]
        for label in ("fp32_odd", "fp32_2d", "fp64", "fp16", "bf16"):
            assert c[label] == {"close": True, "same": True, "untouched": True}, (label, c)
        assert all(c["spellings"].values()), c["spellings"]
        g = c["grouped"]
        assert g["close"] == [True] * 5 and g["same"] and g["per_tensor"], g
        assert g["inplace"] and g["async"], g
        assert c["orthogonal"] is True and c["parallel_equal"] is True
        z = c["zero_vector"]
        assert z["close"] and z["all_zero"]
        assert z["exact_for_two"] is (True if n == 2 else None)
        assert c["scale_factors"] is True and c["fp16_compression"] is True
        assert c["autograd"] is True


@pytest.mark.timeout(300)
def test_wrong_uses_raise_on_every_rank_and_the_job_goes_on(job):
    _, reps = job
    for rep in reps:
        e = rep["cases"]["errors"]
        assert e["integer"]["type"] == "DDLConfigError" and "not int32" in e["integer"]["msg"]
        assert e["average_and_op"]["type"] == "DDLConfigError"
        assert "allreduce, grouped_allreduce and DistributedOptimizer only" in (
            e["reducescatter"]["msg"])
        m = e["mismatch"]
        assert m["type"] == "DDLMismatchError" and "op=Adasum" in m["msg"], m
        assert "op=Sum" in m["msg"] and e["in_step"] is True
        if rep["rank"] == len(reps) - 1:
            assert e["joined"] == {"joined_returned": True}
        else:
            assert e["joined"]["type"] == "DDLConfigError", e["joined"]
            assert "joined ranks do not serve Adasum" in e["joined"]["msg"]
        assert e["in_step_after_join"] is True


@pytest.mark.timeout(300)
def test_distributed_optimizer_combines_the_local_steps_deltas(job):
    _, reps = job
    for rep in reps:
        o = rep["cases"]["optimizer"]
        assert o == {"type": "DistributedAdasumOptimizer", "isinstance": True, "close": True,
                     "moved": True, "same": True}, o
        b = rep["cases"]["optimizer_bpps"]
        assert b == {"third_pass": True, "skip_synchronize": True, "same": True}, b


@pytest.mark.timeout(200)
def test_three_ranks_raise_the_power_of_two_error_on_every_rank():
    reps = reports(run_worker("hvd_adasum.py", 3, timeout=180))
    assert len(reps) == 3
    for rep in reps:
        s = rep["cases"]["size"]
        for what in ("allreduce", "grouped", "optimizer"):
            assert s[what]["type"] == "AdasumSizeError" and s[what]["not_implemented"], s
            assert "power-of-two number of ranks" in s[what]["msg"] and "got 3" in s[what]["msg"]
        assert s["in_step"] is True
