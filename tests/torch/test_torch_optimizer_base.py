"""DistributedOptimizer (plain and Adasum) on 2 ranks as torch sees an optimizer: step and
state-dict hooks registered on the wrapper run (with the wrapper as their optimizer), an LR
scheduler drives the shared param groups, state_dict()/load_state_dict() round-trip,
zero_grad works, and wrapping leaves the wrapped optimizer's objects as they were."""

from __future__ import annotations

import pytest
from torch_util import reports, run_worker


@pytest.fixture(scope="module")
def reps():
    return reports(run_worker("hvd_optimizer_base.py", 2))


@pytest.mark.parametrize("kind", ["average", "adasum"])
def test_hooks_and_lr_scheduler_on_the_wrapper(reps, kind):
    for rep in reps:
        got = rep[kind]
        assert got["isinstance"] is True
        assert got["steps"] is True, got  # pre and post hook around each of the 3 steps
        assert got["lr"] == [0.1 * 0.5 ** 3] * 2  # the scheduler's, in both views of it
        assert got["shared"] is True
        assert got["scheduler_warned"] == []  # the scheduler saw optimizer.step() run
        assert got["sd_hooks"] is True and got["load_hooks"] is True
        assert got["loaded_lr"] == 0.1 * 0.5 ** 3 and got["loaded_state"] is True
        assert got["zero_grad"] is True and got["add_group"] == "refused"
    # the plain optimizer's hooks launch buckets during backward; Adasum's do not
    assert {r[kind]["zero_grad_in_flight"] for r in reps} == (
        {"refused"} if kind == "average" else {"allowed"})
    assert reps[0][kind]["weights"] == reps[1][kind]["weights"]  # one model on both ranks


def test_adasum_factory_and_wrapping_keeps_the_optimizers_state(reps):
    for rep in reps:
        assert rep["adasum_type"] == "DistributedAdasumOptimizer"
        assert rep["keeps_state"] is True
