"""The Horovod-compatible collectives of ddl.torch, broadcast_parameters /
broadcast_optimizer_state from different seeds, and a parameter used on one rank only."""

import json

import torch

import ddl.torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
ok: dict[str, bool] = {}
tri = N * (N + 1) / 2


def eq(a, b):
    return bool(torch.equal(a, b))


x = torch.full((4,), float(R + 1))
ok["allreduce_avg"] = eq(hvd.allreduce(x), torch.full((4,), tri / N))
ok["allreduce_sum"] = eq(hvd.allreduce(x, op=hvd.Sum), torch.full((4,), tri))
ok["allreduce_average_false"] = eq(hvd.allreduce(x, average=False), torch.full((4,), tri))
ok["allreduce_scale"] = eq(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                         postscale_factor=0.5), torch.full((4,), tri))
ok["allreduce_fp16"] = bool(torch.allclose(
    hvd.allreduce(x, compression=hvd.Compression.fp16), torch.full((4,), tri / N)))
ok["allreduce_max"] = eq(hvd.allreduce(x, op=hvd.Max), torch.full((4,), float(N)))
y = x.clone()
hvd.allreduce_(y, op=hvd.Sum)
ok["allreduce_"] = eq(y, torch.full((4,), tri))
h = hvd.allreduce_async(x, op=hvd.Sum, name="a")
h2 = hvd.allreduce_async_(y, op=hvd.Min)
ok["async"] = eq(hvd.synchronize(h), torch.full((4,), tri)) and eq(hvd.synchronize(h2), y)
ok["poll"] = hvd.poll(h)
w = torch.full((3,), float(R), requires_grad=True)
s = hvd.allreduce(w, op=hvd.Sum)
s.sum().backward()
ok["differentiable"] = eq(w.grad, torch.full((3,), float(N)))
g = hvd.grouped_allreduce([x, torch.full((2, 2), float(R), dtype=torch.float64),
                           torch.ones(3)], op=hvd.Sum)
ok["grouped_allreduce"] = (eq(g[0], torch.full((4,), tri))
                           and eq(g[1], torch.full((2, 2), N * (N - 1) / 2, dtype=torch.float64))
                           and eq(g[2], torch.full((3,), float(N))))
# in place: CPU tensors are reduced where they live, one fused collective per dtype
gi = [x.clone(), torch.full((2, 2), float(R), dtype=torch.float64), torch.ones(3, 4)[:, ::2]]
ret = hvd.grouped_allreduce_(gi, op=hvd.Sum, postscale_factor=0.5)
ok["grouped_allreduce_"] = (all(a is b for a, b in zip(ret, gi))
                            and eq(gi[0], torch.full((4,), tri / 2))
                            and eq(gi[1], torch.full((2, 2), N * (N - 1) / 4, dtype=torch.float64))
                            and eq(gi[2], torch.full((3, 2), N / 2)))
ga = hvd.allgather(torch.full((R + 1, 2), float(R)))
ok["allgather_unequal"] = ga.shape == (int(tri), 2) and float(ga[-1, 0]) == N - 1
ok["broadcast"] = eq(hvd.broadcast(torch.full((2,), float(R)), root_rank=N - 1),
                     torch.full((2,), float(N - 1)))
bb = torch.full((2,), float(R))
hvd.broadcast_(bb, root_rank=0)
ok["broadcast_"] = eq(bb, torch.zeros(2))
# alltoall: rank R sends j+1 rows of value 10R+j to rank j
splits = [j + 1 for j in range(N)]
send = torch.cat([torch.full((j + 1, 2), float(10 * R + j)) for j in range(N)])
out, received = hvd.alltoall(send, splits=splits)
ok["alltoall_splits"] = (received.tolist() == [R + 1] * N
                         and eq(out, torch.cat([torch.full((R + 1, 2), float(10 * i + R))
                                                for i in range(N)])))
even = hvd.alltoall(torch.arange(N, dtype=torch.float32) + 100 * R)
ok["alltoall_even"] = eq(even, torch.arange(N, dtype=torch.float32) * 100 + R)
rs = hvd.reduce_scatter(torch.ones(N * 2, 3), op=hvd.Sum)
ok["reduce_scatter"] = eq(rs, torch.full((2, 3), float(N)))
hvd.barrier()
ok["join"] = 0 <= hvd.join() < N
ok["broadcast_object"] = hvd.broadcast_object({"r": R, "t": torch.ones(2) * R},
                                              root_rank=1)["r"] == 1
