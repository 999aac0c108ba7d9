"""The DistributedOptimizer attributes Horovod's tests and scripts read, with Horovod's
meaning, on a plain optimizer and on the Adasum one. Prints one JSON line per rank."""

import json
import sys
import warnings

import torch

import ddl.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
out = {"rank": R}

model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
model[1].bias.requires_grad_(False)
inner = torch.optim.SGD([{"params": model[0].parameters()},
                         {"params": model[1].parameters()}], lr=0.1)
opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                               backward_passes_per_step=2, gradient_predivide_factor=2.0)
named = dict(model.named_parameters())
out["parameter_names"] = (opt._parameter_names == {p: n for n, p in named.items()})
out["requires_update"] = (opt._requires_update
                          == {p for p in named.values() if p.requires_grad})
out["public"] = [opt.backward_passes_per_step, opt.op is hvd.Average,
                 opt.gradient_predivide_factor, opt.sparse_as_dense,
                 opt.process_set is hvd.global_process_set]
out["find_duplicates"] = sorted(opt.find_duplicates(["a", "b", "a", "c", "b"]))
trainable = [p for p in named.values() if p.requires_grad]


def backward():
    torch.nn.functional.mse_loss(model(torch.ones(2, 3) * (R + 1)), torch.zeros(2, 1)).backward()


out["delay_fresh"] = sorted(opt._allreduce_delay.values())
out["handles_fresh"] = len(opt._handles)
backward()  # first of two passes: nothing launched yet
out["delay_after_one"] = sorted(opt._allreduce_delay.values())
out["handles_after_one"] = len(opt._handles)
backward()  # the second: every bucket launched
out["handles_after_two"] = (set(opt._handles) == set(trainable))
out["synchronized_before"] = opt._synchronized
opt.synchronize()
out["synchronized_after"] = opt._synchronized
out["handles_after_sync"] = len(opt._handles)
with opt.skip_synchronize():
    out["should_synchronize_inside"] = opt._should_synchronize
    opt.step()
out["should_synchronize_after"] = opt._should_synchronize
out["synchronized_after_step"] = opt._synchronized
# Horovod's setter: a new count, this step's count restarted
opt.set_backward_passes_per_step(1)
out["set_bpps"] = [opt.backward_passes_per_step, sorted(opt._allreduce_delay.values())]
opt.backward_passes_per_step = 3
out["assign_bpps"] = sorted(opt._allreduce_delay.values())
opt.backward_passes_per_step = 1
opt.zero_grad()
backward()
opt.step()
# load_state_dict restarts the step's counts, as Horovod's
opt.zero_grad()
opt.set_backward_passes_per_step(2)
backward()
opt.load_state_dict(opt.state_dict())
out["delay_after_load"] = sorted(opt._allreduce_delay.values())
opt.zero_grad()
backward()
backward()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt.step()

# Horovod's test_optimizer_no_named_parameters: unique names, the same on every rank
m2 = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
o2 = hvd.DistributedOptimizer(torch.optim.SGD(
    [{"params": m2[0].parameters()}, {"params": m2[1].parameters()}], lr=0.001))
names = o2._parameter_names
everyone = hvd.allgather_object(sorted(names.values()))
out["noname"] = (len(names) == 4 and len(set(names.values())) == 4
                 and all(e == everyone[0] for e in everyone))

# the Adasum optimizer (N a power of two) has Horovod's attributes too
m3 = torch.nn.Linear(2, 1)
o3 = hvd.DistributedOptimizer(torch.optim.SGD(m3.parameters(), lr=0.1),
                              named_parameters=m3.named_parameters(), op=hvd.Adasum)
out["adasum"] = [type(o3).__name__, o3._parameter_names == {p: n for n, p in
                                                             m3.named_parameters()},
                 o3._requires_update == set(m3.parameters()), o3._handles,
                 sorted(o3._allreduce_delay.values()), o3.backward_passes_per_step]
print(json.dumps(out))
hvd.shutdown()
sys.exit(0)
