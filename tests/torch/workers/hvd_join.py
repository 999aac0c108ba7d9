"""hvd.join() with Horovod's semantics, in one job (one process start per rank count):

- train: uneven batch counts under a DistributedOptimizer, three epochs (rank 0 one batch
  while the others have 3, so they re-plan the fusion buckets while it is joined and it must
  adopt their plan; rank r r+2 batches; rank r N-r batches), resyncing from the last joiner
  after each, against an in-process reference of Horovod's rule (joined ranks contribute
  zero gradients, the average divides by N);
- collectives: allreduce Sum/Average/Min/Max/Product (+ async, in place, grouped, scaled,
  16-bit Average bit for bit) and barrier while ranks have joined, each against numpy with
  joined ranks' contributions zero; allgather (+ async, grouped), alltoall, broadcast (from
  a running or a joined root, broadcast_parameters), reduce_scatter (+ grouped) and the
  object collectives raise on every running rank as in Horovod ("... is not supported with
  Join at this time"), and the job stays in step after each; join's return value;
- mismatch: ranks calling allreduce with different shapes/ops, or different collectives,
  get a DDLMismatchError on every rank naming the ranks and shapes, and stay in step.

Prints one JSON line: {"train": {...}, "collectives": {...}, "mismatch": {...}}.
"""

import json
import time
import traceback

import numpy as np
import torch

import ddl
import ddl.torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
report: dict = {}


# ------------------------------------------------------------------------- train
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 6)
        self.b = torch.nn.Linear(6, 6)
        self.c = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def batch(epoch, rank, step):
    g = torch.Generator().manual_seed(100_000 * epoch + 1000 * rank + step)
    return (torch.randn(4, 5, generator=g, dtype=torch.float64),
            torch.randn(4, 2, generator=g, dtype=torch.float64))


def loss_of(net, epoch, rank, step):
    x, y = batch(epoch, rank, step)
    return torch.nn.functional.mse_loss(net(x), y)


def new_model():
    torch.manual_seed(0)
    return Net().double()


def max_diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def reference_epoch(net, opt, epoch, steps):
    """Horovod's rule in one process: at global step s the ranks still running contribute
    their gradients, joined ones zeros, and the sum is divided by N. Returns the parameters
    after each global step."""
    snaps = []
    for s in range(max(steps)):
        total = [torch.zeros_like(p) for p in net.parameters()]
        for r in range(N):
            if s < steps[r]:
                net.zero_grad()
                loss_of(net, epoch, r, s).backward()
                for t, p in zip(total, net.parameters()):
                    t += p.grad
        for t, p in zip(total, net.parameters()):
            p.grad = t / N
        opt.step()
        snaps.append([p.detach().clone() for p in net.parameters()])
    return snaps


def snap_diff(net, snap):
    return max(float((p - q).abs().max()) for p, q in zip(net.parameters(), snap))


def run_epoch(net, opt, epoch, steps):
    for s in range(steps[R]):
        opt.zero_grad()
        loss_of(net, epoch, R, s).backward()
        opt.step()
    return hvd.join()


def train():
    out = {}
    net, ref = new_model(), new_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=net.named_parameters(),
                                   fusion_threshold_bytes=200)  # several buckets
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    out["buckets"] = len(opt.buckets)
    # epoch 0: rank 0 has one batch, so the others re-plan the buckets (after their second
    # step) while it is joined; epoch 1: rank r has r+2 batches; epoch 2: N-r batches.
    for epoch, steps in enumerate([[1] + [3] * (N - 1), [r + 2 for r in range(N)],
                                   [N - r for r in range(N)]]):
        snaps = reference_epoch(ref, ref_opt, epoch, steps)
        t0 = time.perf_counter()
        last = run_epoch(net, opt, epoch, steps)
        out[f"e{epoch}_seconds"] = round(time.perf_counter() - t0, 2)
        out[f"e{epoch}_last"] = last
        # A joined rank stops stepping: its parameters are those after its own last step.
        out[f"e{epoch}_own_diff"] = snap_diff(net, snaps[steps[R] - 1])
        # Horovod's recipe after join: continue from the rank that saw every step.
        hvd.broadcast_parameters(net.state_dict(), root_rank=last)
        hvd.broadcast_optimizer_state(opt, root_rank=last)
        out[f"e{epoch}_final_diff"] = max_diff(net, ref)
    # every rank holds the same fusion plan, rank 0 included (it was joined when the others
    # re-planned in epoch 2)
    plans = hvd.allgather_object([b.members for b in opt.buckets])
    out["plans_equal"] = all(p == plans[0] for p in plans)
    out["replanned"] = opt._exchange.replanned
    return out


