"""The "ddl" torch.distributed backend: every collective DDP and users call, DDP on ddl vs
DDP on gloo (same job, same seed, same data), new_group, and clear errors."""

import copy
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddl
import ddl.torch  # noqa: F401 - registers the "ddl" backend

torch.set_num_threads(1)
dist.init_process_group("ddl", init_method="env://")
R, N = dist.get_rank(), dist.get_world_size()
ok: dict[str, bool] = {}
ok["backend"] = dist.get_backend() == "ddl"

# ----------------------------------------------------------------- collectives
t = torch.full((5,), float(R + 1))
dist.all_reduce(t)
ok["all_reduce"] = bool(torch.equal(t, torch.full((5,), N * (N + 1) / 2)))
t = torch.full((3,), float(R))
dist.all_reduce(t, op=dist.ReduceOp.MAX)
ok["all_reduce_max"] = bool(torch.equal(t, torch.full((3,), float(N - 1))))
t = torch.full((3,), float(R))
dist.all_reduce(t, op=dist.ReduceOp.AVG)
ok["all_reduce_avg"] = bool(torch.allclose(t, torch.full((3,), (N - 1) / 2)))
w = dist.all_reduce(torch.ones(2), async_op=True)
w.wait()
fut_val = dist.all_reduce(torch.ones(4), async_op=True).get_future().wait()
ok["async"] = bool(torch.equal(fut_val[0], torch.full((4,), float(N))))
b = torch.arange(6.0) if R == N - 1 else torch.zeros(6)
dist.broadcast(b, src=N - 1)
ok["broadcast"] = bool(torch.equal(b, torch.arange(6.0)))
outs = [torch.empty(2, 3) for _ in range(N)]
dist.all_gather(outs, torch.full((2, 3), float(R)))
ok["all_gather"] = all(bool((o == i).all()) for i, o in enumerate(outs))
big = torch.empty(N * 2, 3)
dist.all_gather_into_tensor(big, torch.full((2, 3), float(R)))
ok["all_gather_into_tensor"] = bool(torch.equal(big[::2, 0], torch.arange(float(N))))
inp = torch.arange(N * 4, dtype=torch.float32).reshape(N * 2, 2) + R
out = torch.empty(2, 2)
dist.reduce_scatter_tensor(out, inp)
want = (torch.arange(N * 4, dtype=torch.float32).reshape(N * 2, 2) * N
        + N * (N - 1) / 2)[2 * R:2 * R + 2]
ok["reduce_scatter_tensor"] = bool(torch.equal(out, want))
out = torch.empty(3)
dist.reduce_scatter(out, [torch.full((3,), float(j + R)) for j in range(N)])
ok["reduce_scatter"] = bool(torch.equal(out, torch.full((3,), float(R * N + N * (N - 1) / 2))))
r = torch.full((2,), float(R + 1))
dist.reduce(r, dst=0)
ok["reduce"] = bool(torch.equal(r, torch.full((2,), N * (N + 1) / 2))) if R == 0 else bool(
    torch.equal(r, torch.full((2,), float(R + 1))))
a2a = torch.empty(N)
dist.all_to_all_single(a2a, torch.arange(N, dtype=torch.float32) + 10 * R)
ok["all_to_all_single"] = bool(torch.equal(a2a, torch.arange(N, dtype=torch.float32) * 10 + R))
dist.barrier()
objs = [None] * N
dist.all_gather_object(objs, {"rank": R})
ok["all_gather_object"] = objs == [{"rank": i} for i in range(N)]
lst = [f"from {R}"]
dist.broadcast_object_list(lst, src=0)
ok["broadcast_object_list"] = lst == ["from 0"]
# point-to-point (a ring: each rank sends to the next, receives from the previous)
sent = torch.full((3,), float(R))
got = torch.empty(3)
reqs = [dist.isend(sent, dst=(R + 1) % N), dist.irecv(got, src=(R - 1) % N)]
for q in reqs:
    q.wait()
ok["send_recv"] = got.tolist() == [float((R - 1) % N)] * 3

