"""Horovod's process sets (add/remove, init(process_sets=), every collective with
process_set=, autograd, mismatches inside a set) on 2 and 3 ranks."""

from __future__ import annotations

import pytest
from torch_util import reports, run_worker

EXPECTED = {"ids", "size", "rank", "included", "allreduce_sum/2", "allreduce_avg/2",
            "global/2", "allreduce_int_avg", "allgather", "allgather_object",
            "grouped_allreduce/0", "reducescatter", "alltoall", "grad", "outside", "remove",
            "remove_again", "init_sets_id", "global_after"}


@pytest.mark.parametrize("n", [2, 3])
def test_process_sets(n):
    for rep in reports(run_worker("hvd_process_sets.py", n)):
        assert set(rep["ran"]) >= EXPECTED, sorted(EXPECTED - set(rep["ran"]))
        assert rep["failed"] == [], rep["failed"]
        if n == 3 and rep["rank"] in (0, 2):  # the even set has two members
            assert {"mismatch", "after_mismatch", "init_sets_allreduce"} <= set(rep["ran"])
