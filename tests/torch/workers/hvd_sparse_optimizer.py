"""DistributedOptimizer with a sparse gradient (nn.Embedding(sparse=True)) and no
sparse_as_dense: reduced as Horovod does (allgather of indices and values), in the same
bucket as a dense layer. Trained 3 steps of SGD from one initialisation, against
sparse_as_dense=True and a single-process reference on the concatenated batch (which every
rank computes itself); and torch.optim.SparseAdam, which steps only on sparse gradients,
on an embedding alone. Prints one JSON line."""

import json
import sys

import torch

import ddl.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
STEPS, ROWS = 3, 6


class Model(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4, sparse=sparse)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, idx):
        return self.out(self.emb(idx).mean(dim=1))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    # overlapping rows between ranks, so the allgathered indices repeat and must add up
    return torch.randint(0, 8, (ROWS, 3), generator=g), torch.randint(0, 2, (ROWS,), generator=g)


def train(model, opt, batches, loss=torch.nn.functional.cross_entropy):
    for x, y in batches:
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def distributed(sparse_as_dense=False, predivide=1.0):
    torch.manual_seed(0)
    model = Model(sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=predivide,
                                   # the size-only plan: one bucket, however the hooks'
                                   # timings fall on a loaded machine
                                   cycle_time_ms=0)
    params = train(model, opt, [batch(R, s) for s in range(STEPS)])
    return params, opt.exchange_modes, model.emb.weight.grad.is_sparse


def reference():
    torch.manual_seed(0)
    model = Model(sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = []
    for s in range(STEPS):
        xs, ys = zip(*(batch(r, s) for r in range(N)))
        batches.append((torch.cat(xs), torch.cat(ys)))
    return train(model, opt, batches)


def same_everywhere(params):
    flat = torch.cat([p.reshape(-1) for p in params]).view(torch.int32).reshape(1, -1)
    rows = hvd.allgather(flat)
    return all(torch.equal(rows[i], rows[0]) for i in range(N))


def close(a, b):
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


class Bag(torch.nn.Module):
    """An embedding alone (SparseAdam takes sparse gradients only), a fixed projection."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4, sparse=True)
        self.register_buffer("proj", torch.linspace(-1.0, 1.0, 8).reshape(4, 2))

    def forward(self, idx):
        return self.emb(idx).mean(dim=1) @ self.proj


def sparse_adam(batches, wrap, sparse_as_dense=False):
    torch.manual_seed(0)
    model = Bag()
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.05)
    if wrap:
        # sparse_as_dense: reduced dense, then made sparse again for SparseAdam, as Horovod
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       sparse_as_dense=sparse_as_dense)
    params = train(model, opt, batches, loss=torch.nn.functional.mse_loss)
    grad = model.emb.weight.grad
    # an embedding's sparse gradient is row-wise (sparse_dim 1); so is it after the exchange
    return params, (opt.exchange_modes if wrap else None), grad.is_sparse and \
        grad.sparse_dim() == 1


def regression(x, y):
    return x, y.float().reshape(-1, 1).expand(-1, 2).contiguous()


def concatenated(step):
    xs, ys = zip(*(batch(r, step) for r in range(N)))
    return regression(torch.cat(xs), torch.cat(ys))


def own(step):
    return regression(*batch(R, step))


adam, adam_modes, adam_grad_sparse = sparse_adam([own(s) for s in range(STEPS)], True)
adam_ref, _, _ = sparse_adam([concatenated(s) for s in range(STEPS)], False)
adam_dense, _, adam_dense_grad_sparse = sparse_adam([own(s) for s in range(STEPS)], True,
                                                    sparse_as_dense=True)
torch.manual_seed(0)
adam_init = [p.detach() for p in Bag().parameters()]

sparse, modes, grad_sparse = distributed()
dense, dense_modes, dense_grad_sparse = distributed(sparse_as_dense=True)
predivided, _, _ = distributed(predivide=2.0)
ref = reference()
torch.manual_seed(0)
init = [p.detach() for p in Model(sparse=True).parameters()]
report = {
    "rank": R,
    "modes": modes, "dense_modes": dense_modes, "grad_sparse": grad_sparse,
    "same": same_everywhere(sparse),
    "vs_reference": close(sparse, ref),
    "vs_sparse_as_dense": close(sparse, dense),
    "predivide": close(predivided, ref),
    "trained": not torch.equal(sparse[0], init[0]),
    "adam_modes": adam_modes, "adam_grad_sparse": adam_grad_sparse,
    "adam_same": same_everywhere(adam),
    "adam_vs_reference": close(adam, adam_ref),
    "adam_trained": not torch.equal(adam[0], adam_init[0]),
    "dense_grad_sparse": dense_grad_sparse,
    "adam_dense_grad_sparse": adam_dense_grad_sparse,
    "adam_dense_vs_reference": close(adam_dense, adam_ref),
}
print(json.dumps(report))
hvd.shutdown()
sys.exit(0)
