"""The attributes of Horovod's _DistributedOptimizer that its tests and users' scripts read
(_parameter_names, _requires_update, _handles, _allreduce_delay, backward_passes_per_step and
set_backward_passes_per_step, _synchronized, _should_synchronize, op, ...), on 2 ranks."""

from __future__ import annotations

from torch_util import reports, run_worker


def test_horovod_optimizer_attributes():
    for rep in reports(run_worker("hvd_optimizer_attrs.py", 2)):
        assert rep["parameter_names"] is True and rep["requires_update"] is True, rep
        assert rep["public"] == [2, True, 2.0, False, True], rep
        assert rep["find_duplicates"] == ["a", "b"]
        assert rep["delay_fresh"] == [2, 2, 2] and rep["handles_fresh"] == 0, rep
        assert rep["delay_after_one"] == [1, 1, 1] and rep["handles_after_one"] == 0, rep
        assert rep["handles_after_two"] is True, rep
        assert [rep["synchronized_before"], rep["synchronized_after"]] == [False, True], rep
        assert rep["handles_after_sync"] == 0, rep
        assert rep["should_synchronize_inside"] is False, rep
        assert rep["should_synchronize_after"] is True, rep
        assert rep["synchronized_after_step"] is False, rep
        assert rep["set_bpps"] == [1, [1, 1, 1]] and rep["assign_bpps"] == [3, 3, 3], rep
        assert rep["delay_after_load"] == [2, 2, 2], rep
        assert rep["noname"] is True, rep
        assert rep["adasum"] == ["DistributedAdasumOptimizer", True, True, {}, [1, 1], 1], rep
