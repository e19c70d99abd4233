"""A torchtitan-style training run for the integration tests: torchtitan's optimizer and LR
scheduler containers and its CheckpointManager (fastpersist's subclass), FSDP2 on a CPU mesh.

    RANK=r WORLD_SIZE=w MASTER_ADDR=... MASTER_PORT=... \\
        python tests/integration_torchtitan_child.py DIR STEPS KILL_STEP MODE [STOP]

torchtitan's Trainer needs an accelerator (it sets a CUDA device), so this mirrors its
checkpoint calls: ``checkpointer.load()`` at start (the latest step-N), then per step the
optimizer step, ``checkpointer.save(step, last_step=...)`` (interval 1, keep_latest_k=2) and,
before the next step's optimizer update, ``maybe_wait_for_staging()``. MODE is torchtitan's
``async_mode`` ("disabled" or "async"). Rank 0 appends "STEP LOSS_HEX" (the loss of its batch)
to DIR/losses-<pid>.txt. KILL_STEP > 0: every rank's writer SIGKILLs its process on its second
write request of that step's checkpoint. Batches are a function of (step, rank). STOP: end
after that step (the LR schedule is still STEPS long: torchtitan saves the schedule's length in
the scheduler's state, so a shorter run is not the same run).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from fastpersist.config import configure
from fastpersist.storage.faults import FaultyBackend
from fastpersist.integrations.torchtitan import FastPersistCheckpointManager
from helpers import leave
from integration_util import kill_faults


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def main() -> None:
    d, steps, kill, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    stop = int(sys.argv[5]) if len(sys.argv) > 5 else steps  # stop after this step (the schedule is for `steps`)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    configure(chunk_bytes=64 * 1024, num_buffers=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim_config = default_adamw(lr=1e-3)
    optim_config.implementation = "foreach"
    optimizers = optim_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)
    train_state = TrainState()
    config = FastPersistCheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=2,
                                                 async_mode=mode, last_save_model_only=False)
    checkpointer = config.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=schedulers, states={"train_state": train_state}, sd_adapter=None,
                                base_folder=d)
    checkpointer.backend = FaultyBackend(kill_faults(kill, f"step-{kill.split(':')[0]}{os.sep}"))
    checkpointer.load()  # the latest step-N, if any (torchtitan's own lookup)
    out = os.path.join(d, f"losses-{os.getpid()}.txt")
    for step in range(train_state.step + 1, min(steps, stop) + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=g)
        loss = nn.functional.mse_loss(model(x), x.flip(-1))
        loss.backward()
        checkpointer.maybe_wait_for_staging()  # as torchtitan's trainer, before the update
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        if rank == 0:
            with open(out, "a") as f:
                f.write(f"{step} {loss.item().hex()}\n")
        train_state.step = step
        checkpointer.save(step, last_step=step == steps)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()  # the job has reported; see helpers.leave
