"""PyTorch Lightning on the ddl backend: ``DDPStrategy(process_group_backend=BACKEND)``, a
fit of a small classifier with a validation loop whose metrics are logged with
``sync_dist=True`` (a float loss, an int64 count, both reduced across ranks).

Usage: ddlrun -n 2 python client_lightning.py {ddl,gloo}
"""

import os
import tempfile
import warnings

import lightning as L
import torch
from client_common import backend_from_argv, digest, report
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

BACKEND = backend_from_argv()
warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, float casts, ...)


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        correct = (logits.argmax(1) == y).sum()  # int64
        self.log("val_correct", correct, sync_dist=True, reduce_fx="sum")
        self.log("val_rank", torch.tensor(self.global_rank), sync_dist=True)  # int64 mean

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(seed: int, n: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    return DataLoader(ds, batch_size=8)  # Lightning adds the DistributedSampler


L.seed_everything(0, verbose=False)
model = Classifier()
start = digest(model)
with tempfile.TemporaryDirectory() as root:
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        num_nodes=1, strategy=DDPStrategy(process_group_backend=BACKEND),
                        max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=root)
    trainer.fit(model, data(1, 128), data(2, 64))
metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
# What the last validation must have logged: the whole validation set (each rank saw half of
# it) through the final weights, computed here on one rank without any collective
x, y = data(2, 64).dataset.tensors
with torch.no_grad():
    logits = model.net(x)
expected = {"val_loss": float(torch.nn.functional.cross_entropy(logits, y)),
            "val_correct": int((logits.argmax(1) == y).sum()), "val_rank": 0.5}
report(start=start, digest=digest(model), steps=trainer.global_step, metrics=metrics,
       expected=expected, strategy=type(trainer.strategy).__name__,
       pg_backend=trainer.strategy.process_group_backend)