ok["allgather_object"] = [o["r"] for o in hvd.allgather_object({"r": R})] == list(range(N))
ok["adasum"] = repr(hvd.Adasum) == "hvd.Adasum"  # exported since issue 13
try:
    hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1),
                             named_parameters=[("w", torch.nn.Parameter(torch.ones(1)))])
    ok["named_validation"] = False
except hvd.DDLConfigError as exc:
    ok["named_validation"] = "not in it" in str(exc)
try:
    p = torch.nn.Parameter(torch.ones(1))
    q = torch.nn.Parameter(torch.ones(1))
    hvd.DistributedOptimizer(torch.optim.SGD([p, q], lr=1),
                             named_parameters=[("w", p), ("w", q)])
    ok["named_unique"] = False
except hvd.DDLConfigError as exc:
    ok["named_unique"] = "unique" in str(exc)

# ------------------------------------------- broadcast parameters + optimizer state
torch.manual_seed(100 + R)  # every rank starts different
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
opt = torch.optim.Adam(net.parameters(), lr=0.01 * (R + 1))
if R != 0:  # root has no state yet; the others have some: root's (empty) state must win
    net(torch.randn(4, 8)).sum().backward()
    opt.step()
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
dopt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
for _ in range(2):
    dopt.zero_grad()
    torch.manual_seed(7 + R)
    net(torch.randn(4, 8)).pow(2).mean().backward()
    dopt.step()
# (BatchNorm's running statistics follow each rank's own data, as in Horovod: skip them.)
flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
ok["broadcast_identical"] = all(eq(f, flat) for f in hvd.allgather(flat.reshape(1, -1)))
ok["lr_from_root"] = opt.param_groups[0]["lr"] == 0.01
moments = torch.cat([s["exp_avg_sq"].reshape(-1) for s in opt.state.values()])
ok["adam_state_identical"] = all(eq(m, moments) for m in hvd.allgather(moments.reshape(1, -1)))

# ------------- a new optimizer's state made as Horovod does: zero grads, one step
class _NoGrad(torch.nn.Module):  # Horovod's test_broadcast_state_no_grad model
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1, 3]).int(), requires_grad=False)
        self.b = torch.nn.Parameter(torch.rand(4) + R)


ng = _NoGrad()
ng_opt = hvd.DistributedOptimizer(
    torch.optim.SGD(ng.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True),
    named_parameters=ng.named_parameters())
hvd.broadcast_parameters(ng.state_dict(), root_rank=0)
ng_b = ng.b.detach().clone()
hvd.broadcast_optimizer_state(ng_opt, root_rank=0)
ok["new_state_grad"] = ng.a.grad is None and eq(ng.b.grad, torch.zeros(4))
ok["new_state_grad_broadcast"] = eq(hvd.broadcast(ng.b.grad, root_rank=0), ng.b.grad)
ok["new_state_made"] = "momentum_buffer" in ng_opt.state_dict()["state"].get(1, {})
ok["new_state_params_kept"] = eq(ng.b, ng_b)  # the zero-grad step's weight decay undone
ok["new_state_identical"] = all(eq(f, ng.b.detach()) for f in
                                hvd.allgather(ng.b.detach().reshape(1, -1)))

# ------------------------------------------------ a parameter used on rank 0 only
torch.manual_seed(0)
lin, extra = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
params = list(lin.parameters()) + list(extra.parameters())
o = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), fusion_threshold_bytes=64)
for _ in range(3):
    o.zero_grad()
    out = lin(torch.ones(2, 4) * (R + 1))
    if R == 0:
        out = extra(out)
    out.sum().backward()
    o.step()
flat = torch.cat([p.detach().reshape(-1) for p in params])
ok["partial_use_identical"] = all(eq(f, flat) for f in hvd.allgather(flat.reshape(1, -1)))
print(json.dumps({"rank": R, "failed": [k for k, v in ok.items() if not v]}))
