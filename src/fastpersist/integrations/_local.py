"""What the integrations share: checkpoints saved under names a framework chooses.

Lightning names each checkpoint by a path (``epoch=0-step=5.ckpt``, a ``last.ckpt`` replaced at
every save), while a Checkpointer names checkpoints by step under fixed roots.
:class:`NamedCheckpoints` bridges the two with the Checkpointer's public directory saves
(``save(seq, state, directory=path)``, :mod:`fastpersist.publish`): one long-lived
Checkpointer (so its snapshot arena, worker and process groups are reused) writes every
checkpoint under a sequence number in a staging root next to the checkpoints, and moves it
under ``path`` once committed, before its handle completes. No thread of the integration's own.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from fastpersist.checkpointer import Checkpointer, list_checkpoints
from fastpersist.handle import SaveHandle
from fastpersist.publish import remove_path

STAGING = ".fastpersist-staging"

__all__ = ["NamedCheckpoints", "STAGING", "remove_path"]


class NamedCheckpoints:
    """Checkpoints saved under paths of the caller's choosing, by one Checkpointer.

    Args:
        mode: the Checkpointer's mode (``"sync"``, ``"snapshot"`` or ``"overlap"``).
        **kwargs: further Checkpointer arguments (``config``, ``backend``, ``snapshot_bytes``).
    """

    def __init__(self, mode: str, **kwargs: Any) -> None:
        self.mode = mode
        # A run that died between a commit and its move left a committed step in the staging
        # root; the next run restarts the sequence numbers, which abandons it: deleted.
        self.kwargs = {"abandoned": "delete", **kwargs}
        self.collective = False  # every rank saves (else this process alone: comm="local")
        self._checkpointer: Checkpointer | None = None
        self._staging: str | None = None
        self._next = 0

    def save(self, state: Any, path: str, rank_state: Any = None) -> SaveHandle:
        """Start saving ``state`` as ``path`` (a directory); the handle completes once ``path``
        holds it (in the background, unless the mode is sync)."""
        staging = os.path.join(os.path.dirname(os.path.abspath(path)), STAGING)
        ck = self._for(staging)
        seq, self._next = self._next, self._next + 1
        return ck.save(seq, state, rank_state=rank_state, directory=path)

    def close(self) -> None:
        """Wait for the checkpoints in flight and release the staging root."""
        if self._checkpointer is not None:
            ck, self._checkpointer = self._checkpointer, None
            ck.close()
            if ck.rank == 0 and self._staging is not None and not list_checkpoints(self._staging):
                shutil.rmtree(self._staging, ignore_errors=True)  # every checkpoint was published

    def _for(self, staging: str) -> Checkpointer:
        """The Checkpointer for ``staging`` (a new one if the checkpoints' directory changed)."""
        if self._checkpointer is not None and self._staging == staging:
            return self._checkpointer
        self.close()
        comm = None if self.collective else "local"
        self._checkpointer = Checkpointer(staging, mode=self.mode, comm=comm, **self.kwargs)
        self._staging = staging
        self._next = 0
        return self._checkpointer
