"""A Lightning FSDP2 run (ModelParallelStrategy's mesh, fully_shard) for the integration tests.

    python tests/integration_lightning_fsdp_child.py DIR STEPS DEVICES KILL_STEP RESUME

Trains a tiny random-init model sharded with FSDP2 over DEVICES CPU processes (gloo) through
``FastPersistModelParallelStrategy``, with a checkpoint every step
(``ModelCheckpoint(every_n_train_steps=1, save_top_k=2, save_last=True)`` in DIR/ckpt). Rank 0
appends "GLOBAL_STEP LOSS_HEX" to DIR/losses-<pid>.txt for every step (the loss of rank 0's
batch). With KILL_STEP > 0 every rank's writer SIGKILLs its process on its second write request
of the checkpoint of global step KILL_STEP. RESUME is a checkpoint path or "none". Batches are a
function of (global step, rank).
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard

from fastpersist.config import IOConfig
from fastpersist.storage.faults import FaultyBackend
from fastpersist.integrations.lightning import AsyncFastPersistCheckpointIO, FastPersistModelParallelStrategy
from integration_lightning_child import Tiny
from helpers import leave
from integration_util import kill_faults


class Sharded(Tiny):
    """The ddp test's module, sharded with FSDP2 over the strategy's data-parallel mesh."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def main() -> None:
    d, steps, devices, kill_step, resume = sys.argv[1:6]
    torch.manual_seed(0)
    model = Sharded(os.path.join(d, f"losses-{os.getpid()}.txt"))
    # ModelCheckpoint saves step=G.ckpt, then last.ckpt, at every global step G >= 1: the
    # plugin's sequence number of step=G.ckpt is 2 * (G - 1)
    seq = 2 * (int(kill_step.split(":")[0]) - 1)
    faults = kill_faults(kill_step, f"step-{seq:08d}")
    io = AsyncFastPersistCheckpointIO(backend=FaultyBackend(faults), config=IOConfig(chunk_bytes=64 * 1024,
                                                                                      num_buffers=2))
    strategy = FastPersistModelParallelStrategy(data_parallel_size=int(devices), tensor_parallel_size=1,
                                                checkpoint_io=io, process_group_backend="gloo")
    ckpt = ModelCheckpoint(dirpath=os.path.join(d, "ckpt"), filename="{step}", every_n_train_steps=1,
                           save_top_k=2, monitor="step", mode="max", save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=int(devices), strategy=strategy, max_steps=int(steps),
                         callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(model, ckpt_path=None if resume == "none" else resume)


if __name__ == "__main__":
    main()
    leave()  # the job has reported; see helpers.leave
