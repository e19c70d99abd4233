"""Lightning with fastpersist: a checkpoint every step, written while the next steps run.

    python examples/lightning_example.py [DIR]

Trains a tiny random-init model on random data for 20 steps on the CPU, then starts a new
Trainer that resumes from ``last.ckpt`` and trains to step 30. No downloads; well under a minute.
"""

from __future__ import annotations

import os
import sys
import tempfile

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from fastpersist.integrations.lightning import AsyncFastPersistCheckpointIO


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = nn.functional.mse_loss(self.net(x), x.flip(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer(directory: str, steps: int) -> pl.Trainer:
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=1, save_top_k=2,
                                  monitor="step", mode="max", save_last=True)
    return pl.Trainer(accelerator="cpu", max_steps=steps, plugins=[AsyncFastPersistCheckpointIO()],
                      callbacks=[checkpoints], logger=False, enable_model_summary=False)


def main() -> None:
    directory = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fastpersist-lightning-")
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4096, 64)), batch_size=32)
    trainer(directory, 20).fit(Regressor(), data)
    print("checkpoints:", sorted(os.listdir(directory)))
    resumed = trainer(directory, 30)
    resumed.fit(Regressor(), data, ckpt_path=os.path.join(directory, "last.ckpt"))
    print(f"resumed from last.ckpt and trained to step {resumed.global_step}; checkpoints in {directory}")


if __name__ == "__main__":
    main()
