"""One rank of a job launched the way torchrun launches it (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment; ``init_process_group`` through env://) that saves through
fastpersist and then returns from main, for tests/test_clean_exit.py.

    python clean_exit_child.py LAYER FLAGS ROOT

LAYER: ``checkpointer`` (saves with a Checkpointer), ``dcp`` (dcp.save and dcp.async_save
through fastpersist.dcp on FSDP2 state, then dcp.load), ``raise`` (a Checkpointer with a save
in flight, then an exception escapes main: exit status 1, never a signal), ``late`` (the job's
own collectives released late by gloo, in a process that imported fastpersist).
FLAGS (comma-separated, may be empty): ``close`` (Checkpointer.close() before returning),
``wait`` (Checkpointer.wait() before returning), ``destroy`` (destroy_process_group()
before returning). Without ``close`` or ``wait`` the last save is still in flight when main
returns. Prints ``done <rank>`` as main returns.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def checkpointer(root: str, flags: set[str]) -> None:
    import fastpersist as fp

    ck = fp.Checkpointer(root, keep=2)
    w = torch.randn(500_000, generator=torch.Generator().manual_seed(0))
    for step in range(3):
        w.add_(1.0)
        ck.save(step, {"w": w, "step": step})
    if "wait" in flags:
        ck.wait()
    if "close" in flags:
        ck.close()


def dcp(root: str, flags: set[str]) -> None:
    import torch.distributed.checkpoint as dcp
    from helpers import fsdp_mlp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fastpersist.dcp import Reader, Writer

    m, opt = fsdp_mlp(dist.get_world_size())
    m(torch.randn(8, 48)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    roots = [os.path.join(root, "a"), os.path.join(root, "b")]
    dcp.save(sd, storage_writer=Writer(roots))
    dcp.async_save(sd, storage_writer=Writer(roots)).result()
    dcp.load(sd, storage_reader=Reader(roots))


def late(root: str, flags: set[str]) -> None:
    """Collectives whose tensors gloo releases after the caller moved on: 200 all-reduces of
    tensors Python forgets at once, only the last one waited for. The other gloo worker may
    still hold its last collective's tensors as main returns; their release needs the GIL."""
    import fastpersist.dist  # noqa: F401 - a process that uses fastpersist's distributed layer

    work = None
    for i in range(200):
        work = dist.all_reduce(torch.full((64,), float(i)), async_op=True)
    work.wait()


def raising(root: str, flags: set[str]) -> None:
    checkpointer(root, flags)
    raise RuntimeError("training failed (on purpose)")


def main() -> None:
    faulthandler.enable()  # a fatal signal prints every thread's stack
    layer, flags, root = sys.argv[1], set(filter(None, sys.argv[2].split(","))), sys.argv[3]
    dist.init_process_group("gloo")
    {"checkpointer": checkpointer, "dcp": dcp, "late": late, "raise": raising}[layer](root, flags)
    if "destroy" in flags:
        dist.destroy_process_group()
    print(f"done {dist.get_rank() if dist.is_initialized() else os.environ['RANK']}", flush=True)


if __name__ == "__main__":
    main()
