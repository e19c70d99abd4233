"""What the integrations share: checkpoints saved under names a framework chooses.

Lightning names each checkpoint by a path (``epoch=0-step=5.ckpt``, a ``last.ckpt`` replaced at
every save), while a Checkpointer names checkpoints by step under fixed roots.
:class:`NamedCheckpoints` bridges the two with the Checkpointer's public directory saves
(``save(seq, state, directory=path)``, :mod:`fastpersist.storage.publish`): one long-lived
Checkpointer (so its snapshot arena, worker and process groups are reused) writes every
checkpoint under a sequence number in a staging root next to the checkpoints, and moves it
under ``path`` once committed, before its handle completes. No thread of the integration's own.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastpersist.checkpointer import Checkpointer, list_checkpoints
from fastpersist.errors import CheckpointError
from fastpersist.saving.handle import SaveHandle
from fastpersist.storage.backend import REAL_FILES, FileBackend
from fastpersist.storage.publish import sweep

logger = logging.getLogger(__name__)

STAGING = ".fastpersist-staging"

__all__ = ["NamedCheckpoints", "STAGING"]


class NamedCheckpoints:
    """Checkpoints saved under paths of the caller's choosing, by one Checkpointer per folder.

    Args:
        mode: the Checkpointers' mode (``"sync"``, ``"snapshot"`` or ``"overlap"``).
        **kwargs: further Checkpointer arguments (``config``, ``backend``, ``snapshot_bytes``).

    Raises:
        CheckpointError: ``when_busy="skip"`` (a skipped save would leave the framework
            recording a checkpoint that does not exist).
    """

    def __init__(self, mode: str, **kwargs: Any) -> None:
        if kwargs.get("when_busy", "wait") != "wait":
            raise CheckpointError(f"when_busy={kwargs['when_busy']!r}: a framework records every checkpoint it asks "
                                  "for, so saves under its names always wait (when_busy='wait')")
        self.mode = mode
        # A run that died between a commit and its move left a committed step in the staging
        # root; the next run restarts the sequence numbers, which abandons it: deleted.
        self.kwargs = {"abandoned": "delete", **kwargs}
        self.collective = False  # every rank saves (else this process alone: comm="local")
        self._checkpointers: dict[str, Checkpointer] = {}  # staging root -> its Checkpointer
        self._next: dict[str, int] = {}

    @property
    def backend(self) -> FileBackend:
        """The file seam of the checkpoints' folders: the Checkpointers' (``backend=``), else real files."""
        backend = self.kwargs.get("backend")
        return backend if isinstance(backend, FileBackend) else REAL_FILES

    def save(self, state: Any, path: str, rank_state: Any = None) -> SaveHandle:
        """Start saving ``state`` as ``path`` (a directory); the handle completes once ``path``
        holds it (in the background, unless the mode is sync). Checkpoints in several folders
        (two ``ModelCheckpoint`` callbacks) each have their own staging root and Checkpointer."""
        staging = os.path.join(os.path.dirname(os.path.abspath(path)), STAGING)
        ck = self._for(staging)
        seq = self._next[staging]
        self._next[staging] = seq + 1
        return ck.save(seq, state, rank_state=rank_state, directory=path)

    def close(self) -> None:
        """Wait for the checkpoints in flight and release the staging roots (the first error is
        raised after every Checkpointer is closed)."""
        first: BaseException | None = None
        while self._checkpointers:
            staging, ck = self._checkpointers.popitem()
            try:
                ck.close()
            except BaseException as e:  # noqa: BLE001 - close the others, then raise
                first = first or e
            if ck.rank == 0 and not list_checkpoints(staging):
                _remove_staging(self.backend, staging)  # every checkpoint was published
        if first is not None:
            raise first

    def _for(self, staging: str) -> Checkpointer:
        """The Checkpointer for ``staging`` (created, after cleaning what crashed publishes left
        in the folder, at the folder's first save)."""
        ck = self._checkpointers.get(staging)
        if ck is not None:
            return ck
        comm = None if self.collective else "local"
        ck = Checkpointer(staging, mode=self.mode, comm=comm, **self.kwargs)
        if ck.rank == 0:
            sweep(os.path.dirname(staging), self.backend)
        self._checkpointers[staging] = ck
        self._next[staging] = 0
        return ck


def _remove_staging(backend: FileBackend, staging: str) -> None:
    """Remove an emptied staging root (best effort: a later run reuses or removes it)."""
    def ignore(path: str, e: OSError) -> None:
        logger.debug("could not remove %s: %s", path, e.strerror or e)

    try:
        backend.rmtree(staging, ignore)
    except OSError as e:
        ignore(staging, e)
