"""The training program the crash harness (``_bench.crash``) runs, kills and resumes.

It trains the model of ``_bench.models`` deterministically (one intra-op thread, deterministic
algorithms, plain attention), checkpoints every step in overlap mode and prints every loss as
``step N loss HEX`` (``float.hex``: bit for bit). With ``--stall-at N --signal-fd FD`` it stalls
inside the write of step N's checkpoint, at the second write request to that checkpoint's data
files (so the first has gone out, and the checkpoint has no manifest), after writing one byte to
FD: the harness kills it on that byte, so the kill lands mid-write every time, not by chance.

    cd benchmarks && python -m _bench.crash_child --help
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from _bench.models import ModelSpec, build, train_step
from fastpersist.checkpointer import Checkpointer
from fastpersist.storage.faults import HoldWrite
from fastpersist.state import RNGState

STALLED = b"s"  # what the stalled writer sends


def _signal(fd: int) -> None:
    """Tell the parent this process is held mid-write (it sends SIGKILL then)."""
    os.write(fd, STALLED)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m _bench.crash_child", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the checkpoint root")
    p.add_argument("--spec", default="{}", help="the model, as JSON fields of _bench.models.ModelSpec")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--mode", default="overlap", choices=["overlap", "none"], help="none: no checkpoints")
    p.add_argument("--device", default="cpu")
    p.add_argument("--resume", action="store_true", help="resume from the latest committed checkpoint")
    p.add_argument("--stall-at", type=int, default=None, metavar="STEP",
                   help="stall in the write of this step's checkpoint (needs --signal-fd)")
    p.add_argument("--signal-fd", type=int, default=None, help="where to say that the write has stalled")
    args = p.parse_args(argv)
    if (args.stall_at is None) != (args.signal_fd is None):
        p.error("--stall-at and --signal-fd go together")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    model, opt, data = build(ModelSpec(**json.loads(args.spec)), device, fast=False)
    rng = RNGState()
    torch.manual_seed(1)  # the dropout stream starts here, on CPU and CUDA alike
    start, ck = 0, None
    if args.mode != "none":
        backend = HoldWrite(args.stall_at, lambda: _signal(args.signal_fd)) if args.stall_at is not None else None
        ck = Checkpointer(args.dir, mode="overlap", keep=2, backend=backend)
        ck.protect(opt)
        if args.resume and ck.latest_step() is not None:
            state = ck.load("latest", into={"model": model, "optim": opt, "data": data}, map_location=device)
            ck.load_rank_state(into={"rng": rng}, map_location=device)  # GPU tensors: RNGState moves them back
            start = int(state["step"]) + 1
            print(f"resumed from step {state['step']}", flush=True)
    for step in range(start, args.steps):
        loss = train_step(model, opt, data)
        print(f"step {step} loss {loss.hex()}", flush=True)
        if ck is not None:
            ck.save(step, {"model": model, "optim": opt, "data": data, "step": step}, rank_state={"rng": rng})
    if ck is not None:
        ck.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
