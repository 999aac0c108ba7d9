"""The identity exchange's pure parts, and its rules on one rank (in-process): the hash is
stable across processes, grouped layouts, the lines that name calls, duplicate names and
local failures."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import ddl.torch as hvd
from ddl.hvd import control
from ddl.hvd import descriptor as desc


def test_the_name_hash_is_the_same_in_every_process():
    code = "from ddl.hvd.descriptor import stable_hash; print(stable_hash(b'grad.w'))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert outs == {f"{desc.stable_hash(b'grad.w')}\n"}
    assert 0 < desc.stable_hash(b"x") < 1 << 62  # inside the negation trick's range


def test_layout_leaves_out_first_dimensions_of_gathered_members_and_folds_long_shapes():
    a = desc.layout([(12, 0, (3, 4)), (13, 0, (5,))], gathering=True)
    b = desc.layout([(12, 0, (7, 4)), (13, 0, (1,))], gathering=True)
    assert a == b
    assert desc.layout([(12, 0, (3, 4))], gathering=False) != desc.layout(
        [(12, 0, (7, 4))], gathering=False)
    call = desc.Call(desc.GROUPED_BROADCAST, count=1, layout=desc.layout(
        [(12, 0, (1,) * 8 + (2, 3))], gathering=False))
    rows = call.members()
    assert rows[0, 2] == 10 and desc.member_shape(rows, 0) == (1,) * 7 + (6,)


def test_grouped_allreduce_buckets_follow_first_appearance_of_dtype_and_device():
    rows = desc.Call(desc.GROUPED_ALLREDUCE, count=4, layout=desc.layout(
        [(12, 0, (2,)), (13, 0, (2,)), (12, 1, (2,)), (12, 0, (3,))],
        gathering=False)).members()
    assert desc.buckets(rows) == [[0, 3], [1], [2]]


def test_calls_are_named_as_the_user_wrote_them():
    assert desc.Call(desc.ALLREDUCE, int(hvd.Sum), 12, (5, 2)).describe() == (
        "hvd.allreduce(float32[5x2], op=Sum)")
    assert desc.Call(desc.BROADCAST, 0, 13, (3,), arg=1, name="w").describe() == (
        "hvd.broadcast(float64[3], root_rank=1, name='w')")
    grouped = desc.Call(desc.GROUPED_ALLGATHER, count=2, layout=desc.layout(
        [(12, 0, (3, 4)), (6, 0, (2,))], gathering=True))
    assert grouped.describe() == "hvd.grouped_allgather(2 tensors: float32[*x4], int32[*])"
    assert desc.Call(desc.ALLTOALL, name="a", known=False).describe() == "hvd.alltoall(name='a')"


@pytest.fixture
def one_rank():
    hvd.init()
    yield
    hvd.shutdown()


def test_on_one_rank_failures_and_duplicate_names_raise_and_the_job_goes_on(one_rank):
    with pytest.raises(hvd.DDLConfigError, match="Average is not defined for bool"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(hvd.DDLConfigError, match="unknown reduce op"):
        hvd.allreduce_async(torch.ones(2), op="bogus")  # at once, as in Horovod
    h = hvd.allreduce_async(torch.ones(2), name="x")
    with pytest.raises(ValueError, match="Duplicate name 'x'"):
        hvd.allgather_async(torch.ones(2), name="x")
    assert torch.equal(hvd.synchronize(h), torch.ones(2))
    hvd.allgather(torch.ones(1), name="x")  # free again once waited for
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.ones(3))
    assert control.calls_issued() == 3  # every unnamed call counted, the failed ones too


def test_on_one_rank_shutdown_and_init_cycle(one_rank):
    for _ in range(3):
        hvd.shutdown()
        assert not hvd.is_initialized()
        hvd.init()
        got = hvd.grouped_allreduce([torch.ones(2), torch.ones(1, dtype=torch.float64)],
                                    op=hvd.Sum)
        assert [t.tolist() for t in got] == [[1.0, 1.0], [1.0]]
    assert np.isclose(float(hvd.allreduce(torch.tensor([2.0]))), 2.0)
