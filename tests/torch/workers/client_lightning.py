"""PyTorch Lightning on the ddl backend: ``DDPStrategy(process_group_backend=BACKEND)``, a
fit of a small classifier with a validation loop whose metrics are logged with
``sync_dist=True`` (a float loss, an int64 count, both reduced across ranks), then
``validate`` and ``test`` (their steps run under ``torch.inference_mode()``, so the tensors
reduced are inference tensors), a checkpoint, and a second Trainer that resumes the fit from
it for one more epoch.

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

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("test_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("test_correct", (logits.argmax(1) == y).sum(), sync_dist=True, reduce_fx="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(seed: int, n: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    return DataLoader(ds, batch_size=8)  # Lightning adds the DistributedSampler


def trainer(root: str, epochs: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                     num_nodes=1, strategy=DDPStrategy(process_group_backend=BACKEND),
                     max_epochs=epochs, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=root)


def on_one_rank(model: Classifier, loader: DataLoader) -> dict:
    """The loss and count of correct answers of ``model`` on the whole of ``loader``'s data,
    computed here without any collective: what the sync_dist metrics must say."""
    x, y = loader.dataset.tensors
    with torch.no_grad():
        logits = model.net(x)
    return {"loss": float(torch.nn.functional.cross_entropy(logits, y)),
            "correct": int((logits.argmax(1) == y).sum())}


def floats(d: dict) -> dict:
    return {k: float(v) for k, v in d.items()}


L.seed_everything(0, verbose=False)
model = Classifier()
start = digest(model)
with tempfile.TemporaryDirectory() as root:
    fit = trainer(root, 2)
    fit.fit(model, data(1, 128), data(2, 64))
    metrics = floats(fit.callback_metrics)
    fit_digest, fit_steps = digest(model), fit.global_step
    # What the last validation must have logged: the whole validation set (each rank saw
    # half of it) through the final weights
    want_val = on_one_rank(model, data(2, 64))
    expected = {"val_loss": want_val["loss"], "val_correct": want_val["correct"],
                "val_rank": 0.5}
    validated = floats(fit.validate(model, data(2, 64), verbose=False)[0])
    tested = floats(fit.test(model, data(3, 64), verbose=False)[0])
    want_test = on_one_rank(model, data(3, 64))
    # the checkpoint in rank 0's folder, whose path every rank learns from rank 0
    ckpt = fit.strategy.broadcast(os.path.join(root, "fit.ckpt"))
    fit.save_checkpoint(ckpt)
    resumed_model = Classifier()
    resumed = trainer(root, 3)
    resumed.fit(resumed_model, data(1, 128), data(2, 64), ckpt_path=ckpt)
    resumed.strategy.barrier()  # rank 0 keeps the folder until every rank has read it
resumed_metrics = floats(resumed.callback_metrics)
want_resumed = on_one_rank(resumed_model, data(2, 64))
report(start=start, digest=digest(resumed_model), steps=resumed.global_step,
       fit_digest=fit_digest, fit_steps=fit_steps, metrics=metrics, expected=expected,
       validated=validated, tested=tested,
       expected_test={"test_loss": want_test["loss"], "test_correct": want_test["correct"]},
       resumed_metrics=resumed_metrics,
       expected_resumed={"val_loss": want_resumed["loss"],
                         "val_correct": want_resumed["correct"]},
       strategy=type(fit.strategy).__name__, pg_backend=fit.strategy.process_group_backend)
