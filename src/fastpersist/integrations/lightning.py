"""Lightning checkpoints written by fastpersist: a ``CheckpointIO`` plugin.

::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from fastpersist.integrations.lightning import AsyncFastPersistCheckpointIO

    trainer = Trainer(plugins=[AsyncFastPersistCheckpointIO()],
                      callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=2, monitor="step",
                                                 mode="max", save_last=True)])
    trainer.fit(model, ckpt_path="path/to/last.ckpt")   # resume as usual

Lightning builds the checkpoint dict and calls ``CheckpointIO.save_checkpoint(checkpoint, path)``
on global rank 0 (``ModelCheckpoint`` decides when, and removes old ones through
``remove_checkpoint``); fastpersist only changes how the bytes reach the disk:

- ``FastPersistCheckpointIO(format="file")``: ``path`` is one torch.load-compatible file
  written with O_DIRECT (:func:`fastpersist.save`); ``torch.load(path)`` reads it.
- ``FastPersistCheckpointIO(format="sharded")``: ``path`` is a directory holding one
  fastpersist checkpoint (parallel files, checksums; ``fastpersist convert`` makes it one file).
- ``AsyncFastPersistCheckpointIO``: the sharded format in the Checkpointer's ``snapshot`` mode:
  ``save_checkpoint`` returns once the state is copied into the snapshot arena, and the write
  overlaps the next steps. The directory appears under ``path`` only once committed.

Lightning does not save RNG states in its checkpoint dict; a module that draws random numbers
during training and must resume bit for bit adds them in ``on_save_checkpoint``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from fastpersist.config import IOConfig
from fastpersist.errors import CheckpointError
from fastpersist.integrations import _local
from fastpersist.single_file import load as load_file
from fastpersist.single_file import save as save_file

logger = logging.getLogger(__name__)

FORMATS = ("file", "sharded")

__all__ = ["AsyncFastPersistCheckpointIO", "FastPersistCheckpointIO"]


class FastPersistCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes checkpoints with fastpersist, synchronously.

    Args:
        format: ``"file"`` (one torch.load-compatible file per checkpoint, the default) or
            ``"sharded"`` (one fastpersist checkpoint directory per checkpoint).
        config: I/O settings (:class:`fastpersist.IOConfig`); the environment's by default.
        **checkpointer_kwargs: further :class:`fastpersist.Checkpointer` arguments for the
            sharded format (``backend``, ``snapshot_bytes``, ...).

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

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write Lightning's ``checkpoint`` dict to ``path``.

        Args:
            checkpoint: the dict Lightning built (model, optimizers, loops, callbacks, ...).
            path: the file (or, for the sharded format, directory) to create.
            storage_options: not supported (must be None).
        """
        if storage_options is not None:
            raise CheckpointError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if self.format == "file":
            save_file(checkpoint, path, config=self.config)
            return
        self._named.publish(self._named.start(checkpoint, path))

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint written by either format (or by ``torch.save``: a torch file).

        Args:
            path: the checkpoint file or directory.
            map_location: as in ``torch.load``.
            weights_only: as in ``torch.load`` (None: True, torch's default).
        """
        path = os.fspath(path)
        only = True if weights_only is None else weights_only
        if os.path.isdir(path):
            return _local.load_dir(path, map_location, only)
        return load_file(path, map_location, weights_only=only, config=self.config)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (file or directory)."""
        _local.remove_path(os.fspath(path))

    def teardown(self) -> None:
        """Release the staging root (Lightning calls it at the end of ``fit``)."""
        self._named.close()


@dataclass
class _Pending:
    staged: _local.Staged
    published: threading.Event = field(default_factory=threading.Event)

    @property
    def path(self) -> str:
        return self.staged.path


class AsyncFastPersistCheckpointIO(FastPersistCheckpointIO):
    """A Lightning ``CheckpointIO`` whose saves return at once and overlap the next steps.

    ``save_checkpoint`` copies the state into the Checkpointer's bounded snapshot arena and
    returns; a background thread waits for the commit and publishes the directory. A failure is
    raised by the next ``save_checkpoint`` or by ``teardown``. ``remove_checkpoint`` and
    ``load_checkpoint`` of a path being written wait for it first.

    Args:
        max_in_flight: checkpoints being written at once; a further save waits for the oldest.
        config: I/O settings (:class:`fastpersist.IOConfig`).
        **checkpointer_kwargs: further :class:`fastpersist.Checkpointer` arguments
            (``snapshot_bytes``, ``backend``, ...).
    """

    mode = "snapshot"

    def __init__(self, *, max_in_flight: int = 1, config: IOConfig | None = None, **checkpointer_kwargs: Any) -> None:
        super().__init__("sharded", config=config, **checkpointer_kwargs)
        if max_in_flight < 1:
            raise CheckpointError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Start writing ``checkpoint`` to the directory ``path`` and return (see the class)."""
        if storage_options is not None:
            raise CheckpointError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = os.fspath(path)
        self._raise_error()
        self._wait_for(lambda p: p.path == path)  # the same name: the earlier save publishes first
        while True:
            with self._lock:
                oldest = self._pending[0] if len(self._pending) >= self.max_in_flight else None
            if oldest is None:
                break
            oldest.published.wait()
        self._raise_error()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        item = _Pending(self._named.start(checkpoint, path))
        with self._lock:
            self._pending.append(item)
        self._ensure_thread()
        self._queue.put(item)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        self._wait_for(lambda p: p.path == os.fspath(path))
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self._wait_for(lambda p: p.path == os.fspath(path))
        super().remove_checkpoint(path)

    def wait(self) -> None:
        """Wait until every checkpoint in flight is published; raise the first failure."""
        self._wait_for(lambda p: True)
        self._raise_error()

    def teardown(self) -> None:
        """Finish the checkpoints in flight and stop the background thread (Lightning calls it
        at the end of ``fit``)."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None
            self._named.close()

    def _wait_for(self, match: Any) -> None:
        with self._lock:
            waiting = [p for p in self._pending if match(p)]
        for p in waiting:
            p.published.wait()

    def _raise_error(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._publish_loop, name="fastpersist-lightning", daemon=True)
            self._thread.start()

    def _publish_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._named.publish(item.staged)
            except BaseException as e:  # noqa: BLE001 - raised by the next save or teardown
                logger.error("Lightning checkpoint %s failed: %s", item.path, e)
                with self._lock:
                    self._errors.append(e)
            with self._lock:
                self._pending.remove(item)
            item.published.set()
