"""Horovod process sets on ddl.torch (Horovod's test shapes: even and odd ranks), checked
against numpy; prints one JSON report per rank."""

import json
import sys

import numpy as np
import torch

import ddl.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
failed: list[str] = []
ran: list[str] = []


def check(name, got, want):
    ran.append(name)
    got = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    if got.shape != np.asarray(want).shape or not np.array_equal(got, want):
        failed.append(f"{name}: got {got.tolist()} want {np.asarray(want).tolist()}")


even = [r for r in range(N) if r % 2 == 0]
odd = [r for r in range(N) if r % 2 == 1]
even_set = hvd.add_process_set(even)
odd_set = hvd.add_process_set(hvd.ProcessSet(odd))
mine, members = (even_set, even) if R % 2 == 0 else (odd_set, odd)
check("ids", [even_set.process_set_id, odd_set.process_set_id], [1, 2])
check("size", mine.size(), len(members))
check("rank", mine.rank(), members.index(R))
check("included", [even_set.included(), odd_set.included()], [R % 2 == 0, R % 2 == 1])

for i in range(3):  # interleaved with global calls: each set keeps its own sequence
    x = torch.tensor([float(R), float(i)], dtype=torch.float64)
    check(f"allreduce_sum/{i}", hvd.allreduce(x, op=hvd.Sum, process_set=mine),
          np.array([sum(members), i * len(members)], dtype=np.float64))
    check(f"allreduce_avg/{i}", hvd.allreduce(x, process_set=mine),
          np.array([sum(members) / len(members), i], dtype=np.float64))
    check(f"global/{i}", hvd.allreduce(x, op=hvd.Sum),
          np.array([sum(range(N)), i * N], dtype=np.float64))
ints = torch.tensor([R + 1, 7], dtype=torch.int32)
check("allreduce_int_avg", hvd.allreduce(ints, process_set=mine),
      np.trunc(np.array([sum(r + 1 for r in members), 7 * len(members)]) / len(members))
      .astype(np.int32))
g = hvd.allgather(torch.full((R + 1, 2), R, dtype=torch.int64), process_set=mine)
check("allgather", g, np.concatenate([np.full((r + 1, 2), r) for r in members]))
for root in members:
    check(f"broadcast/root={root}", hvd.broadcast(torch.tensor([R * 1.0]), root,
                                                  process_set=mine), np.array([root * 1.0],
                                                                              np.float32))
    check(f"broadcast_object/root={root}",
          hvd.broadcast_object({"from": R}, root, process_set=mine)["from"], root)
check("allgather_object", hvd.allgather_object(R, process_set=mine), members)
ga = hvd.grouped_allreduce([torch.ones(3) * R, torch.ones(2, dtype=torch.float64)],
                           op=hvd.Sum, process_set=mine)
check("grouped_allreduce/0", ga[0], np.full(3, sum(members), np.float32))
check("grouped_allreduce/1", ga[1], np.full(2, len(members), np.float64))
rows = 2 * len(members) + 1
rs = hvd.reducescatter(torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2),
                       op=hvd.Sum, process_set=mine)
split = [rows // len(members) + (1 if k < rows % len(members) else 0)
         for k in range(len(members))]
lo = sum(split[:members.index(R)])
full = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) * len(members)
check("reducescatter", rs, full[lo:lo + split[members.index(R)]])
k = len(members)
a2a = hvd.alltoall(torch.arange(k, dtype=torch.float32) + 10 * R, process_set=mine)
check("alltoall", a2a, np.array([10 * r + members.index(R) for r in members], np.float32))
hvd.barrier(process_set=mine)

# autograd through a set: allreduce's gradient is the set's allreduce
w = torch.ones(2, requires_grad=True)
hvd.allreduce(w * (R + 1), op=hvd.Sum, process_set=mine).sum().backward()
# d/dw of sum(allreduce(w * (R + 1))): the set's Sum of the upstream ones, times R + 1
check("grad", w.grad, np.full(2, float(len(members) * (R + 1)), np.float32))

# a mismatch inside one set raises on that set's ranks; the set goes on afterwards
if len(members) > 1:
    try:
        hvd.allreduce(torch.zeros(2 + members.index(R)), process_set=mine)
        failed.append("mismatch: no error")
    except hvd.DDLMismatchError as exc:
        ran.append("mismatch")
        if "process set" not in str(exc):
            failed.append(f"mismatch message: {exc}")
    check("after_mismatch", hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=mine),
          np.array([float(len(members))], np.float32))

# a rank outside a set may not call it
other = odd_set if mine is even_set else even_set
try:
    hvd.allreduce(torch.ones(1), process_set=other)
    failed.append("outside: no error")
except hvd.DDLConfigError as exc:
    ran.append("outside")
    if "not in" not in str(exc):
        failed.append(f"outside message: {exc}")

# Horovod's private table of the sets, which its tests read
table = hvd.mpi_ops._basics._get_process_set_ids_and_ranks()
if table != {0: list(range(N)), 1: even, 2: odd}:
    failed.append(f"ids_and_ranks: {table}")
# sets go with remove_process_set (collective), and with shutdown; init(process_sets=)
check("remove", [hvd.remove_process_set(odd_set), hvd.remove_process_set(even_set)],
      [True, True])
table = hvd.mpi_ops._basics._get_process_set_ids_and_ranks()
if table != {0: list(range(N))}:
    failed.append(f"ids_and_ranks after remove: {table}")
# removed ids are given again, the first removed first, as Horovod's ProcessSetTable does
again = [hvd.add_process_set([0]), hvd.add_process_set([N - 1]) if N > 1 else None]
check("reused_ids", [again[0].process_set_id, again[1].process_set_id if N > 1 else 1],
      [2, 1])
check("reused_allreduce", hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum,
                                        process_set=again[0]) if R == 0 else [1.0], [1.0])
for ps in again:
    if ps is not None:
        hvd.remove_process_set(ps)
try:  # every rank is the global set: a duplicate, as in Horovod
    hvd.add_process_set(range(N))
    failed.append("a set of every rank was accepted")
except ValueError as exc:
    if "exists already (id 0)" not in str(exc):
        failed.append(f"duplicate of the global set: {exc}")
check("remove_again", hvd.remove_process_set(even_set), False)
check("removed_id", even_set.process_set_id is None, True)
hvd.shutdown()
pair = hvd.ProcessSet([0, N - 1] if N > 2 else [N - 1])  # not every rank: that is global
hvd.init(process_sets=[pair])
check("init_sets_id", pair.process_set_id, 1)
if R in pair.ranks:
    check("init_sets_allreduce", hvd.allreduce(torch.tensor([R * 1.0]), op=hvd.Sum,
                                               process_set=pair),
          np.array([float(N - 1)], np.float32))
check("global_after", hvd.allreduce(torch.ones(1), op=hvd.Sum), np.array([N * 1.0],
                                                                         np.float32))
hvd.shutdown()
print(json.dumps({"rank": R, "ran": ran, "failed": failed}))
sys.exit(0)
