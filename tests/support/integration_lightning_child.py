"""A Lightning training run for the integration tests: checkpoint every step, maybe killed.

    python tests/integration_lightning_child.py DIR STEPS DEVICES IO KILL_STEP RESUME

Trains a tiny random-init model for STEPS optimizer steps on DEVICES CPU processes (ddp with
gloo when 2: fastpersist's DDP strategy, every rank writing its share, for the sharded formats)
with a checkpoint every step through IO ("async", "sharded" or "file"),
``ModelCheckpoint(every_n_train_steps=1, save_top_k=2, save_last=True)`` in DIR/ckpt. Rank 0
appends "GLOBAL_STEP LOSS_HEX" to DIR/losses-<pid>.txt for every step. With KILL_STEP > 0 the
writer thread SIGKILLs the process on its second write request of the checkpoint of global step
KILL_STEP (so the kill lands in the middle of writing it). RESUME is a checkpoint path, "last" or
"none".
Batches are a function of (global step, rank), so the data position is the global step.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from fastpersist.config import IOConfig
from fastpersist.storage.faults import FaultyBackend
from fastpersist.integrations.lightning import AsyncFastPersistCheckpointIO, FastPersistCheckpointIO, FastPersistDDPStrategy
from helpers import leave
from integration_util import kill_faults


class Tiny(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        # BatchNorm: buffers each ddp rank updates from its own batch (not replicated)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Tanh(), nn.Linear(256, 64))
        self.out = out

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        x = torch.randn(32, 64, generator=g)
        loss = nn.functional.mse_loss(self.net(x), x.flip(-1))
        if self.global_rank == 0:
            with open(self.out, "a") as f:
                f.write(f"{self.global_step} {loss.item().hex()}\n")
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.zeros(10_000, 1), batch_size=1)


def checkpoint_io(kind: str, kill: str) -> FastPersistCheckpointIO:
    if kind == "file":
        return FastPersistCheckpointIO("file")
    # The plugin stages checkpoints under sequence numbers; ModelCheckpoint saves step=G.ckpt, then
    # last.ckpt, at every global step G >= 1: step=G.ckpt is sequence number 2 * (G - 1).
    seq = 2 * (int(kill.split(":")[0]) - 1)
    faults = kill_faults(kill, f"step-{seq:08d}")
    kwargs = {"backend": FaultyBackend(faults), "config": IOConfig(chunk_bytes=64 * 1024, num_buffers=2)}
    if kind == "async":
        return AsyncFastPersistCheckpointIO(**kwargs)
    return FastPersistCheckpointIO("sharded", **kwargs)


def main() -> None:
    d, steps, devices, kind, kill_step, resume = sys.argv[1:7]
    torch.manual_seed(0)
    model = Tiny(os.path.join(d, f"losses-{os.getpid()}.txt"))
    ckpt = ModelCheckpoint(dirpath=os.path.join(d, "ckpt"), filename="{step}", every_n_train_steps=1,
                           save_top_k=2, monitor="step", mode="max", save_last=True)
    io = checkpoint_io(kind, kill_step)
    strategy: object = "auto"
    if int(devices) > 1:
        strategy = "ddp" if kind == "file" else FastPersistDDPStrategy(checkpoint_io=io, process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=int(devices), strategy=strategy,
                         max_steps=int(steps), plugins=[io] if strategy in ("auto", "ddp") else [], callbacks=[ckpt],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(model, ckpt_path=None if resume == "none" else resume)


if __name__ == "__main__":
    main()
    leave()  # the job has reported; see helpers.leave
