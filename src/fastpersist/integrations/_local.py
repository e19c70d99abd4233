"""What the integrations share: a process-local Checkpointer for named checkpoints.

Lightning hands a checkpoint to its ``CheckpointIO`` on global rank 0 only, under a path it
chose (``epoch=0-step=5.ckpt``), while a Checkpointer names checkpoints by step under fixed
roots. :class:`NamedCheckpoints` bridges the two: one long-lived Checkpointer of this process
(so its snapshot arena and worker are reused) writes every checkpoint as a sequence number under
a staging root next to the checkpoints; once committed, the checkpoint's directory (a single
root's checkpoint is self-contained) is moved into ``<path>.fp-partial`` and that is renamed to
``<path>``, so the framework never sees a partial checkpoint under its name.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

from fastpersist.checkpointer import Checkpointer, list_checkpoints, load_checkpoint
from fastpersist.dist import LocalComm
from fastpersist.errors import CheckpointError, CheckpointNotFoundError
from fastpersist.handle import SaveHandle

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".fp-partial"
_OLD_SUFFIX = ".fp-old"
STAGING = ".fastpersist-staging"


def partial_path(path: str) -> str:
    """Where the checkpoint for ``path`` is assembled before it is published."""
    return path + PARTIAL_SUFFIX


@dataclass(frozen=True)
class Staged:
    """A checkpoint being saved under a staging root, to be published under ``path``."""

    handle: SaveHandle
    seq: int
    staging: str
    path: str


class NamedCheckpoints:
    """Checkpoints saved under names of the caller's choosing, by one Checkpointer.

    Args:
        mode: the Checkpointer's mode (``"sync"``, ``"snapshot"`` or ``"overlap"``).
        **kwargs: further Checkpointer arguments (``config``, ``backend``, ``snapshot_bytes``).
    """

    def __init__(self, mode: str, **kwargs: Any) -> None:
        self.mode = mode
        self.kwargs = kwargs
        self._checkpointer: Checkpointer | None = None
        self._staging: str | None = None
        self._next = 0

    def start(self, state: Any, path: str) -> Staged:
        """Start saving ``state`` for ``path`` (in the background, unless the mode is sync)."""
        staging = os.path.join(os.path.dirname(os.path.abspath(path)), STAGING)
        ck = self._for(staging)
        seq, self._next = self._next, self._next + 1
        return Staged(ck.save(seq, state), seq, staging, path)

    @staticmethod
    def publish(staged: Staged) -> None:
        """Wait for the commit of ``staged``, then move it under its path (replacing an old one).

        Raises:
            CheckpointError: the save failed (its error), or its directory is gone.
        """
        staged.handle.wait()
        path = staged.path
        found = [c for c in list_checkpoints(staged.staging) if c.step == staged.seq and c.committed]
        if not found:
            raise CheckpointError(f"fastpersist: the checkpoint for {path} is missing from {staged.staging}")
        info = found[0]
        partial = partial_path(path)
        remove_path(partial)
        os.mkdir(partial)
        os.rename(info.path, os.path.join(partial, os.path.basename(info.path)))
        publish(partial, path)

    def close(self) -> None:
        """Wait for the checkpoints in flight and release the staging root."""
        if self._checkpointer is not None:
            ck, self._checkpointer = self._checkpointer, None
            ck.close()
            if self._staging is not None and not list_checkpoints(self._staging):  # all published
                shutil.rmtree(self._staging, ignore_errors=True)

    def _for(self, staging: str) -> Checkpointer:
        """The Checkpointer for ``staging`` (a new one if the checkpoints' directory changed)."""
        if self._checkpointer is not None and self._staging == staging:
            return self._checkpointer
        self.close()
        if os.path.lexists(staging):  # what a dead run staged and never published
            shutil.rmtree(staging)
        self._checkpointer = Checkpointer(staging, mode=self.mode, comm=LocalComm(), **self.kwargs)
        self._staging = staging
        self._next = 0
        return self._checkpointer


def publish(partial: str, path: str) -> None:
    """Rename the committed checkpoint directory ``partial`` to ``path``, replacing an old one.

    Args:
        partial: the directory the Checkpointer wrote (committed).
        path: the name the framework asked for.
    """
    old = None
    if os.path.lexists(path):
        old = path + _OLD_SUFFIX
        if os.path.lexists(old):
            remove_path(old)
        os.rename(path, old)
    os.rename(partial, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        remove_path(old)


def remove_path(path: str) -> None:
    """Remove a checkpoint file, directory or link; nothing if it does not exist."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def load_dir(path: str, map_location: Any, weights_only: bool) -> Any:
    """Load the (only) committed checkpoint in directory ``path``.

    Args:
        path: a directory written by :func:`publish` (or a Checkpointer root).
        map_location: as in ``torch.load``.
        weights_only: use torch's restricted unpickler.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
    """
    committed = [c for c in list_checkpoints(os.path.abspath(path)) if c.committed]
    if not committed:
        raise CheckpointNotFoundError(f"{path} holds no committed fastpersist checkpoint")
    return load_checkpoint(committed[-1].path, map_location=map_location, weights_only=weights_only)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
