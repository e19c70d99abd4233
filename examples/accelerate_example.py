"""accelerate with fastpersist: ``save_state`` / ``load_state`` through a Checkpointer.

    python examples/accelerate_example.py [DIR]

Trains a tiny random-init model for 20 steps on the CPU with a checkpoint every step (the
write overlaps the next step), then resumes from the latest checkpoint in a fresh loop and
trains to step 30. Launch with ``accelerate launch --num_processes 2 --cpu`` for two processes.
"""

from __future__ import annotations

import sys
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn

from fastpersist.integrations.accelerate import AcceleratorCheckpointer


def train(directory: str, steps: int) -> None:
    set_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Dropout(0.1), nn.Linear(512, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4096, 64)), batch_size=32,
                                       shuffle=True)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    with AcceleratorCheckpointer(accelerator, directory, keep=2) as ckpt:
        latest = ckpt.latest_step()
        start = 0 if latest is None else ckpt.load_state(latest, load_rng=False)["step"] + 1
        for step, (x,) in enumerate(accelerator.skip_first_batches(data, start), start):
            if step >= steps:
                break
            if step == start and latest is not None:
                ckpt.load_rng_state(latest)  # after the loader drew its seed, as the first run did
            loss = nn.functional.mse_loss(model(x), x.flip(-1))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            ckpt.save_state(step)  # returns at once
            if step % 5 == 0:
                accelerator.print(f"step {step} loss {loss.item():.4f}")
    accelerator.print(f"trained steps {start}..{steps - 1}; checkpoints in {directory}")


def main() -> None:
    directory = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fastpersist-accelerate-")
    train(directory, 20)
    train(directory, 30)  # resumes from step 19


if __name__ == "__main__":
    main()
