"""The coordinator's part of a save: the roots' lock, the clean start, the commit (manifest
written last, then ``latest``) and what follows a commit (files of an earlier save of the same
step removed, retention applied).

On one node, rank 0 calls these, inside the phases of :mod:`fastpersist.saving.protocol`; it learns
what every rank wrote from their :class:`~fastpersist.saving.messages.RankReport` messages. On several nodes
(node-local roots) every node's leader holds its node's lock, cleans its node's roots and
writes the same manifest there (:meth:`Coordinator.commit_node`); rank 0 alone decides the
commit's sequence and what retention keeps (:meth:`Coordinator.decide`), and the other leaders
delete what it no longer keeps (:meth:`Coordinator.prune`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fastpersist.storage import catalog
from fastpersist.objects import dtensor
from fastpersist import timeline
from fastpersist.errors import CheckpointError, CheckpointWriteError
from fastpersist.format import manifest as mf
from fastpersist.storage.backend import FileBackend
from fastpersist.storage.lock import RootLock
from fastpersist.topology import NodeMap
from fastpersist.objects.write import build_object, build_sharded
from fastpersist.saving.messages import Decision, RankReport
from fastpersist.saving.retention import Janitor, Retention

logger = logging.getLogger(__name__)


class Coordinator:
    """A node's view of its roots (rank 0's, or a node leader's): what is committed there, and
    how a new commit is made."""

    def __init__(self, roots: Sequence[str], backend: FileBackend, retention: Retention, world_size: int,
                 clean_start: bool = True, nodes: NodeMap | None = None, rank: int = 0) -> None:
        self.nodes = nodes if nodes is not None and nodes.count > 1 else None
        self.node = nodes.of_rank[rank] if self.nodes is not None and nodes is not None else 0
        self.rank = rank
        self.roots = list(roots)
        self.backend = backend
        self.retention = retention
        self.world_size = world_size
        self.clean_start = clean_start
        self.janitor = Janitor(self.roots, backend)
        self._lock = threading.Lock()
        self._root_lock = RootLock(self.roots[0], backend)
        self._commits: dict[int, timeline.Commit] | None = None  # read at the first save
        # The highest sequence committed outside the roots (the durable tier): commit sequences
        # continue after it, so that a job restarted on empty disks from a drained checkpoint
        # keeps one commit order.
        self._sequence_floor = 0

    def start(self, step: int) -> None:
        """Before a save's first byte: let a deletion of ``step`` finish; at the first save,
        take the roots' lock and then, owning the roots, remove what a crashed run left there
        (before anyone writes) and read what is committed."""
        if step in self.janitor.deleting():
            self.janitor.drain()
        if not self._root_lock.held:
            self._root_lock.acquire()
            if self.clean_start and self.nodes is None:  # on several nodes: after the inventory (adopt)
                catalog.clean_incomplete(self.roots, self.backend)
            self._read_commits()

    def local_commits(self) -> dict[int, timeline.Commit] | None:
        """What this node's roots hold committed (after :meth:`start`): the first save's
        inventory; None when the roots could not be listed."""
        with self._lock:
            return dict(self._commits) if self._commits is not None else None

    def adopt(self, everywhere: Mapping[int, timeline.Commit], leader_of_zero: bool, known: bool = True) -> None:
        """At the first save on several nodes, once every leader's commits are known: clean this
        node's roots of what no node committed (a step committed on another node keeps its files
        here: they may be its copies), and on rank 0 take the union as the job's commits. When
        some node's commits are not ``known`` (its roots could not be listed), nothing is cleaned."""
        if self.clean_start and known:
            catalog.clean_incomplete(self.roots, self.backend, keep=set(everywhere))
        with self._lock:  # a step committed elsewhere whose copies lie here is this node's to prune too
            if self._commits is not None:
                self._commits = dict(everywhere) if leader_of_zero else {**everywhere, **self._commits}

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

    def commit(self, step: int, save_id: str, written: Sequence[RankReport], metadata: Mapping[str, Any] | None,
               layout: dtensor.Layout, elsewhere: Sequence[timeline.Commit] = ()) -> None:
        """Write the manifest (the commit point), then point ``latest`` at it. ``elsewhere``:
        commits outside the roots, numbered before this one."""
        self._write(step, self._manifest(step, save_id, self._sequence(step, elsewhere), written, metadata, layout))

    def _sequence(self, step: int, elsewhere: Sequence[timeline.Commit] = ()) -> int:
        """The next commit's sequence (0: unknown, the roots could not be listed)."""
        if self._commits is None:
            self._read_commits()
        with self._lock:
            known = self._commits is not None
            commits = list((self._commits or {}).values())
        self._warn_abandoned(step, commits)
        self._sequence_floor = max([self._sequence_floor, *(c.sequence for c in elsewhere)])
        return max(timeline.next_sequence(commits), self._sequence_floor + 1) if known else 0

    def _write(self, step: int, manifest: mf.Manifest) -> None:
        step_path = os.path.join(self.roots[0], catalog.step_dir(step))
        # The commit point: the manifest is written last, after every rank's data is durable.
        catalog.write_atomic(step_path, mf.MANIFEST_NAME, manifest.to_json(), self.backend, events=True)
        with self._lock:
            if self._commits is not None:
                self._commits[step] = timeline.Commit(step, manifest.sequence, manifest.created)
        self.backend.event("before-latest")
        catalog.point_latest(self.roots[0], step, self.backend)

    def _warn_abandoned(self, step: int, commits: list[timeline.Commit]) -> None:
        abandoned = timeline.abandoned_by(step, commits)
        if abandoned:
            logger.warning("checkpoint step %d starts a new timeline: steps %s, committed earlier, are abandoned "
                           "(latest is now step %d); %s", step, ", ".join(map(str, abandoned)), step,
                           "they are kept and listed as abandoned" if self.retention.abandoned == "keep"
                           else "retention deletes them")

    def _manifest(self, step: int, save_id: str, sequence: int, written: Sequence[RankReport],
                  metadata: Mapping[str, Any] | None, layout: dtensor.Layout, created: float | None = None
                  ) -> mf.Manifest:
        reports = [r for w in written for r in w.reports]
        rank_of = [rank for rank, w in enumerate(written) for _ in w.reports]
        node_of = [self.nodes.of_rank[rank] if self.nodes is not None else 0 for rank in rank_of]
        files = tuple(mf.FileEntry(r.root, r.name, r.size, n) for r, n in zip(reports, node_of))
        index = {(r.root, r.name): i for i, r in enumerate(reports)}
        objects: dict[str, mf.ObjectEntry] = {}
        for w in written:
            for obj, (keys, sizes, tensors) in w.objects.items():
                if obj in objects:  # the replicated state is reported by every node's leader
                    continue
                owner = int(obj[len("rank-"):]) if obj != mf.REPLICATED else -1
                skeletons = sorted((i for i, r in enumerate(reports) if r.object == obj and r.skeleton_checksum is not None),
                                   key=lambda i: (rank_of[i] != owner, i))  # the owner's own copy first
                skel = reports[skeletons[0]]
                differ = [reports[i].name for i in skeletons
                          if (reports[i].skeleton_checksum, reports[i].size) != (skel.skeleton_checksum, skel.size)]
                if differ:
                    raise CheckpointWriteError(f"checkpoint step {step}: the copies of object {obj!r}'s skeleton "
                                               f"differ: {skel.name} and {differ[0]} (a copy damaged on its way to "
                                               "another node)")
                data = [(index[(r.root, r.name)], r) for r in reports if r.object == obj and r.skeleton_checksum is None]
                objects[obj] = build_object(keys, sizes, skeletons, skel, data, tensors, files)
        chunks = [(index[(r.root, r.name)], r) for r in reports if r.object == mf.SHARDED]
        extra: dict[str, Any] = {}
        if self.nodes is not None:
            extra = {"version": mf.FORMAT_VERSION, "nodes": self.nodes.ids, "node": self.node}
        return mf.Manifest(step, save_id, time.time() if created is None else created, self.world_size,
                           len(self.roots), files, objects, user=dict(metadata or {}), sequence=sequence,
                           sharded=build_sharded(layout, chunks, files), root_paths=tuple(self.roots), **extra)

    def decide(self, step: int, metadata: Mapping[str, Any] | None, protected: set[int],
               elsewhere: Sequence[timeline.Commit] = ()) -> Decision:
        """Rank 0, on several nodes: the commit's sequence and time, and the steps retention
        keeps once this one is committed (every node's leader deletes the others; rank 0's own
        retention after the commit comes to the same)."""
        sequence = self._sequence(step, elsewhere)
        created = time.time()
        with self._lock:
            if self._commits is None:
                return Decision(sequence, created, frozenset(), metadata)
            after = {**self._commits, step: timeline.Commit(step, sequence, created)}
        gone = self.retention.to_delete(list(after.values()), protected | {step} | self.janitor.deleting())
        return Decision(sequence, created, frozenset(after) - set(gone), metadata)

    def commit_node(self, step: int, save_id: str, written: Sequence[RankReport], layout: dtensor.Layout,
                    decision: Decision) -> None:
        """A node leader's commit on several nodes: the same manifest (this node's index and
        root paths) written last on this node's roots, then ``latest``."""
        manifest = self._manifest(step, save_id, decision.sequence, written, decision.metadata, layout,
                                  decision.created)
        self._write(step, manifest)

    def record(self, step: int, decision: Decision) -> None:
        """Rank 0, on several nodes: a commit that another node wrote although this node's write
        failed still takes its sequence (the next commit is numbered after it)."""
        with self._lock:
            if self._commits is not None:
                self._commits.setdefault(step, timeline.Commit(step, decision.sequence, decision.created))

    def prune(self, decision: Decision, protected: set[int]) -> None:
        """A node leader other than rank 0's, after a commit: delete this node's copies of the
        steps rank 0's retention no longer keeps (never one in ``protected``)."""
        if not decision.live:
            return
        with self._lock:
            if self._commits is None:
                return
            victims = [s for s in self._commits if s not in decision.live and s not in protected
                       and s not in self.janitor.deleting()]
            gone = {old: self._commits.pop(old) for old in victims}
        if gone:
            self.janitor.delete(gone, self._kept)

    def is_committed(self, step: int, save_id: str) -> bool:
        """Whether the commit of this save (``save_id``) of ``step`` happened."""
        try:
            path = os.path.join(self.roots[0], catalog.step_dir(step))
            return catalog.read_manifest(path, self.backend).save_id == save_id
        except CheckpointError:
            return False

    def replaced(self, step: int, written: Sequence[RankReport]) -> None:
        """After the commit of ``step``: remove the files of an earlier save of the same step
        (best effort)."""
        keep = {(r.root, r.name) for w in written for r in w.reports}
        catalog.remove_files(self.roots, step, "", self.backend, keep=keep)

    def after_commit(self, step: int, protected: set[int], decision: Decision | None = None) -> None:
        """Apply retention after the commit of ``step`` (never to a step in ``protected``:
        those in flight): rank 0 decides, the other nodes' leaders follow its ``decision``.
        Deletions are best effort."""
        if decision is not None and self.rank != 0:
            self.prune(decision, protected | {step})
        else:
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

    def release(self, step: int) -> None:
        """Forget the commit of ``step``, moved out of the roots (a directory save,
        :mod:`fastpersist.storage.publish`): retention no longer counts it."""
        with self._lock:
            if self._commits is not None:
                self._commits.pop(step, None)

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
