"""A training-like process for the crash suite: it saves checkpoints until it is killed.

    python tests/crash_child.py ROOT0,ROOT1 MODE[+inc] KILL_POINT KILL_AT DELAY_S

KILL_POINT is a protocol point (the process SIGKILLs itself there, on the KILL_AT-th time it
passes it), "mid-save" (the second data write request of step KILL_AT's save does not happen:
the writing thread prints "holding" and waits there for the parent's SIGKILL, so the kill lands
while that save's data is being written), or "none" (the parent kills it at a random instant).
Each write request sleeps DELAY_S, so a save spans many instants. It prints "ready" once, then
"committed N" after each checkpoint it saw committed. ``MODE+inc`` saves incrementally: the
state's "frozen" tensor (the same at every step) is then reused, not written again.
"""

from __future__ import annotations

import sys

import torch

from fastpersist.checkpointer import Checkpointer
from fastpersist.config import IOConfig
from fastpersist.storage.faults import Fault, FaultyBackend, HoldWrite

def _holding() -> None:
    """Tell the parent the save is held mid-write (it kills this process then)."""
    sys.stdout.write("holding\n")
    sys.stdout.flush()


FROZEN = torch.randn(1_100_000, generator=torch.Generator().manual_seed(0))  # 2 incremental units


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "frozen": FROZEN,
        "w": torch.randn(150_000, generator=g),
        "tiny": [torch.randn(5, generator=g) for _ in range(20)],
        "step": step,
    }


def main() -> None:
    roots, mode, point, at, delay = sys.argv[1].split(","), sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    mode, _, incremental = mode.partition("+")
    faults = [Fault("write", None, at=0, delay_s=delay)] if delay else []
    if point not in ("none", "mid-save"):
        faults.append(Fault("event", None, point=point, at=at, kill=True))
    backend = HoldWrite(at, _holding, faults=faults) if point == "mid-save" else FaultyBackend(faults)
    config = IOConfig(chunk_bytes=64 * 1024, num_buffers=2, zero_copy_min_bytes=8192)
    ck = Checkpointer(roots, mode=mode, keep=3, backend=backend, config=config, incremental=incremental == "inc")
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    if mode == "overlap":
        ck.protect(opt)
    print("ready", flush=True)
    step = 1 + (ck.latest_step() or 0)
    while True:
        s = state(step)
        ck.save(step, s).wait()
        print(f"committed {step}", flush=True)
        if point == "mid-save" and step >= at:
            sys.exit(f"step {step} committed: its save was to be held mid-write")  # exit 1, the test fails
        step += 1
        if step > 10_000:
            return


if __name__ == "__main__":
    main()