# -------------------------------------------------------------------- groups
everyone_gloo = dist.new_group(backend="gloo")
pair = dist.new_group(ranks=[0, 1], backend="ddl")  # a strict subset when N > 2
rest = dist.new_group(ranks=list(range(2, N)), backend="ddl") if N > 3 else None
mine = pair if R in (0, 1) else rest
if mine is not None:
    members = [0, 1] if R in (0, 1) else list(range(2, N))
    me, size = members.index(R), len(members)
    t = torch.full((2,), float(R + 1))
    dist.all_reduce(t, group=mine)
    ok["subgroup"] = bool(torch.equal(t, torch.full((2,), float(sum(members) + size))))
    backend = mine  # torch hands back what the backend's creator made
    if size == N:  # every rank: the job's own engine
        ok["subgroup_is_ddl"] = type(backend).__name__ == "DDLProcessGroup"
    else:  # shared memory of its own
        ok["subgroup_is_ddl"] = (type(backend).__name__ == "DDLProcessGroup"
                                 and list(backend._group.ranks) == members
                                 and backend._group.engine.name == "shm")
    b = torch.full((3,), float(R))
    dist.broadcast(b, src=members[-1], group=mine)  # a job rank, as torch takes it
    ok["subgroup_broadcast"] = bool(torch.equal(b, torch.full((3,), float(members[-1]))))
    gathered = torch.empty(size * 2)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(R)), group=mine)
    ok["subgroup_all_gather"] = gathered.tolist() == [float(r) for r in members for _ in (0, 1)]
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(size * 2, dtype=torch.float32), group=mine)
    ok["subgroup_reduce_scatter"] = rs.tolist() == [size * (2.0 * me), size * (2.0 * me + 1)]
    a2a = torch.empty(size)
    dist.all_to_all_single(a2a, torch.full((size,), float(R)), group=mine)
    ok["subgroup_alltoall"] = a2a.tolist() == [float(r) for r in members]
    dist.barrier(group=mine)
    if members[0] == R:
        dist.send(torch.full((2,), 7.0), dst=members[-1], group=mine)
    elif members[-1] == R:
        p2p = torch.empty(2)
        dist.recv(p2p, src=members[0], group=mine)
        ok["subgroup_send_recv"] = p2p.tolist() == [7.0, 7.0]
    if size < N:  # destroying the sub-group releases its shared memory
        ddl_group = backend._group
        dist.destroy_process_group(mine)
        ok["subgroup_destroyed"] = ddl_group.closed
everyone_ddl = dist.new_group(backend="ddl")
t = torch.ones(3)
dist.all_reduce(t, group=everyone_ddl)
ok["full_new_group"] = bool(torch.equal(t, torch.full((3,), float(N))))

# ------------------------------------------------------ DDP: ddl vs gloo
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                          torch.nn.ReLU(), torch.nn.Linear(64, 5))
nets = {"ddl": copy.deepcopy(net), "gloo": copy.deepcopy(net)}
if R == 1:  # DDP's broadcast from rank 0 must fix this
    with torch.no_grad():
        for m in nets.values():
            m[0].weight.add_(1.0)
models = {"ddl": DDP(nets["ddl"], bucket_cap_mb=0.01),
          "gloo": DDP(nets["gloo"], process_group=everyone_gloo, bucket_cap_mb=0.01)}
opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
ds = torch.utils.data.TensorDataset(torch.randn(64, 20, generator=torch.Generator().manual_seed(1)),
                                    torch.randint(0, 5, (64,),
                                                  generator=torch.Generator().manual_seed(2)))
sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        for k in ("ddl", "gloo"):
            opts[k].zero_grad()
            torch.nn.functional.cross_entropy(models[k](x), y).backward()
            opts[k].step()
diff = max(float((a - b).detach().abs().max()) for a, b in zip(nets["ddl"].parameters(),
                                                      nets["gloo"].parameters()))
bitwise = all(torch.equal(a, b) for a, b in zip(nets["ddl"].parameters(),
                                               nets["gloo"].parameters()))
flat = torch.cat([p.detach().reshape(-1) for p in nets["ddl"].parameters()])
same = [torch.empty_like(flat) for _ in range(N)]
dist.all_gather(same, flat)
ok["ddp_ranks_identical"] = all(torch.equal(s, flat) for s in same)
ok["ddp_vs_gloo"] = diff <= 1e-6
del models, opts, nets  # DDP wrappers before their process groups
dist.destroy_process_group()
print(json.dumps({"rank": R, "failed": [k for k, v in ok.items() if not v], "diff": diff,
                  "bitwise": bitwise}), flush=True)
# Rarely (about 1 run in 10 in CI), torch aborted here during interpreter teardown
# ("terminate called without an active exception") after everything above had finished, in
# this job that mixes DDP on gloo and on ddl. Leave without running C++ static destructors.
# The root cause is not found yet; the closing note of the session that added this says so.
ddl.shutdown()
os._exit(0)
