"""hvd.SyncBatchNorm on ranks with unequal batches against one torch BatchNorm over the
whole batch (outputs, input gradients, summed weight gradients, running statistics)."""

import json
import sys

import torch

import ddl.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
torch.set_default_dtype(torch.float64)  # compare at float64 precision
failed, ran = [], []


def close(name, got, want, tol=1e-9):
    ran.append(name)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol):
        diff = (got - want).abs().max().item() if got.shape == want.shape else got.shape
        failed.append(f"{name}: max diff {diff}")


def both(sync, ref, xs, gs, rows):
    """One step of ``sync`` on this rank's batch and of ``ref`` on the whole batch: this
    rank's (output, input gradient) from each."""
    x = xs[R].clone().requires_grad_(True)
    out = sync(x)
    (out * gs[R]).sum().backward()
    xa = torch.cat(xs).clone().requires_grad_(True)
    outa = ref(xa)
    (outa * torch.cat(gs)).sum().backward()
    mine = slice(sum(rows[:R]), sum(rows[:R + 1]))
    return out.detach(), x.grad, outa.detach()[mine], xa.grad[mine]


for shape_tail, label in (((), "2d"), ((3, 2), "4d")):
    C = 5
    rows = [r + 2 for r in range(N)]  # unequal per-rank batches
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn((n, C) + shape_tail, generator=gen) * 3 + 1 for n in rows]
    gs = [torch.randn((n, C) + shape_tail, generator=gen) for n in rows]
    for momentum in (0.1, None):
        sync = hvd.SyncBatchNorm(C, momentum=momentum)
        ref = torch.nn.BatchNorm1d(C, momentum=momentum) if not shape_tail else \
            torch.nn.BatchNorm2d(C, momentum=momentum)
        with torch.no_grad():
            w = torch.linspace(0.5, 1.5, C)
            sync.weight.copy_(w), ref.weight.copy_(w)
            sync.bias.fill_(0.25), ref.bias.fill_(0.25)
        for step in range(2):
            out, dx, out_ref, dx_ref = both(sync, ref, xs, gs, rows)
            tag = f"{label}/m={momentum}/step{step}"
            close(f"out/{tag}", out, out_ref)
            close(f"dx/{tag}", dx, dx_ref)
            dw = hvd.allreduce(sync.weight.grad.clone(), op=hvd.Sum)
            db = hvd.allreduce(sync.bias.grad.clone(), op=hvd.Sum)
            close(f"dweight/{tag}", dw, ref.weight.grad)
            close(f"dbias/{tag}", db, ref.bias.grad)
            close(f"running_mean/{tag}", sync.running_mean, ref.running_mean)
            close(f"running_var/{tag}", sync.running_var, ref.running_var)
            for m in (sync, ref):
                m.weight.grad = None
                m.bias.grad = None
        sync.eval(), ref.eval()
        close(f"eval/{label}/m={momentum}", sync(xs[R]), ref(xs[R]))

# float32 (the statistics in the input's dtype, combined in float64): a mean far from 0
gen = torch.Generator().manual_seed(11)
rows = [r + 2 for r in range(N)]
xs = [(torch.randn((n, 4, 3, 3), generator=gen) * 2 + 50).float() for n in rows]
gs = [torch.randn((n, 4, 3, 3), generator=gen).float() for n in rows]
sync, ref = hvd.SyncBatchNorm(4).float(), torch.nn.BatchNorm2d(4).float()
out, dx, out_ref, dx_ref = both(sync, ref, xs, gs, rows)
close("float32/out", out, out_ref, tol=1e-4)
close("float32/dx", dx, dx_ref, tol=1e-4)
close("float32/running_var", sync.running_var, ref.running_var, tol=1e-5)

try:
    hvd.SyncBatchNorm(3)(torch.zeros(3))
    failed.append("1d input accepted")
except ValueError:
    ran.append("1d_error")
print(json.dumps({"rank": R, "ran": ran, "failed": failed}))
hvd.shutdown()
sys.exit(0)
