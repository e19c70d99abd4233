"""torchtitan checkpoints written and read by fastpersist: a ``CheckpointManager`` subclass.

::

    from fastpersist.integrations.torchtitan import FastPersistCheckpointManager

    # in a torchtitan job config (Trainer.Config.checkpoint is a BaseCheckpointManager.Config):
    checkpoint = FastPersistCheckpointManager.Config(enable=True, folder="checkpoint", interval=10,
                                                     keep_latest_k=3, async_mode="async")

torchtitan's ``CheckpointManager`` decides when to save (``interval``, the last step), what
(the flattened model and optimizer state, LR schedulers, data loader, train state: DTensors
under FSDP2 / tensor parallel), where (``<folder>/step-<N>``), what to keep (``keep_latest_k``)
and what to resume from (the highest ``step-N`` holding a ``.metadata`` file). It hands the
state to torch.distributed.checkpoint in two methods, ``dcp_save`` and ``dcp_load``, with no
setting for the storage layer; this subclass overrides those two alone and passes DCP
fastpersist's storage layer (:class:`fastpersist.dcp.Writer` / :class:`~fastpersist.dcp.Reader`:
O_DIRECT pipelined writes, checksums, the metadata committed last), keeping DCP's planners
(each rank writes what it owns, resharding at load) and torchtitan's async modes (``async``:
DCP's ``async_save`` on torchtitan's gloo group; ``async_with_pinned_mem``: its pinned-memory
stager, which needs an accelerator). Hugging Face format saves and loads (``last_save_in_hf``,
``initial_load_in_hf``) are torchtitan's own, unchanged, and so is loading a checkpoint DCP's
own writer wrote (a seed checkpoint, an ``initial_load_path`` from elsewhere).

Checked against torchtitan 0.3.0 (``torchtitan.components.checkpointer.dcp``). A checkpoint
written here is read by this subclass (or ``fastpersist.dcp.Reader``), not by DCP's
``FileSystemReader``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

from fastpersist.dcp import Reader, Writer, written_by_fastpersist
from fastpersist.storage.backend import FileBackend

logger = logging.getLogger(__name__)

__all__ = ["FastPersistCheckpointManager"]


class FastPersistCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with fastpersist as DCP's storage layer.

    ``backend`` (attribute, default real files) is fastpersist's file seam, for fault
    injection (:mod:`fastpersist.storage.faults`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """``CheckpointManager.Config``; ``build()`` makes a :class:`FastPersistCheckpointManager`."""

    backend: FileBackend | None = None

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = Writer(checkpoint_id, backend=self.backend)
        ret: Future[Any] | Any | None = None
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=self.pg,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        else:
            dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf or not written_by_fastpersist(checkpoint_id):  # HF format, or DCP's own (a seed checkpoint)
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, storage_reader=Reader(checkpoint_id, backend=self.backend), checkpoint_id=checkpoint_id)
        # torchtitan flattens the model's state into the dict; the model is loaded from it
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
