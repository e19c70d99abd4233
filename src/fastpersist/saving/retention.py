"""Retention: which committed checkpoints to delete, and the thread that deletes them.

The policy (:class:`fastpersist.options.Retention`) is pure: given the commits, it names the
steps to delete. The :class:`Janitor` deletes them in a thread of its own, off the save's path:
the save that triggered the deletion, and the next one, do not wait for it. Deletion is best
effort: a checkpoint whose manifest could not be removed stays committed (and listed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from fastpersist.storage import catalog
from fastpersist import timeline
from fastpersist.storage.backend import FileBackend
from fastpersist.options import Retention

logger = logging.getLogger(__name__)

__all__ = ["Janitor", "Retention"]


class Janitor:
    """Deletes the checkpoints retention gave up, one at a time, in a background thread."""

    def __init__(self, roots: Sequence[str], backend: FileBackend) -> None:
        self.roots = list(roots)
        self.backend = backend
        self._lock = threading.Lock()
        self._deleting: set[int] = set()  # steps whose deletion is queued or running
        self._executor: ThreadPoolExecutor | None = None

    def deleting(self) -> set[int]:
        with self._lock:
            return set(self._deleting)

    def delete(self, gone: dict[int, timeline.Commit], kept: Callable[[int, timeline.Commit], None]) -> None:
        """Delete ``gone`` in the background; ``kept(step, commit)`` hears of each one that
        could not be deleted (it is still committed)."""
        with self._lock:
            self._deleting |= set(gone)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastpersist-retention")
            self._executor.submit(self._delete, gone, kept)

    def _delete(self, gone: dict[int, timeline.Commit], kept: Callable[[int, timeline.Commit], None]) -> None:
        for old, commit in gone.items():
            try:
                removed = catalog.remove_checkpoint(self.roots, old, self.backend)
            except Exception as e:  # noqa: BLE001 - best effort, like every retention deletion
                logger.warning("retention could not delete checkpoint step %d: %s", old, e)
                removed = False
            if not removed:
                kept(old, commit)
            with self._lock:
                self._deleting.discard(old)

    def drain(self) -> None:
        """Wait for the deletions queued so far."""
        with self._lock:
            executor = self._executor
        if executor is not None:
            executor.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the deletions queued and stop the thread (a later delete starts a new one)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
