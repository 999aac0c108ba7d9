"""Hugging Face Accelerate on the ddl backend: the process group is made first
(``dist.init_process_group(BACKEND)``), so ``Accelerator(cpu=True)`` adopts it instead of
choosing its own; then a training loop with ``accelerator.prepare``/``backward``, gradient
accumulation, ``gather_for_metrics`` and ``reduce``.

Usage: ddlrun -n 2 python client_accelerate.py {ddl,gloo}
"""

import torch
import torch.distributed as dist
from client_common import backend_from_argv, digest, report
from torch.utils.data import DataLoader, TensorDataset

BACKEND = backend_from_argv()
dist.init_process_group(BACKEND)  # before Accelerator: it then skips its own setup

from accelerate import Accelerator  # noqa: E402 - after the process group, on purpose
from accelerate.utils import set_seed  # noqa: E402

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
start = digest(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
train = TensorDataset(torch.randn(96, 16, generator=g), torch.randint(0, 4, (96,), generator=g))
val = TensorDataset(torch.randn(40, 16, generator=g), torch.randint(0, 4, (40,), generator=g))
model, optimizer, train_dl, val_dl = accelerator.prepare(
    model, optimizer, DataLoader(train, batch_size=4, shuffle=True),
    DataLoader(val, batch_size=8))
steps = 0
for _epoch in range(2):
    model.train()
    for x, y in train_dl:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            steps += accelerator.sync_gradients
model.eval()
preds, labels = [], []
with torch.no_grad():
    for x, y in val_dl:
        p, t = accelerator.gather_for_metrics((model(x).argmax(1), y))
        preds.append(p)
        labels.append(t)
correct = int((torch.cat(preds) == torch.cat(labels)).sum())
seen = int(torch.cat(labels).numel())
mean_rank = accelerator.reduce(torch.tensor(float(accelerator.process_index)), "mean")
accelerator.wait_for_everyone()
report(start=start, digest=digest(accelerator.unwrap_model(model)), steps=steps,
       val_correct=correct, val_seen=seen, mean_rank=float(mean_rank),
       distributed_type=str(accelerator.distributed_type),
       num_processes=accelerator.num_processes)
