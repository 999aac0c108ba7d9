"""The Hugging Face Transformers ``Trainer`` on the ddl backend: the process group is made
first (``dist.init_process_group(BACKEND)``), so ``TrainingArguments(use_cpu=True)`` adopts
it; a one-layer GPT-2 built from a config (nothing downloaded) trains on synthetic token
sequences, then ``trainer.evaluate()`` runs the distributed evaluation loop.

Usage: ddlrun -n 2 python client_transformers.py {ddl,gloo}
(with HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_DISABLED=true ...: no network)
"""

import tempfile

import torch
import torch.distributed as dist
from client_common import backend_from_argv, digest, report

BACKEND = backend_from_argv()
dist.init_process_group(BACKEND)  # before TrainingArguments: it then skips its own setup

from transformers import (  # noqa: E402 - after the process group, on purpose
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
)


class Tokens(torch.utils.data.Dataset):
    """Synthetic sequences: every token is the previous one plus 1 (mod vocab), so the loss
    falls as the model learns."""

    def __init__(self, n: int, seed: int, vocab: int = 64, length: int = 16) -> None:
        start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (start + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
torch.manual_seed(0)
model = GPT2LMHeadModel(config)
start = digest(model)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, max_steps=8, learning_rate=1e-2,
                             logging_steps=4, save_strategy="no", report_to="none", seed=0,
                             data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 1),
                      eval_dataset=Tokens(24, 2))
    result = trainer.train()
    evaluation = trainer.evaluate()
report(start=start, digest=digest(model), steps=trainer.state.global_step,
       train_loss=result.training_loss, eval_loss=evaluation["eval_loss"],
       losses=[e["loss"] for e in trainer.state.log_history if "loss" in e],
       parallel_mode=str(args.parallel_mode), world_size=args.world_size)
