"""The fusion planner and the compressors: pure, in-process."""

import pytest
import torch

from ddl.hvd.fusion import plan_buckets, plan_groups, split_evenly
from ddl.torch import Compression

F32 = (torch.float32, "cpu")
F16 = (torch.float16, "cpu")


def members(plan):
    return [b.members for b in plan]


def test_reverse_order_up_to_the_threshold():
    plan = plan_buckets([10, 10, 10, 10], [4] * 4, [F32] * 4, threshold_bytes=80)
    assert members(plan) == [(3, 2), (1, 0)]
    assert plan[0].offsets == (0, 10) and plan[0].numel == 20


def test_threshold_zero_disables_fusion_and_big_tensors_stand_alone():
    assert members(plan_buckets([5, 5], [4, 4], [F32] * 2, 0)) == [(1,), (0,)]
    assert members(plan_buckets([1, 1000, 1], [4] * 3, [F32] * 3, 100)) == [(2,), (1,), (0,)]


def test_default_threshold_fuses_everything_of_one_dtype():
    plan = plan_buckets([100] * 50, [4] * 50, [F32] * 50)
    assert len(plan) == 1 and plan[0].numel == 5000


def test_dtypes_never_share_a_buffer_and_do_not_cut_each_other():
    plan = plan_buckets([4, 4, 4, 4], [4, 2, 4, 2], [F32, F16, F32, F16], 1 << 20)
    assert members(plan) == [(3, 1), (2, 0)]
    assert {b.key for b in plan} == {F32, F16}


def test_cycle_time_splits_by_readiness():
    times = [0.0035, 0.0021, 0.0001, 0.0]  # index 3 first, then 2, then 1, then 0
    plan = plan_buckets([1] * 4, [4] * 4, [F32] * 4, 1 << 20, ready_times=times,
                        cycle_time_s=0.001)
    assert members(plan) == [(3, 2), (1,), (0,)]
    # no cycle limit: one bucket in order of readiness
    assert members(plan_buckets([1] * 4, [4] * 4, [F32] * 4, 1 << 20, ready_times=times)) == [
        (3, 2, 1, 0)]


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        plan_buckets([1, 2], [4], [F32, F32])
    with pytest.raises(ValueError):
        plan_buckets([1], [4], [F32], ready_times=[0.0, 1.0])
    with pytest.raises(ValueError):
        split_evenly(3, 0)


def test_groups():
    assert split_evenly(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_evenly(2, 5) == [[0], [1]]
    plan = plan_groups([[0, 1], [2]], [3, 4, 5], [F32, F16, F32])
    assert members(plan) == [(0,), (1,), (2,)]


def test_compressors_round_trip():
    t = torch.linspace(-2, 2, 11)
    c, ctx = Compression.fp16.compress(t)
    assert c.dtype == torch.float16
    back = Compression.fp16.decompress(c, ctx)
    assert back.dtype == torch.float32 and torch.allclose(back, t, atol=1e-3)
    i = torch.arange(3)
    assert Compression.fp16.compress(i)[0] is i
    assert Compression.none.decompress(*Compression.none.compress(t)) is t
