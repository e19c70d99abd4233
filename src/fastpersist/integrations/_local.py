"""What the integrations share: a process-local Checkpointer per directory, and its publication.

Lightning hands a checkpoint to its ``CheckpointIO`` on global rank 0 only, under a path it
chose (``epoch=0-step=5.ckpt``). Such a checkpoint is written as one fastpersist checkpoint in
a directory of that name: a Checkpointer rooted at ``<path>.fp-partial`` writes it, and the
directory is renamed to ``<path>`` once committed, so the framework never sees a partial one.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from fastpersist.checkpointer import Checkpointer, list_checkpoints, load_checkpoint
from fastpersist.dist import LocalComm
from fastpersist.errors import CheckpointNotFoundError

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".fp-partial"
_OLD_SUFFIX = ".fp-old"


def partial_path(path: str) -> str:
    """Where the checkpoint for ``path`` is written before it is published."""
    return path + PARTIAL_SUFFIX


def local_checkpointer(root: str, mode: str, **kwargs: Any) -> Checkpointer:
    """A Checkpointer of this process alone, rooted at a fresh ``root``.

    Args:
        root: the directory (removed first if a crashed save left it).
        mode: ``"sync"``, ``"snapshot"`` or ``"overlap"``.
        **kwargs: further Checkpointer arguments (``config``, ``backend``, ``snapshot_bytes``).
    """
    if os.path.lexists(root):
        shutil.rmtree(root)
    return Checkpointer(root, mode=mode, comm=LocalComm(), **kwargs)


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
