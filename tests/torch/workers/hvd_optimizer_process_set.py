"""DistributedOptimizer(..., process_set=) on 3 ranks with the set [0, 2] (Horovod's even
set): the members' gradients are the average of their two gradients, bitwise (a sparse
embedding allgathered within the set, dense layers reduced within it), rank 1 trains on its
own gradients, untouched; the members' plan is refined from timings broadcast within the
set. Then global collectives show every rank in step. Prints one JSON line per rank."""

import json
import sys

import torch

import ddl.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
MEMBERS = [0, 2]
STEPS, ROWS, K = 4, 3, 2
assert N == 3
ps = hvd.add_process_set(MEMBERS)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(24, 4, sparse=True)
        self.hidden = torch.nn.Linear(4, 5)
        self.out = torch.nn.Linear(5, 2)

    def forward(self, idx):
        return self.out(torch.tanh(self.hidden(self.emb(idx).mean(dim=1))))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    # distinct rows inside a rank's batch: a sparse gradient with one value per row
    idx = torch.randperm(24, generator=g)[:ROWS * K].reshape(ROWS, K)
    return idx, torch.randn(ROWS, 2, generator=g)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def flat(grads):
    return torch.cat([(g.to_dense() if g.is_sparse else g).reshape(-1) for g in grads])


def train_alone(batches):
    """Plain SGD on this rank's own batches: what rank 1 must get."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for x, y in batches:
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    return flat([p.detach() for p in model.parameters()])


torch.manual_seed(0)
model = Model()
params = list(model.parameters())
opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.2),
                               named_parameters=model.named_parameters(),
                               process_set=ps, fusion_threshold_bytes=64)
bitwise, modes = [], []
for s in range(STEPS):
    x, y = batch(R, s)
    # every rank's own gradient (autograd.grad: no hooks, nothing accumulated)
    local = flat(torch.autograd.grad(loss_of(model, x, y), params))
    rows = hvd.allgather(local.reshape(1, -1))
    want = (rows[0] + rows[2]) / 2 if R in MEMBERS else rows[R]
    opt.zero_grad()
    loss_of(model, x, y).backward()
    opt.synchronize()
    bitwise.append(torch.equal(flat([p.grad for p in params]), want))
    with opt.skip_synchronize():
        opt.step()
    modes.append(opt.exchange_modes)

mine = flat([p.detach() for p in params])
everyone = hvd.allgather(mine.view(torch.int32).reshape(1, -1))
total = hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum)
report = {
    "rank": R,
    "bitwise": bitwise,
    "modes": sorted({m for step in modes for m in step if m is not None}),
    "replanned": opt._exchange.replanned,
    "members_same": torch.equal(everyone[0], everyone[2]),
    "rank1_differs": not torch.equal(everyone[0], everyone[1]),
    "alone": torch.equal(mine, train_alone([batch(R, s) for s in range(STEPS)])),
    "global_sum": total.item(),
    "included": opt._included,
}
print(json.dumps(report))
hvd.shutdown()
sys.exit(0)
