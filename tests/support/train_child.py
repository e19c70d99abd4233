"""A small training run that checkpoints every step, for the SIGKILL-and-resume test.

    python tests/train_child.py DIR STEPS MODE [HOLD_STEP]

MODE ``none`` trains without checkpoints (the reference run); ``overlap`` saves a checkpoint of
the model, the optimizer, the data stream and the RNG after every step over two roots, DIR/r0
and DIR/r1, resuming first from the latest committed checkpoint there if there is one (it
prints "resumed from step N"). With HOLD_STEP, the second data write of that step's checkpoint
(there are at least two: a data file per root) does not happen: the writing thread
prints "holding" and waits there for the parent's SIGKILL (so the kill lands in the middle of a
checkpoint write, every time). After each step the run prints "step N loss HEX" (float.hex, so
runs compare bit for bit).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from fastpersist.checkpointer import Checkpointer
from fastpersist.storage.faults import HoldWrite
from fastpersist.state import RNGState

class Data:
    """A stream of batches with its own generator: a stateful object in the checkpoint."""

    def __init__(self, width: int = 32) -> None:
        self.gen = torch.Generator().manual_seed(3)
        self.width = width

    def next(self) -> torch.Tensor:
        return torch.randn(16, self.width, generator=self.gen)

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])


def main() -> None:
    directory, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    hold = int(sys.argv[4]) if len(sys.argv) > 4 else None
    torch.set_num_threads(1)  # bit-reproducible losses across runs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data, rng = Data(), RNGState()
    start, ck = 0, None
    if mode != "none":
        backend = HoldWrite(hold, lambda: print("holding", flush=True)) if hold is not None else None
        roots = [os.path.join(directory, "r0"), os.path.join(directory, "r1")]
        ck = Checkpointer(roots, mode=mode, keep=2, backend=backend)
        if mode == "overlap":
            ck.protect(opt)
        if ck.latest_step() is not None:
            state = ck.load("latest", into={"model": model, "optim": opt, "data": data})
            ck.load_rank_state(into={"rng": rng})
            start = int(state["step"]) + 1
            print(f"resumed from step {state['step']}", flush=True)
    for step in range(start, steps):
        x = data.next()
        loss = nn.functional.mse_loss(model(x), x.flip(-1))  # dropout draws from the restored RNG
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item().hex()}", flush=True)
        if ck is not None:
            ck.save(step, {"model": model, "optim": opt, "data": data, "step": step}, rank_state={"rng": rng})
    if ck is not None:
        ck.close()


if __name__ == "__main__":
    main()
