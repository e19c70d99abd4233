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
    _one_rank_group()
    return {}


def _one_rank_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="fastpersist-dcp-"), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


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

    def __init__(self, directory: str, process: bool = False) -> None:
        self.dirs = [os.path.join(directory, "dcp-a"), os.path.join(directory, "dcp-b")]
        self.pending: Any = None
        self.process = process  # AsyncCheckpointerType.PROCESS: a persistent checkpoint process
        if process:
            self.name = "DCP async_save (process)"

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
            extra = dcp_single_process(dcp.async_save)
            if self.process:  # its executor forms a process group with its checkpoint process: one is needed
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                extra = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS}
                _one_rank_group()
            self.pending = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict(), "step": it},
                                          storage_writer=dcp.FileSystemWriter(path, sync_files=True), **extra)
        staged = getattr(self.pending, "staging_completion", None)
        if staged is not None:
            staged.result()  # the state may change once staged
        return time.perf_counter() - t0

    def close(self) -> None:
        self._wait()


class FastpersistSaver(Saver):
    """A Checkpointer in ``mode`` (overlap: it guards the optimizer passed to :meth:`protect`)."""

    def __init__(self, root: str, mode: str, *, keep: int, snapshot_bytes: int | None = None,
                 config: IOConfig | None = None, engine: str = "thread") -> None:
        self.name = f"fastpersist {mode}" + (f" ({engine} engine)" if engine != "thread" else "")
        self.ck = Checkpointer(root, mode=mode, keep=keep, config=config, engine=engine, snapshot_bytes=snapshot_bytes)
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


_WRITER = """
import mmap, os, sys
path, size = sys.argv[1], int(sys.argv[2])
buf = mmap.mmap(-1, size)
buf.write(b"\\x01" * size)
while sys.stdin.buffer.read(1):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    view, pos = memoryview(buf), 0
    while pos < size:
        pos += os.pwrite(fd, view[pos : pos + (64 << 20)], pos)
    os.fsync(fd)
    os.close(fd)
    sys.stdout.buffer.write(b"."); sys.stdout.buffer.flush()
"""


class IOOnlySaver(Saver):
    """What writing the checkpoint's bytes costs training by itself: another process (no torch)
    writes as many bytes as the model and AdamW state hold with O_DIRECT and fsyncs, once per
    save, one in flight: the floor any saver that writes them pays on this machine."""

    name = "the bytes alone (O_DIRECT + fsync, another process)"

    def __init__(self, directory: str, nbytes: int) -> None:
        import subprocess
        import sys

        size = -(-nbytes // 4096) * 4096
        self.proc = subprocess.Popen([sys.executable, "-c", _WRITER, os.path.join(directory, "bytes.bin"), str(size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending = False

    def _wait(self) -> None:
        if self.pending:
            self.proc.stdout.read(1)  # type: ignore[union-attr]
            self.pending = False

    def save(self, it: int, model: nn.Module, opt: torch.optim.Optimizer, data: Tokens) -> float:
        t0 = time.perf_counter()
        self._wait()
        self.proc.stdin.write(b".")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        self.pending = True
        return time.perf_counter() - t0

    def close(self) -> None:
        self._wait()
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait()


def make_saver(kind: str, directory: str, opt: torch.optim.Optimizer, *, keep: int = 1,
               snapshot_bytes: int | None = None, config: IOConfig | None = None) -> Saver:
    """The saver ``kind`` (``none``, ``bytes`` (:class:`IOOnlySaver`), ``torch.save``, ``dcp`` (DCP async_save, thread executor),
    ``dcp-process`` (its process executor), or a fastpersist mode: ``sync``, ``snapshot``,
    ``overlap``, with ``+process`` for the process engine), writing in ``directory`` (its own);
    an overlap saver guards ``opt``."""
    if kind == "none":
        return Saver()
    if kind == "torch.save":
        return TorchSaver(os.path.join(directory, "torch.pt"))
    if kind == "bytes":  # fp32 parameters and AdamW's two fp32 moments (params_and_state_bytes)
        return IOOnlySaver(directory, sum(p.numel() for g in opt.param_groups for p in g["params"]) * 4 * 3)
    if kind in ("dcp", "dcp-process"):
        return DCPAsyncSaver(directory, process=kind == "dcp-process")
    mode, _, engine = kind.partition("+")
    saver = FastpersistSaver(directory, mode, keep=keep, snapshot_bytes=snapshot_bytes, config=config,
                             engine=engine or "thread")
    saver.protect(opt)
    return saver
