"""An accelerate training loop for the integration tests (tiny random-init MLP with dropout).

    python tests/integration_accelerate_child.py DIR KILL_STEP [REFERENCE_DIR]

Trains STEPS steps (shuffled data, dropout, AdamW, a step LR schedule, a registered custom
object), a checkpoint every step through AcceleratorCheckpointer, resuming from DIR/ckpt when
a checkpoint is there. Rank 0 appends "STEP LOSS_HEX" to DIR/losses-<pid>.txt. KILL_STEP > 0:
the writer thread SIGKILLs the process on its second write request of that step's checkpoint.
With REFERENCE_DIR, an uninterrupted run follows in the same process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn

from fastpersist.config import IOConfig
from fastpersist.storage.faults import FaultyBackend
from fastpersist.integrations.accelerate import AcceleratorCheckpointer
from helpers import leave
from integration_util import kill_faults

STEPS = 8


class Counter:
    """A custom object registered for checkpointing."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = int(state["seen"])


def run(d: str, kill: str, *, steps: int = STEPS, accelerator: Accelerator | None = None,
        resume_step: int | None = None, after_load: Callable[[Accelerator, nn.Module, Any], None] | None = None) -> None:
    """Train to ``steps`` (resuming from ``resume_step``, else the latest checkpoint) on
    ``accelerator`` (default: ddp, or one process); ``after_load(accelerator, model, optimizer)``
    runs after a resume's load."""
    set_seed(0)
    # a seedable sampler draws its order from (seed, epoch), not from the global RNG (as accelerate
    # itself needs for an exact resume of a shuffled loader)
    accelerator = accelerator or Accelerator(cpu=True,
                                             dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    # BatchNorm: buffers each ddp process updates from its own batch (not replicated)
    model = nn.Sequential(nn.Linear(32, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    faults = kill_faults(kill, f"step-{int(kill.split(':')[0]):08d}")
    ckpt = AcceleratorCheckpointer(accelerator, os.path.join(d, "ckpt"), keep=2, backend=FaultyBackend(faults),
                                   config=IOConfig(chunk_bytes=64 * 1024, num_buffers=2))
    latest = ckpt.latest_step() if resume_step is None else resume_step
    start = 0 if latest is None else latest + 1
    if latest is not None:
        ckpt.load_state(latest, load_rng=False)
        if counter.seen != start:
            raise RuntimeError(f"the registered object was not restored: {counter.seen} != {start}")
        if after_load is not None:
            after_load(accelerator, model, opt)
    out = os.path.join(d, f"losses-{os.getpid()}.txt")
    for step, (x,) in enumerate(accelerator.skip_first_batches(loader, start), start):
        if step == start and latest is not None:
            ckpt.load_rng_state(latest)  # after the loader drew its seed, as the first run did
        if step >= steps:
            break
        loss = nn.functional.mse_loss(model(x), x.flip(-1))
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.seen += 1
        if accelerator.is_main_process:
            with open(out, "a") as f:
                f.write(f"{step} {loss.item().hex()}\n")
        ckpt.save_state(step)
    ckpt.close()


def main() -> None:
    run(sys.argv[1], sys.argv[2])
    if len(sys.argv) > 3:
        run(sys.argv[3], "0")


if __name__ == "__main__":
    main()
    leave()  # the job has reported; see helpers.leave
