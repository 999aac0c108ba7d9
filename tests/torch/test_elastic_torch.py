"""ddl.torch.elastic: TorchState commits and restores models, optimizers, LR schedulers,
ElasticSamplers and plain values exactly; assigning a handled attribute swaps the object;
the handler registry is Horovod's; the sampler deals the rest of an epoch over the world;
and across 2 real ranks under ddlrun, ``sync()`` makes every rank's state rank 0's."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch_util import WORKERS, ddlrun

import ddl
import ddl.torch as hvd
from ddl.elastic import link
from ddl.elastic import sampler as S
from ddl.torch import elastic


@pytest.fixture
def one_rank():
    hvd.init()
    yield
    hvd.shutdown()


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def train_step(model, opt, sched) -> None:
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).sum().backward()
    opt.step()
    sched.step()


def snapshot(model, opt, sched) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in v.items()}
                    for k, v in opt.state_dict()["state"].items()},
            "lr": [g["lr"] for g in opt.param_groups],
            "sched": sched.state_dict()["last_epoch"]}


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k  # bit for bit
    assert a["opt"].keys() == b["opt"].keys()
    for k in a["opt"]:
        for n in a["opt"][k]:
            x, y = a["opt"][k][n], b["opt"][k][n]
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y, (k, n)
    assert a["lr"] == b["lr"] and a["sched"] == b["sched"]


def test_restore_brings_back_the_commit_bit_for_bit(one_rank):
    model, opt, sched = make_training()
    sampler = elastic.ElasticSampler(range(20), seed=1)
    state = elastic.TorchState(model=model, optimizer=opt, scheduler=sched, sampler=sampler,
                               epoch=0, batch=0)
    assert set(state._handlers) == {"model", "optimizer", "scheduler", "sampler"}
    # the copy keeps the versions a module's load_state_dict reads
    assert state._handlers["model"]._saved._metadata == model.state_dict()._metadata
    train_step(model, opt, sched)
    sampler.record_batch(0, 4)
    state.batch = 1
    state.commit()
    committed = snapshot(model, opt, sched)
    done = set(sampler.get_indices(0, 4))
    for _ in range(3):
        train_step(model, opt, sched)
    sampler.record_batch(1, 4)
    state.batch, state.epoch = 4, 1
    moved = snapshot(model, opt, sched)
    with pytest.raises(AssertionError):
        assert_same(moved, committed)  # training did change what the restore must undo
    state.restore()
    assert_same(snapshot(model, opt, sched), committed)
    assert (state.batch, state.epoch) == (1, 0)
    assert sampler.processed_indices == done
    assert len(sampler) == 16 and not done & set(sampler)
    # a commit is a copy: training after the restore does not change it
    train_step(model, opt, sched)
    state.restore()
    assert_same(snapshot(model, opt, sched), committed)


def test_assigning_a_handled_attribute_swaps_the_object_and_saves_it(one_rank):
    old, opt, _ = make_training(0)
    state = elastic.TorchState(model=old, optimizer=opt)
    new = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    at_swap = {k: v.clone() for k, v in new.state_dict().items()}
    old_params = {k: v.clone() for k, v in old.state_dict().items()}
    state.model = new
    assert state.model is new and state._handlers["model"].value is new
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1.0)
    state.restore()
    for k, v in new.state_dict().items():
        assert torch.equal(v, at_swap[k]), k
    for k, v in old.state_dict().items():
        assert torch.equal(v, old_params[k]), k
    # a plain value stays plain: assigning it saves nothing
    state2 = elastic.TorchState(model=None, optimizer=None, epoch=3)
    assert "model" not in state2._handlers and state2.model is None
    state2.epoch = 4
    state2.restore()
    assert state2.epoch == 3


class Counter:
    def __init__(self) -> None:
        self.value = 0


class CounterHandler(elastic.StateHandler):
    def __init__(self, counter: Counter) -> None:
        super().__init__(counter)
        self.save()

    def save(self) -> None:
        self.saved = self.value.value

    def restore(self) -> None:
        self.value.value = self.saved

    def sync(self) -> None:
        self.value.value = hvd.broadcast_object(self.value.value, root_rank=0)


def test_the_handler_registry_can_be_read_and_replaced(one_rank):
    default = elastic.get_handler_registry()
    kinds = [kind for kind, _ in default]
    assert kinds == [torch.nn.Module, torch.optim.Optimizer,
                     torch.optim.lr_scheduler.LRScheduler, elastic.ElasticSampler]
    counter = Counter()
    assert "counter" not in elastic.TorchState(counter=counter)._handlers
    elastic.set_handler_registry([*default, (Counter, CounterHandler)])
    try:
        state = elastic.TorchState(counter=counter)
        assert isinstance(state._handlers["counter"], CounterHandler)
        counter.value = 5
        state.commit()
        counter.value = 9
        state.restore()
        assert counter.value == 5
        state.sync()
        assert counter.value == 5
    finally:
        elastic.set_handler_registry(default)
    assert elastic.get_handler_registry() is default


def test_the_sampler_yields_the_epochs_order_and_set_epoch_starts_over(one_rank):
    sampler = elastic.ElasticSampler(range(10), seed=4)
    assert list(sampler) == S.epoch_order(10, epoch=0, seed=4)
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (1, 0, 10)
    sampler.record_batch(0, 3)
    sampler.record_indices(torch.tensor([9]))
    assert sampler.processed_indices == set(list(sampler)[:3]) | {9}
    sampler.load_state_dict(sampler.state_dict())
    assert len(sampler) == 6 and sampler.remaining_indices == list(sampler)
    sampler.set_epoch(1)
    assert sampler.processed_indices == set() and sampler.epoch == 1
    assert list(sampler) == S.epoch_order(10, epoch=1, seed=4)
    unshuffled = elastic.ElasticSampler(range(5), shuffle=False)
    assert list(unshuffled) == [0, 1, 2, 3, 4]


def test_the_sampler_deals_what_is_left_over_the_world_after_a_reset(one_rank, monkeypatch):
    sampler = elastic.ElasticSampler(range(11), shuffle=False)
    state = elastic.TorchState(sampler=sampler)
    sampler.record_batch(0, 4)
    state.commit()
    shares = {}
    for rank in range(3):  # the world the ranks see after a reset: 3 ranks
        monkeypatch.setattr(ddl, "size", lambda: 3)
        monkeypatch.setattr(ddl, "rank", lambda r=rank: r)
        state.on_reset()
        assert (sampler.num_replicas, sampler.rank) == (3, rank)
        shares[rank] = list(sampler)
    assert shares == {0: [4, 7, 10], 1: [5, 8], 2: [6, 9]}
    padded = elastic.ElasticSampler(range(11), shuffle=False, pad=True)
    padded.load_state_dict(sampler.state_dict())
    assert len(padded) == 3 and padded.rank == 2


def pretend_hosts_changed(monkeypatch) -> None:
    """ddlrun announced a newer world than this one (what rank 0 reads in
    check_host_updates)."""
    monkeypatch.setattr(link, "latest_update", lambda: (link.generation() + 1, False))


def test_a_change_of_hosts_keeps_the_work_since_the_commit_and_a_restore_drops_it(
        one_rank, monkeypatch):
    sampler = elastic.ElasticSampler(range(12), seed=2)
    state = elastic.TorchState(sampler=sampler)
    sampler.record_batch(0, 2)
    first = set(sampler.get_indices(0, 2))
    state.commit()
    second = set(sampler.get_indices(1, 2))
    sampler.record_batch(1, 2)
    state.restore()  # a lost peer: the model goes back to the commit, so does the sampler
    assert sampler.processed_indices == first
    sampler.record_indices(second)
    state.check_host_updates()  # nothing announced: nothing happens
    pretend_hosts_changed(monkeypatch)
    with pytest.raises(hvd.elastic.HostsUpdatedInterrupt) as caught:
        state.check_host_updates()
    assert not caught.value.skip_sync  # hosts were added: the state is sent again
    state.on_reset()
    state.sync()  # the state is kept, so the work since the commit counts
    assert sampler.processed_indices == first | second and len(sampler) == 8


def test_elastic_run_syncs_then_calls_the_function(one_rank):
    model, opt, _ = make_training()
    state = elastic.TorchState(model=model, optimizer=opt, epoch=2)
    calls = []

    @hvd.elastic.run
    def train(state, extra):
        calls.append((state.epoch, extra))
        return "done"

    assert train(state, "x") == "done" and calls == [(2, "x")]
    assert hvd.elastic.run is ddl.elastic.run


def test_sync_makes_every_rank_rank_0s_state_across_two_ranks_under_ddlrun():
    proc = ddlrun(2, [os.path.join(WORKERS, "elastic_sync.py")], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reps = sorted((json.loads(ln[ln.index("{"):]) for ln in proc.stdout.splitlines()
                   if "{" in ln), key=lambda r: r["rank"])
    assert [r["rank"] for r in reps] == [0, 1]
    zero, one = reps
    assert zero["before"] != one["before"]  # they did start apart
    assert zero["params"] == zero["before"]  # rank 0 keeps its own
    for key in ("params", "opt", "lr", "sched", "epoch", "tags", "sampler_epoch"):
        assert one[key] == zero[key], key
    assert (zero["epoch"], zero["tags"], zero["sampler_epoch"], zero["sched"]) == (
        10, {"from": 0}, 0, 1)
    # the commit merged both ranks' first batches; the change of hosts both second ones
    firsts = sorted(zero["first"] + one["first"])
    assert zero["committed"] == one["committed"] == firsts and len(set(firsts)) == 6
    merged = sorted(firsts + zero["second"] + one["second"])
    assert zero["interrupted"] == one["interrupted"] == [True, False]
    assert zero["after_sync"] == one["after_sync"] == merged and len(set(merged)) == 12
    assert zero["share"] == one["share"] == 14 and zero["remaining"] == 28
