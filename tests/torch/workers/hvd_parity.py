"""Where Horovod's DistributedOptimizers touch ``.grad`` (read from horovod/torch/optimizer.py):
the Adasum one gives every parameter that requires a gradient a fresh zero ``.grad`` when it
is built; the plain one leaves ``.grad`` alone until ``step()``/``synchronize()``, where a
gradient this rank did not compute is sent as zeros. Prints one JSON line per rank."""

import json

import torch

import ddl.torch as hvd

hvd.init()
R = hvd.rank()
out = {"rank": R}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    net[1].bias.requires_grad_(False)
    return net


# Adasum: zeros at construction, a stale gradient replaced, a frozen parameter untouched
net = model()
net[0].weight.grad = torch.ones_like(net[0].weight)
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                               named_parameters=net.named_parameters(), op=hvd.Adasum)
out["adasum_class"] = type(opt).__name__
out["adasum_grads"] = {n: (None if p.grad is None else
                           [list(p.grad.shape), p.grad.dtype == p.dtype,
                            float(p.grad.abs().sum()), p.grad.requires_grad])
                       for n, p in net.named_parameters()}

# plain: no gradient made at construction
net = model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                               named_parameters=net.named_parameters())
out["plain_grads"] = {n: p.grad is None for n, p in net.named_parameters()}

# plain: a layer only rank 1 uses; rank 0's missing gradient goes as zeros, so both ranks
# step on (0 + g) / 2
x = torch.ones(1, 3)
loss = net[0](x).sum() if R == 0 else net(x).sum()
loss.backward()
opt.step()
out["unused_on_rank0"] = net[1].weight.grad.tolist()

# sparse= (an earlier Horovod's keyword, which its test_sparse_embeddings passes): accepted by
# both optimizers; the sparse gradients are allgathered as always
torch.manual_seed(0)
emb = torch.nn.Embedding(10, 3, sparse=True)
before = emb.weight.detach().clone()
opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                               sparse=True)
emb(torch.tensor([[R, 4]])).sum().backward()
opt.step()
out["sparse_rows"] = emb.weight.detach().tolist()
out["sparse_changed"] = sorted({i for i in range(10) if not torch.equal(emb.weight[i],
                                                                        before[i])})
hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), op=hvd.Adasum,
                         sparse={})
print(json.dumps(out))
