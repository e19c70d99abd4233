"""Lightning checkpoints written by fastpersist: ``CheckpointIO`` plugins and a DDP strategy.

::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from fastpersist.integrations.lightning import AsyncFastPersistCheckpointIO, FastPersistDDPStrategy

    trainer = Trainer(strategy=FastPersistDDPStrategy(),           # ddp: every rank writes its share
                      callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=2, monitor="step",
                                                 mode="max", save_last=True)])
    trainer.fit(model, ckpt_path="path/to/last.ckpt")   # resume as usual

Lightning builds the checkpoint dict and hands it to its strategy, which hands it to its
``CheckpointIO`` (``ModelCheckpoint`` decides when, and removes old ones through
``remove_checkpoint``); fastpersist changes how the bytes reach the disk:

- ``FastPersistCheckpointIO(format="file")``: ``path`` is one torch.load-compatible file
  written with O_DIRECT (:func:`fastpersist.save`); ``torch.load(path)`` reads it.
- ``FastPersistCheckpointIO(format="sharded")``: ``path`` is a directory holding one
  fastpersist checkpoint (parallel files, checksums; ``fastpersist convert`` makes it one file),
  saved with the Checkpointer's directory saves (:mod:`fastpersist.storage.publish`).
- ``AsyncFastPersistCheckpointIO``: the sharded format in the Checkpointer's ``snapshot`` mode:
  ``save_checkpoint`` returns once the state is copied into the snapshot arena, and the write
  overlaps the next steps. The directory appears under ``path`` only once committed.
- ``FastPersistDDPStrategy``: Lightning's ``DDPStrategy`` hands the checkpoint to its
  ``CheckpointIO`` on global rank 0 only; this subclass hands it over on every rank, so every
  rank writes its share of the model and optimizer state (technique 2), in one commit.

What is written: the model's and optimizers' state (``state_dict``, ``optimizer_states``) as
the replicated state, written once, split over the writing ranks (checked to be the same on
each); everything else in Lightning's dict (loops, callbacks, hyper-parameters) as rank 0's own
state, since Lightning's checkpoint is rank 0's dict. ``load_checkpoint`` merges the two.

Lightning does not save RNG states in its checkpoint dict; a module that draws random numbers
during training and must resume bit for bit adds them in ``on_save_checkpoint``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from fastpersist.storage import catalog
from fastpersist.config import IOConfig
from fastpersist.errors import CheckpointError
from fastpersist.format import manifest as mf
from fastpersist.saving.handle import SaveHandle
from fastpersist.integrations import _local
from fastpersist.storage.publish import directory_checkpoint, remove_published
from fastpersist.single_file import load as load_file
from fastpersist.single_file import save as save_file
from fastpersist.loading.view import load_checkpoint
from fastpersist.tiers.resolve import open as open_view

logger = logging.getLogger(__name__)

FORMATS = ("file", "sharded")
BULK = ("state_dict", "optimizer_states")  # the replicated (or sharded) state; the rest is rank 0's
BUFFERS = "fastpersist_module_buffers"  # the module's buffers, rank 0's (see buffers_apart)


def _bulk(key: str) -> bool:
    """Whether a key of Lightning's checkpoint dict is model or optimizer state (``optimizer_<i>``:
    one optimizer's sharded state, as :class:`FastPersistModelParallelStrategy` names it)."""
    return key in BULK or (key.startswith("optimizer_") and key[len("optimizer_"):].isdigit())

__all__ = ["AsyncFastPersistCheckpointIO", "FastPersistCheckpointIO", "FastPersistDDPStrategy",
           "FastPersistModelParallelStrategy"]


class FastPersistCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes checkpoints with fastpersist, synchronously.

    Args:
        format: ``"file"`` (one torch.load-compatible file per checkpoint, the default) or
            ``"sharded"`` (one fastpersist checkpoint directory per checkpoint).
        config: I/O settings (:class:`fastpersist.IOConfig`); the environment's by default.
        **checkpointer_kwargs: further :class:`fastpersist.Checkpointer` arguments for the
            sharded format (``backend``, ``snapshot_bytes``, ``max_in_flight``, ...).

    Raises:
        CheckpointError: an unknown ``format``.
    """

    mode = "sync"

    def __init__(self, format: str = "file", *, config: IOConfig | None = None, **checkpointer_kwargs: Any) -> None:
        if format not in FORMATS:
            raise CheckpointError(f"format must be one of {FORMATS}, got {format!r}")
        if format == "file" and checkpointer_kwargs:
            raise CheckpointError(f"format='file' takes no Checkpointer arguments, got {sorted(checkpointer_kwargs)}")
        self.format = format
        self.config = config
        self._named = _local.NamedCheckpoints(self.mode, config=config, **checkpointer_kwargs)
        self._pending: dict[str, SaveHandle] = {}  # path -> its save, not yet known to be published

    @property
    def collective(self) -> bool:
        """Whether every rank calls :meth:`save_checkpoint` (set by :class:`FastPersistDDPStrategy`),
        so every rank writes its share; otherwise global rank 0 writes alone."""
        return self._named.collective

    @collective.setter
    def collective(self, value: bool) -> None:
        if self._named.collective != value and self._pending:
            raise CheckpointError("the CheckpointIO's ranks cannot change while checkpoints are in flight")
        if self._named.collective != value:
            self._named.close()
            self._named.collective = value

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write Lightning's ``checkpoint`` dict to ``path``.

        Args:
            checkpoint: the dict Lightning built (model, optimizers, loops, callbacks, ...).
            path: the file (or, for the sharded format, directory) to create.
            storage_options: not supported (must be None).
        """
        if storage_options is not None:
            raise CheckpointError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = os.path.abspath(os.fspath(path))
        rank0 = not self.collective or dist.get_rank() == 0
        if rank0:
            self._named.backend.makedirs(os.path.dirname(path))
        if self.format == "file":
            if rank0:
                save_file(checkpoint, path, config=self.config)
            return
        self._wait_for(path)  # the same name again: the earlier save is published first
        self._pending = {p: h for p, h in self._pending.items() if not h.done()}
        bulk = {k: v for k, v in checkpoint.items() if _bulk(k)}
        rest = {k: v for k, v in checkpoint.items() if not _bulk(k)}
        self._pending[path] = self._named.save(bulk, path, rest if rank0 else None)
        if self.mode == "sync":
            self._wait_for(path)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint written by either format (or by ``torch.save``: a torch file).

        Args:
            path: the checkpoint file or directory.
            map_location: as in ``torch.load``.
            weights_only: as in ``torch.load`` (None: True, torch's default).
        """
        path = os.path.abspath(os.fspath(path))
        self._wait_for(path)
        only = True if weights_only is None else weights_only
        files = self._named.backend
        if files.is_dir(path) or files.is_dir(path + ".fp-old"):
            return load_directory(path, map_location, only)
        return load_file(path, map_location, weights_only=only, config=self.config)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (file or directory), once written if in flight."""
        path = os.path.abspath(os.fspath(path))
        self._wait_for(path)
        remove_published(path, self._named.backend)

    def wait(self) -> None:
        """Wait until every checkpoint in flight is published; raise the first failure."""
        for path in list(self._pending):
            self._wait_for(path)

    def teardown(self) -> None:
        """Finish the checkpoints in flight and release the staging root (Lightning calls it at
        the end of ``fit``)."""
        try:
            self.wait()
        finally:
            self._pending.clear()
            self._named.close()

    def _wait_for(self, path: str) -> None:
        handle = self._pending.pop(path, None)
        if handle is not None:
            handle.wait()


class AsyncFastPersistCheckpointIO(FastPersistCheckpointIO):
    """A Lightning ``CheckpointIO`` whose saves return at once and overlap the next steps.

    ``save_checkpoint`` copies the state into the Checkpointer's bounded snapshot arena and
    returns; the Checkpointer's worker writes, commits and moves it under ``path``
    (:mod:`fastpersist.storage.publish`). A failure is raised by the next ``save_checkpoint``, by
    ``wait`` or by ``teardown``. ``remove_checkpoint`` and ``load_checkpoint`` of a path being
    written wait for it first.

    Args:
        max_in_flight: checkpoints being written at once; a further save waits for the oldest.
        config: I/O settings (:class:`fastpersist.IOConfig`).
        **checkpointer_kwargs: further :class:`fastpersist.Checkpointer` arguments
            (``snapshot_bytes``, ``backend``, ...).
    """

    mode = "snapshot"

    def __init__(self, *, max_in_flight: int = 1, config: IOConfig | None = None, **checkpointer_kwargs: Any) -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise CheckpointError(f"max_in_flight must be at least 1, got {max_in_flight!r}")
        super().__init__("sharded", config=config, max_in_flight=max_in_flight, **checkpointer_kwargs)
        self.max_in_flight = max_in_flight


class FastPersistDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy``, with every rank writing its share of each checkpoint.

    ``DDPStrategy.save_checkpoint`` calls the ``CheckpointIO`` on global rank 0 only; this
    subclass calls a fastpersist sharded ``CheckpointIO`` on every rank (a Checkpointer over
    all ranks, one commit), and behaves as ``DDPStrategy`` for any other ``CheckpointIO``.
    Removal, loading and everything else are ``DDPStrategy``'s.

    Args:
        *args, **kwargs: ``DDPStrategy``'s; ``checkpoint_io`` defaults to
            :class:`AsyncFastPersistCheckpointIO` (a ``plugins=[...]`` CheckpointIO replaces it).
    """

    def __init__(self, *args: Any, checkpoint_io: CheckpointIO | None = None, **kwargs: Any) -> None:
        super().__init__(*args, checkpoint_io=checkpoint_io or AsyncFastPersistCheckpointIO(), **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        io = self.checkpoint_io
        if not isinstance(io, FastPersistCheckpointIO) or io.format != "sharded":
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        io.collective = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        io.save_checkpoint(buffers_apart(checkpoint, self.lightning_module), filepath, storage_options)


class FastPersistModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel over DTensors), with its
    distributed checkpoints written and read by fastpersist instead of torch.distributed.checkpoint.

    ``ModelParallelStrategy`` saves a sharded checkpoint through DCP on every rank; this subclass
    saves the same state (the model's and optimizers' sharded state dicts, DTensors) through a
    fastpersist sharded ``CheckpointIO`` on every rank: each rank writes the chunks it owns, and
    the rest of Lightning's dict is rank 0's own state. Loading fills the model's and optimizers'
    DTensors in place at any number of processes (resharding), as DCP does. A checkpoint that is
    not a fastpersist directory (one written by ``ModelParallelStrategy``) is read by
    ``ModelParallelStrategy``; ``save_distributed_checkpoint=False`` is ``ModelParallelStrategy``'s.

    Args:
        *args, **kwargs: ``ModelParallelStrategy``'s.
        checkpoint_io: the fastpersist ``CheckpointIO`` (default :class:`AsyncFastPersistCheckpointIO`).
    """

    def __init__(self, *args: Any, checkpoint_io: FastPersistCheckpointIO | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fastpersist_io = checkpoint_io or AsyncFastPersistCheckpointIO()
        if self.fastpersist_io.format != "sharded":
            raise CheckpointError("FastPersistModelParallelStrategy needs the sharded format (a sharded checkpoint "
                                  f"is a directory), got format={self.fastpersist_io.format!r}")

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = self.broadcast(os.path.abspath(os.fspath(filepath)))  # rank 0's name for everyone
        self.fastpersist_io.collective = self.world_size > 1
        # one entry per optimizer (as ModelParallelStrategy's DCP checkpoints): loads fill them in place
        optimizers = checkpoint.pop("optimizer_states", [])
        checkpoint.update({f"optimizer_{i}": state for i, state in enumerate(optimizers)})
        self.fastpersist_io.save_checkpoint(buffers_apart(checkpoint, self.lightning_module), path, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.fastpersist_io.remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from fastpersist.integrations import _fsdp2 as fsdp2

        path = self.broadcast(os.path.abspath(os.fspath(checkpoint_path)))
        self.fastpersist_io.wait()
        try:
            step_dir = directory_checkpoint(path)
        except CheckpointError:
            return super().load_checkpoint(checkpoint_path, weights_only)
        if self.model is None or self.lightning_module is None:
            raise CheckpointError(f"loading {path}: the model is not set up by the strategy yet")
        only = True if weights_only is None else weights_only
        # templates: this process's DTensors at the current mesh, filled in place
        into = {"state_dict": fsdp2.model_state(self.model, cpu_offload=True),
                **{f"optimizer_{i}": fsdp2.optimizer_template(self.model, o) for i, o in enumerate(self.optimizers)}}
        view = open_view(os.path.dirname(step_dir))  # the published root (or its .fp-old, after a crash)
        step = catalog.parse_step_dir(os.path.basename(step_dir))
        if step is None:  # pragma: no cover - directory_checkpoint names a step directory
            raise CheckpointError(f"{step_dir} is not a checkpoint's step directory")
        loaded = view.load(step, into=into, weights_only=only)
        strict = self.lightning_module.strict_loading
        own = dict(view.load_rank_state(step, rank=0, weights_only=only))
        loaded["state_dict"].update(own.pop(BUFFERS, {}))
        set_model_state_dict(self.model, loaded["state_dict"], options=StateDictOptions(strict=strict))
        for i, optimizer in enumerate(self.optimizers):
            fsdp2.set_optimizer_state(self.model, optimizer, loaded[f"optimizer_{i}"])
        return own

    def teardown(self) -> None:
        try:
            self.fastpersist_io.teardown()
        finally:
            super().teardown()


def load_directory(path: str, map_location: Any = None, weights_only: bool = True) -> dict[str, Any]:
    """The Lightning checkpoint dict saved as directory ``path``: the replicated state merged
    with rank 0's own (see the module), or a whole dict saved as replicated state.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
    """
    step_dir = directory_checkpoint(path)
    state = load_checkpoint(step_dir, map_location=map_location, weights_only=weights_only)
    if mf.rank_object(0) in catalog.read_manifest(step_dir).objects:
        rest = load_checkpoint(step_dir, rank=0, map_location=map_location, weights_only=weights_only)
        buffers = rest.pop(BUFFERS, None)
        state = {**rest, **state}
        if buffers is not None:
            state["state_dict"] = {**state["state_dict"], **buffers}
    return state


def buffers_apart(checkpoint: dict[str, Any], module: Any) -> dict[str, Any]:
    """``checkpoint`` with the module's buffers taken out of ``state_dict`` into their own
    entry (rank 0's state): under DDP each rank updates them from its own batch (BatchNorm's
    running statistics; DDP broadcasts rank 0's at the next forward), so they are not
    replicated, and Lightning's checkpoint holds rank 0's."""
    names = {name for name, _ in module.named_buffers()} if module is not None else set()
    state = checkpoint.get("state_dict")
    if not names or not isinstance(state, dict):
        return checkpoint
    checkpoint[BUFFERS] = {k: state.pop(k) for k in list(state) if k in names}
    return checkpoint
