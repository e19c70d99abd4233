"""A training process that saves through ``Checkpointer(engine="process")`` and then ends in
one of several ways, for tests/multiprocess/test_save_process.py.

    python save_process_child.py HOW ROOT OUT

Every save's state is ``{"w": w, "step": step}`` with ``w`` a 2 MiB tensor filled with ``step``.
The child saves step 1 and waits for its commit, writes ``OUT/pids`` (its own pid and its save
process's), then per HOW:

* ``sigkill``, ``exit``, ``raise``: saves step 2 (save() returns once it is captured) and at once
  SIGKILLs itself, calls ``os._exit(3)``, or lets an exception escape main;
* ``return``: saves step 2 and returns from main without close();
* ``loop``: saves every 50 ms until a signal ends it (``OUT/looping`` written after the first).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import fastpersist as fp


def state(step: int) -> dict:
    return {"w": torch.full((1 << 19,), float(step)), "step": step}


def main(how: str, root: str, out: str) -> None:
    ck = fp.Checkpointer(root, engine="process", keep=3)
    ck.save(1, state(1)).result()
    with open(os.path.join(out, "pids"), "w") as f:
        f.write(f"{os.getpid()} {ck._remote.pid}")
    if how == "loop":
        step = 2
        while True:
            ck.save(step, state(step))
            if step == 3:
                open(os.path.join(out, "looping"), "w").close()
            step += 1
            time.sleep(0.05)
    ck.save(2, state(2))  # captured: the save process holds it whole
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(3)
    elif how == "raise":
        raise RuntimeError("training failed")


if __name__ == "__main__":
    main(*sys.argv[1:4])
