"""hvd.DistributedOptimizer(..., process_set=) as Horovod's: gradients reduced among the
set's ranks only (Average over the set's size), ranks outside it train on their own
gradients; 3 ranks, the set [0, 2]."""

from __future__ import annotations

from torch_util import reports, run_worker


def test_distributed_optimizer_reduces_within_its_process_set():
    reps = reports(run_worker("hvd_optimizer_process_set.py", 3))
    assert [r["rank"] for r in reps] == [0, 1, 2]
    for rep in reps:
        assert rep["bitwise"] == [True] * 4, rep  # the set's average / its own, bitwise
        assert rep["global_sum"] == 3.0, rep  # the job is in step afterwards
        assert rep["members_same"] is True and rep["rank1_differs"] is True, rep
    for r in (0, 2):
        assert reps[r]["included"] is True
        assert reps[r]["modes"] == ["grads", "sparse"], reps[r]  # both paths, in the set
        assert reps[r]["replanned"] is True, reps[r]  # timings broadcast within the set
        assert reps[r]["alone"] is False
    assert reps[1]["included"] is False and reps[1]["modes"] == []
    assert reps[1]["alone"] is True  # plain SGD on its own batches, untouched
