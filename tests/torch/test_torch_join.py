"""hvd.join() with Horovod's semantics across real processes (2 and 3 ranks): joined ranks
serve the allreduces of the ranks still running, so uneven batch counts work under the
DistributedOptimizer, and allgather, alltoall, broadcast and reducescatter raise on every
running rank while a rank has joined, as Horovod's controller refuses them; see
workers/hvd_join.py for what each part does. One job per rank count; the tests below read
its report."""

import pytest
from torch_util import reports, run_worker

EXACT = 1e-12  # float64 model; joined ranks add exact zeros


@pytest.fixture(scope="module", params=[2, 3])
def job(request):
    n = request.param
    # DDL_TIMEOUT bounds every wait, so a protocol bug fails fast instead of hanging
    reps = reports(run_worker("hvd_join.py", n, env={"DDL_TIMEOUT": "20"}, timeout=100))
    return n, reps


def _all_true(part: dict) -> dict:
    return {k: v for k, v in part.items() if v is not True and not k.endswith("_msg")}


@pytest.mark.timeout(120)
def test_uneven_batches_with_distributed_optimizer_follow_horovods_rule(job):
    n, reps = job
    for r in reps:
        t = r["train"]
        assert "error" not in t, t.get("error")
        assert t["buckets"] > 1
        for e in range(3):
            # each rank's own parameters after its own last step, and everyone's after the
            # resync from the last joiner, equal the reference of Horovod's rule
            assert t[f"e{e}_own_diff"] <= EXACT, (e, t)
            assert t[f"e{e}_final_diff"] <= EXACT, (e, t)
            assert t[f"e{e}_seconds"] < 20, (e, t)
        assert t["plans_equal"] and t["replanned"], t


@pytest.mark.timeout(120)
def test_join_returns_the_last_rank_to_join_on_every_rank(job):
    n, reps = job
    for e in range(3):
        lasts = {r["train"][f"e{e}_last"] for r in reps}
        assert len(lasts) == 1, (e, lasts)
    last = [reps[0]["train"][f"e{e}_last"] for e in range(3)]
    assert last[0] in range(1, n)  # ranks 1.. have the most batches (timing breaks the tie)
    assert last[1] == n - 1  # rank r had r+2 batches
    assert last[2] == 0  # rank r had n-r batches
    for r in reps:  # and in the collectives part, where the last one is forced
        c = r["collectives"]
        assert all(c[k] is True for k in c if k.endswith("_ret")), c
        assert c["plain_join_agrees"] is True


@pytest.mark.timeout(120)
def test_collectives_while_ranks_are_joined(job):
    n, reps = job
    for r in reps:
        c = r["collectives"]
        assert "error" not in c, c.get("error")
        assert not _all_true(c), _all_true(c)
    running = [k for k in reps[1]["collectives"] if k.startswith("first0_")]
    for name in ("allreduce_sum", "allreduce_average", "allreduce_min", "allreduce_max",
                 "allreduce_product", "async", "grouped", "grouped_inplace", "int_average",
                 "average_f16_bitwise", "average_bf16_bitwise", "barrier", "after_errors"):
        assert f"first0_{name}" in running, name  # the checks did run
    # Horovod's controller refuses these while a rank has joined: each raised on every
    # running rank, and the next call was in step
    for name in ("allgather", "allgather_async", "grouped_allgather", "alltoall",
                 "broadcast_running_root", "broadcast_joined_root", "broadcast_parameters",
                 "reduce_scatter", "grouped_reducescatter", "broadcast_object",
                 "allgather_object"):
        assert f"first0_{name}_raises" in running, name
        assert f"first0_{name}_then_in_step" in running, name


@pytest.mark.timeout(120)
def test_mismatched_collectives_raise_on_every_rank_and_name_them(job):
    n, reps = job
    for r in reps:
        m = r["mismatch"]
        assert "error" not in m, m.get("error")
        assert not _all_true(m), (_all_true(m), m.get("shape_msg"))
        assert "rank 1: hvd.allreduce(float32[5x2], op=Sum)" in m["shape_msg"]
        if n >= 3 and "with_joined" in m:
            assert m["with_joined"] and m["with_joined_then_sum"]
            assert m["failure_with_joined"]
