"""The coordinator's part of a save (rank 0): the roots' lock, the clean start, the commit
(manifest written last, then ``latest``) and what follows a commit (files of an earlier save
of the same step removed, retention applied).

Only rank 0 calls these, inside the steps of :mod:`fastpersist.protocol`; it learns what every
rank wrote from their :class:`~fastpersist.protocol.RankReport` messages.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastpersist import catalog, dtensor, timeline
from fastpersist.errors import CheckpointError
from fastpersist.format import manifest as mf
from fastpersist.io.backend import FileBackend
from fastpersist.lock import RootLock
from fastpersist.objects.write import build_object, build_sharded
from fastpersist.retention import Janitor, Retention

if TYPE_CHECKING:
    from fastpersist.protocol import RankReport

logger = logging.getLogger(__name__)


class Coordinator:
    """Rank 0's view of the roots: what is committed there, and how a new commit is made."""

    def __init__(self, roots: Sequence[str], backend: FileBackend, retention: Retention, world_size: int,
                 clean_start: bool = True, elsewhere: Callable[[], list[timeline.Commit]] | None = None) -> None:
        self.roots = list(roots)
        self.backend = backend
        self.retention = retention
        self.world_size = world_size
        self.clean_start = clean_start
        self.janitor = Janitor(self.roots, backend)
        self._lock = threading.Lock()
        self._root_lock = RootLock(self.roots[0], backend)
        self._commits: dict[int, timeline.Commit] | None = None  # read at the first save
        # The commits of the durable tier (read once by the drain, then kept up to date there):
        # commit sequences continue after them, so that a job restarted on empty disks from a
        # drained checkpoint keeps one commit order.
        self._elsewhere = elsewhere
        self._sequence_floor = 0

    def start(self, step: int) -> None:
        """Before a save's first byte: let a deletion of ``step`` finish; at the first save,
        take the roots' lock and then, owning the roots, remove what a crashed run left there
        (before anyone writes) and read what is committed."""
        if step in self.janitor.deleting():
            self.janitor.drain()
        if not self._root_lock.held:
            self._root_lock.acquire()
            if self.clean_start:
                catalog.clean_incomplete(self.roots, self.backend)
            self._read_commits()

    def _read_commits(self) -> None:
        """What is committed in the roots (for the timeline and retention). A root that cannot
        be listed leaves it unknown, logged: the commit is then recorded without a sequence
        (readers order it by its time) and retention waits for a later start."""
        try:
            commits = {c.step: c for c in catalog.commits(self.roots[0], backend=self.backend)}
        except OSError as e:
            logger.warning("cannot list %s (%s): this commit is ordered by its time and retention is off until "
                           "the root can be listed", self.roots[0], e.strerror or e)
            return
        with self._lock:
            self._commits = commits

    def commit(self, step: int, save_id: str, written: Sequence[RankReport],
               metadata: Mapping[str, Any] | None, layout: dtensor.Layout) -> None:
        """Write the manifest (the commit point), then point ``latest`` at it."""
        if self._commits is None:
            self._read_commits()
        with self._lock:
            known = self._commits is not None
            commits = list((self._commits or {}).values())
        abandoned = timeline.abandoned_by(step, commits)
        if self._elsewhere is not None:  # what the durable tier is known to hold (cached there)
            self._sequence_floor = max([self._sequence_floor, *(c.sequence for c in self._elsewhere())])
        sequence = max(timeline.next_sequence(commits), self._sequence_floor + 1) if known else 0
        manifest = self._manifest(step, save_id, sequence, written, metadata, layout)
        step_path = os.path.join(self.roots[0], catalog.step_dir(step))
        # The commit point: the manifest is written last, after every rank's data is durable.
        catalog.write_atomic(step_path, mf.MANIFEST_NAME, manifest.to_json(), self.backend, events=True)
        with self._lock:
            if self._commits is not None:
                self._commits[step] = timeline.Commit(step, manifest.sequence, manifest.created)
        if abandoned:
            logger.warning("checkpoint step %d starts a new timeline: steps %s, committed earlier, are abandoned "
                           "(latest is now step %d); %s", step, ", ".join(map(str, abandoned)), step,
                           "they are kept and listed as abandoned" if self.retention.abandoned == "keep"
                           else "retention deletes them")
        self.backend.event("before-latest")
        catalog.point_latest(self.roots[0], step, self.backend)

    def _manifest(self, step: int, save_id: str, sequence: int, written: Sequence[RankReport],
                  metadata: Mapping[str, Any] | None, layout: dtensor.Layout) -> mf.Manifest:
        reports = [r for w in written for r in w.reports]
        files = tuple(mf.FileEntry(r.root, r.name, r.size) for r in reports)
        index = {(r.root, r.name): i for i, r in enumerate(reports)}
        objects: dict[str, mf.ObjectEntry] = {}
        for w in written:
            for obj, (keys, sizes, tensors) in w.objects.items():
                skel = next(r for r in reports if r.object == obj and r.skeleton_checksum is not None)
                data = [(index[(r.root, r.name)], r) for r in reports if r.object == obj and r.skeleton_checksum is None]
                objects[obj] = build_object(keys, sizes, index[(skel.root, skel.name)], skel, data, tensors)
        chunks = [(index[(r.root, r.name)], r) for r in reports if r.object == mf.SHARDED]
        return mf.Manifest(step, save_id, time.time(), self.world_size, len(self.roots), files, objects,
                           user=dict(metadata or {}), sequence=sequence, sharded=build_sharded(layout, chunks),
                           root_paths=tuple(self.roots))

    def is_committed(self, step: int, save_id: str) -> bool:
        """Whether the commit of this save (``save_id``) of ``step`` happened."""
        try:
            path = os.path.join(self.roots[0], catalog.step_dir(step))
            return catalog.read_manifest(path, self.backend).save_id == save_id
        except CheckpointError:
            return False

    def after_commit(self, step: int, written: Sequence[RankReport], protected: set[int]) -> None:
        """Drop files of an earlier save of the same step, then apply retention (never to a
        step in ``protected``: those in flight). Deletions are best effort."""
        keep = {(r.root, r.name) for w in written for r in w.reports}
        catalog.remove_files(self.roots, step, "", self.backend, keep=keep)
        self.retain(protected | {step})

    def retain(self, protected: set[int]) -> None:
        """Apply retention (never to a step in ``protected``); after a commit, and when a
        drain to the durable tier ends (the local copy it kept may go now)."""
        with self._lock:
            if self._commits is None:
                return
            protected = protected | self.janitor.deleting()
            victims = self.retention.to_delete(list(self._commits.values()), protected)
            gone = {old: self._commits.pop(old) for old in victims}
        if gone:
            self.janitor.delete(gone, self._kept)

    def _kept(self, step: int, commit: timeline.Commit) -> None:
        with self._lock:
            if self._commits is not None:
                self._commits.setdefault(step, commit)

    def close(self) -> None:
        """Finish retention's deletions and release the roots' lock."""
        try:
            self.janitor.close()
        finally:
            self._root_lock.release()
