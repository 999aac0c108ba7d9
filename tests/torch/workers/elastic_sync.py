"""TorchState across 2 ranks: ranks start from different models, optimizer states, scheduler
steps, plain values and sampler epochs; ``sync()`` makes every rank rank 0's. Then the
sampler's commit merges both ranks' processed indices, and so does a change of hosts
announced (here: pretended) after more batches. Prints one JSON line per rank."""

import json

import torch

import ddl.torch as hvd
from ddl.elastic import link

torch.set_num_threads(1)
hvd.init()
R = hvd.rank()

torch.manual_seed(100 + R)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
opt = torch.optim.Adam(model.parameters(), lr=0.01 * (R + 1))
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
for _ in range(R + 1):  # a different number of steps: other moments, step counts, lr
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    sched.step()
sampler = hvd.elastic.ElasticSampler(range(40), seed=3)
sampler.set_epoch(R)
state = hvd.elastic.TorchState(model=model, optimizer=opt, scheduler=sched, sampler=sampler,
                               epoch=10 + R, tags={"from": R})

before = {k: v.tolist() for k, v in model.state_dict().items()}
state.sync()


def digest(sd):
    """An optimizer's state as plain lists (comparable across ranks as JSON)."""
    return {str(k): {n: (t.tolist() if torch.is_tensor(t) else t) for n, t in v.items()}
            for k, v in sd["state"].items()}


synced = {
    "rank": R,
    "before": before,
    "params": {k: v.tolist() for k, v in model.state_dict().items()},
    "opt": digest(opt.state_dict()),
    "lr": [g["lr"] for g in opt.param_groups],
    "sched": sched.state_dict()["last_epoch"],
    "epoch": state.epoch,
    "tags": state.tags,
    "sampler_epoch": sampler.epoch,
}

# commit: the union of both ranks' first batch; then each rank's second batch, merged by sync
sampler.set_epoch(5)
first = sampler.get_indices(0, 3)
sampler.record_batch(0, 3)
state.commit()
committed = sorted(sampler.processed_indices)
second = sampler.get_indices(1, 3)
sampler.record_batch(1, 3)
# ddlrun announces a newer world (what rank 0 reads): every rank stops, the state is kept
link.latest_update = lambda: (link.generation() + 1, False)
try:
    state.check_host_updates()
    interrupted = [False, None]
except hvd.elastic.HostsUpdatedInterrupt as exc:
    interrupted = [True, exc.skip_sync]
state.on_reset()
state.sync()
print(json.dumps({**synced, "first": first, "second": second, "committed": committed,
                  "interrupted": interrupted,
                  "after_sync": sorted(sampler.processed_indices),
                  "share": len(sampler), "remaining": len(sampler.remaining_indices)}),
      flush=True)
hvd.shutdown()