# ------------------------------------------------------------------ collectives
def value(rank, dtype=torch.float64):
    return torch.tensor([rank + 1.0, -(rank + 1.0), 2.5 * rank - 1.0, 3.0], dtype=dtype)


def expected(op, active, dtype=torch.float64):
    """numpy with Horovod's rule: joined ranks contribute zeros; Average divides by N."""
    rows = np.stack([value(r, dtype).numpy() if r in active else
                     np.zeros(4, dtype=value(0, dtype).numpy().dtype) for r in range(N)])
    if op == "sum":
        return rows.sum(0)
    if op == "average":
        return rows.sum(0) / N
    return {"min": rows.min(0), "max": rows.max(0), "product": rows.prod(0)}[op]


def raises(fn, *words):
    t0 = time.perf_counter()
    try:
        fn()
    except ddl.DDLError as e:
        msg = str(e)
        return {"ok": all(w in msg for w in words), "seconds": time.perf_counter() - t0,
                "msg": msg[:400], "type": type(e).__name__, "exc": e}
    return {"ok": False, "msg": "did not raise"}


def check_running(ok, active, tag):
    """What the running ranks check while the ranks outside ``active`` are joined."""
    for name, op in [("sum", hvd.Sum), ("average", hvd.Average), ("min", hvd.Min),
                     ("max", hvd.Max), ("product", hvd.Product)]:
        got = hvd.allreduce(value(R), op=op)
        ok[f"{tag}allreduce_{name}"] = np.allclose(got.numpy(), expected(name, active),
                                                   rtol=0, atol=1e-12)
    got = hvd.allreduce(value(R, torch.int32), op=hvd.Sum)
    ok[f"{tag}allreduce_int32"] = np.array_equal(got.numpy(),
                                                 expected("sum", active, torch.int32))
    # Horovod's default op is Average, with the joined ranks counted in the divisor
    ok[f"{tag}allreduce_default_average"] = np.allclose(
        hvd.allreduce(value(R)).numpy(), expected("average", active))
    # async calls keep their order with the control exchanges
    hs = [hvd.allreduce_async(value(R, torch.float32), op=hvd.Sum, name="a"),
          hvd.allreduce_async(value(R), op=hvd.Max, name="b"),
          hvd.allreduce_async(value(R), op=hvd.Min)]
    a, b, m = (hvd.synchronize(h) for h in hs)
    ok[f"{tag}async"] = (np.allclose(a.numpy(), expected("sum", active, torch.float32))
                         and np.allclose(b.numpy(), expected("max", active))
                         and np.allclose(m.numpy(), expected("min", active)))
    y = value(R)
    hvd.allreduce_(y, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    ok[f"{tag}allreduce_inplace_scaled"] = np.allclose(y.numpy(), expected("sum", active) / 2)
    grouped = hvd.grouped_allreduce([value(R), value(R, torch.float32), value(R)],
                                    op=hvd.Average)
    ok[f"{tag}grouped"] = all(np.allclose(t.numpy(), expected("average", active), atol=1e-6)
                              for t in grouped)
    inplace = [value(R), value(R)]
    hvd.grouped_allreduce_(inplace, op=hvd.Sum)
    ok[f"{tag}grouped_inplace"] = all(np.allclose(t.numpy(), expected("sum", active))
                                      for t in inplace)
    # 16-bit Average with joined ranks, bit for bit Horovod's: the sum (joined ranks add
    # zeros), then one scale by postscale / size() in float32
    for dt, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
        mine = (value(R, torch.float32) / 3).to(dt)
        got = hvd.allreduce(mine, op=hvd.Average, postscale_factor=1.5)
        total = sum(((value(r, torch.float32) / 3).to(dt) for r in active),
                    torch.zeros(4, dtype=dt)) if dt == torch.float16 else sum(
            ((value(r, torch.float32) / 3).to(dt).float() for r in active),
            torch.zeros(4)).to(dt)
        want = (total.float() * torch.tensor(1.5 / N, dtype=torch.float32)).to(dt)
        ok[f"{tag}average_{name}_bitwise"] = torch.equal(got.view(torch.int16),
                                                         want.view(torch.int16))
    # integer Average, as Horovod: a Sum on every rank (joined ones too), then * (1 / size),
    # truncated toward zero
    ia = hvd.allreduce(torch.full((3,), -7 * (R + 1), dtype=torch.int64))
    ok[f"{tag}int_average"] = ia.tolist() == [int(-7 * sum(r + 1 for r in active) * (1 / N))] * 3
    # Horovod's controller refuses these while a rank has joined: every running rank raises
    # (the joined ones serve on), each call checked to leave the job in step
    joined = [r for r in range(N) if r not in active]
    root = active[-1]
    net = torch.nn.Linear(3, 2)
    send = torch.cat([torch.full((j + 1, 2), float(10 * R + j)) for j in range(N)])
    refused = [
        ("allgather", lambda: hvd.allgather(torch.full((R + 1, 3), float(R))),
         "Allgather is not supported with Join at this time. Specify sparse_to_dense=True"),
        ("allgather_async", lambda: hvd.synchronize(hvd.allgather_async(torch.ones(R + 1))),
         "Allgather is not supported with Join"),
        ("grouped_allgather", lambda: hvd.grouped_allgather(
            [torch.full((R + 1, 3), float(R)), torch.full((1,), float(R))]),
         "Allgather is not supported with Join"),
        ("alltoall", lambda: hvd.alltoall(send, splits=[j + 1 for j in range(N)]),
         "Alltoall is not supported with Join at this time."),
        ("broadcast_running_root", lambda: hvd.broadcast(torch.full((2, 3), float(R)),
                                                         root_rank=root),
         "Broadcast is not supported with Join at this time."),
        ("broadcast_joined_root", lambda: hvd.broadcast(torch.zeros(3),
                                                        root_rank=joined[0]),
         "Broadcast is not supported with Join"),
        ("broadcast_parameters", lambda: hvd.broadcast_parameters(net.state_dict(),
                                                                  root_rank=root),
         "Broadcast is not supported with Join"),
        ("reduce_scatter", lambda: hvd.reduce_scatter(torch.full((2 * N, 3), float(R + 1)),
                                                      op=hvd.Sum),
         "Reducescatter is not supported with Join at this time."),
        ("grouped_reducescatter", lambda: hvd.grouped_reducescatter(
            [torch.full((2 * N, 3), float(R + 1)), torch.full((N,), R + 1)], op=hvd.Sum),
         "Reducescatter is not supported with Join"),
        ("broadcast_object", lambda: hvd.broadcast_object({"a": 1}, root_rank=active[0]),
         "join", "broadcast_object"),
        ("allgather_object", lambda: hvd.allgather_object(R), "join", "allgather_object"),
    ]
    for name, fn, *words in refused:
        res = raises(fn, *words, f"rank {joined[0]}")
        ok[f"{tag}{name}_raises"] = (res["ok"] and res["seconds"] < 5
                                     and isinstance(res.get("exc"), RuntimeError))
        if not ok[f"{tag}{name}_raises"]:
            ok[f"{tag}{name}_msg"] = res["msg"]
        # in step: the next call pairs with the same call everywhere
        ok[f"{tag}{name}_then_in_step"] = np.allclose(
            hvd.allreduce(value(R), op=hvd.Sum, name=f"after_{name}").numpy(),
            expected("sum", active))
    hvd.barrier()
    ok[f"{tag}barrier"] = True
    # still in step after the errors
    ok[f"{tag}after_errors"] = np.allclose(hvd.allreduce(value(R), op=hvd.Sum).numpy(),
                                           expected("sum", active))


def collectives():
    ok: dict = {}
    for first in sorted({0, N - 1}):
        tag = f"first{first}_"
        active = [r for r in range(N) if r != first]
        if first == R:
            ok[f"{tag}ret"] = hvd.join()
        else:
            check_running(ok, active, tag)
            # the last running rank does one more allreduce, served by all the others, so
            # it is the last to join whatever the timing
            late = active[-1]
            if late != R:
                ok[f"{tag}ret"] = hvd.join()
            else:
                got = hvd.allreduce(value(R), op=hvd.Sum)
                ok[f"{tag}only_one_running"] = np.allclose(got.numpy(), expected("sum", [R]))
                ok[f"{tag}ret"] = hvd.join()
        ok[f"{tag}ret"] = ok[f"{tag}ret"] == active[-1]
    # nobody has joined: join is a barrier that returns the same rank everywhere
    last = hvd.join()
    ok["plain_join_agrees"] = hvd.allgather(torch.tensor([last])).tolist() == [last] * N
    return ok


# ---------------------------------------------------------------------- mismatch
def mismatch():
    ok: dict = {}
    res = raises(lambda: hvd.allreduce(torch.ones(4 + (R == 1), 2), op=hvd.Sum),
                 "rank 1: hvd.allreduce(float32[5x2]", "hvd.allreduce(float32[4x2]")
    ok["shape"] = res["ok"] and res["type"] == "DDLMismatchError"
    ok["shape_msg"] = res["msg"]
    res = raises(lambda: hvd.allreduce(torch.ones(3), op=hvd.Max if R == 0 else hvd.Sum),
                 "op=Max", "op=Sum")
    ok["op"] = res["ok"]
    res = raises(lambda: (hvd.allgather(torch.ones(2, 2)) if R == 0
                          else hvd.allreduce(torch.ones(2, 2))), "allgather", "allreduce")
    ok["kind"] = res["ok"]
    res = raises(lambda: hvd.broadcast(torch.ones(2), root_rank=R), "root_rank")
    ok["root"] = res["ok"]
    ok["in_step_after"] = float(hvd.allreduce(torch.ones(1), op=hvd.Sum)) == N
    if N >= 3:  # a mismatch between running ranks while another one has joined
        if R == 0:
            hvd.join()
        else:
            res = raises(lambda: hvd.allreduce(torch.ones(2 + R)), "hvd.join()",
                         "float32[3]", "float32[4]")
            ok["with_joined"] = res["ok"]
            # a call that fails on the last rank only (bool with Average) fails on every
            # running rank; the joined one serves on
            res = raises(lambda: hvd.allreduce(
                torch.ones(2, dtype=torch.bool) if R == N - 1 else torch.ones(2)),
                "Average is not defined")
            ok["failure_with_joined"] = res["ok"] and (R == N - 1 or "failed here" in res["msg"])
            ok["with_joined_then_sum"] = float(hvd.allreduce(torch.ones(1), op=hvd.Sum)) == N - 1
            hvd.join()
    return ok


for part in (train, collectives, mismatch):
    try:
        report[part.__name__] = part()
    except Exception:  # report it rather than hang the others
        report[part.__name__] = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps(report), flush=True)
        raise
print(json.dumps(report), flush=True)
