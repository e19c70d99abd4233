"""How a benchmark saves: the baselines a fastpersist save is compared with, each durable like
fastpersist's (``torch.save`` with an fsync, torch.distributed.checkpoint with ``sync_files``), and
the contenders of a training loop that checkpoints every iteration (:class:`Saver` and its kinds).
"""

from __future__ import annotations

import inspect
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from _bench.measure import remove
from _bench.models import Tokens
from fastpersist.checkpointer import Checkpointer
from fastpersist.config import IOConfig
from fastpersist.state import RNGState

# ------------------------------------------------------------------------------- one save


def save_torch(state: object, path: str) -> None:
    """``torch.save`` into ``path``, then fsync."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def dcp_single_process(fn: Callable[..., Any]) -> dict[str, Any]:
    """Keyword arguments that run DCP's ``fn`` in this one process: ``no_dist=True`` where the
    torch version has it, else a one-rank gloo group (created once)."""
    import torch.distributed as dist

    if "no_dist" in inspect.signature(fn).parameters:
        return {"no_dist": True}
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="fastpersist-dcp-"), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return {}


def save_dcp(state: dict[str, Any], path: str, threads: int = 4) -> None:
    """DCP's ``save`` through ``FileSystemWriter(sync_files=True)`` with ``threads`` threads."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path, sync_files=True, thread_count=threads)
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process by design
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, **dcp_single_process(dcp.save))


# ------------------------------------------------------------------------------- every iteration


class Saver:
    """One way of checkpointing every iteration of a training loop (this one: no checkpoint).
    ``save`` returns the seconds the call took."""

    name = "no checkpoint"

    def save(self, it: int, model: nn.Module, opt: torch.optim.Optimizer, data: Tokens) -> float:
        return 0.0

    def close(self) -> None:
        pass

    def blocked(self) -> list[float] | None:
        """Per save, the time training was blocked, when the saver knows better than the time
        ``save`` took (None: it does not)."""
        return None


class TorchSaver(Saver):
    name = "torch.save + fsync"

    def __init__(self, path: str) -> None:
        self.path = path

    def save(self, it: int, model: nn.Module, opt: torch.optim.Optimizer, data: Tokens) -> float:
        t0 = time.perf_counter()
        save_torch({"model": model.state_dict(), "optim": opt.state_dict(), "data": data.state_dict(), "step": it},
                   self.path)
        return time.perf_counter() - t0


class DCPAsyncSaver(Saver):
    """DCP ``async_save`` (stages to host memory, writes in a thread); one save in flight."""

    name = "DCP async_save"

    def __init__(self, directory: str) -> None:
        self.dirs = [os.path.join(directory, "dcp-a"), os.path.join(directory, "dcp-b")]
        self.pending: Any = None

    def _wait(self) -> None:
        if self.pending is not None:
            getattr(self.pending, "upload_completion", self.pending).result()
            self.pending = None

    def save(self, it: int, model: nn.Module, opt: torch.optim.Optimizer, data: Tokens) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self._wait()  # back-pressure: at most one in flight
        path = self.dirs[it % 2]
        remove(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.pending = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict(), "step": it},
                                          storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                                          **dcp_single_process(dcp.async_save))
        staged = getattr(self.pending, "staging_completion", None)
        if staged is not None:
            staged.result()  # the state may change once staged
        return time.perf_counter() - t0

    def close(self) -> None:
        self._wait()


class FastpersistSaver(Saver):
    """A Checkpointer in ``mode`` (overlap: it guards the optimizer passed to :meth:`protect`)."""

    def __init__(self, root: str, mode: str, *, keep: int, snapshot_bytes: int | None = None,
                 config: IOConfig | None = None) -> None:
        self.name = f"fastpersist {mode}"
        self.ck = (Checkpointer(root, mode=mode, keep=keep, config=config) if snapshot_bytes is None
                   else Checkpointer(root, mode=mode, keep=keep, snapshot_bytes=snapshot_bytes, config=config))
        self.rng = RNGState()

    def protect(self, opt: torch.optim.Optimizer) -> None:
        if self.ck.mode == "overlap":
            self.ck.protect(opt)

    def save(self, it: int, model: nn.Module, opt: torch.optim.Optimizer, data: Tokens) -> float:
        t0 = time.perf_counter()
        self.ck.save(it, {"model": model, "optim": opt, "data": data, "step": it}, rank_state={"rng": self.rng})
        return time.perf_counter() - t0

    def close(self) -> None:
        self.ck.close()

    def blocked(self) -> list[float] | None:  # inside save() plus guarded optimizer steps that waited
        return [m.blocked_s for m in self.ck.history if not m.skipped]


def make_saver(kind: str, directory: str, opt: torch.optim.Optimizer, *, keep: int = 1,
               snapshot_bytes: int | None = None, config: IOConfig | None = None) -> Saver:
    """The saver ``kind`` (``none``, ``torch.save``, ``dcp``, or a fastpersist mode: ``sync``,
    ``snapshot``, ``overlap``), writing in ``directory`` (its own); an overlap saver guards ``opt``."""
    if kind == "none":
        return Saver()
    if kind == "torch.save":
        return TorchSaver(os.path.join(directory, "torch.pt"))
    if kind == "dcp":
        return DCPAsyncSaver(directory)
    saver = FastpersistSaver(directory, kind, keep=keep, snapshot_bytes=snapshot_bytes, config=config)
    saver.protect(opt)
    return saver
