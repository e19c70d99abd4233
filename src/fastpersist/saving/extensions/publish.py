"""Saving into a directory the caller names (``save(step, state, directory=X)``), as an
extension of the save.

The checkpoint is written and committed under the roots like any other; after the commit,
still inside the save's job (so its handle completes only once ``X`` holds it, and saves stay
ordered), rank 0 moves it into ``X`` (:func:`fastpersist.storage.publish.publish_step`: a
rename and an atomic exchange) and every rank hears the outcome. Retention stops counting the
step at its commit: the checkpoint leaves the roots.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastpersist.dist import agree
from fastpersist.errors import CheckpointWriteError
from fastpersist.saving.extension import Extension, parts_of
from fastpersist.saving.messages import Committed, Proposal, RankReport, SavePlan
from fastpersist.storage.publish import publish_step

if TYPE_CHECKING:
    from fastpersist.saving.job import SaveJob


class Publish(Extension):
    """Publishing into a named directory: ``roots``, ``nodes`` and ``durable`` say whether this
    Checkpointer can (one root, one node or shared roots, no durable tier)."""

    name = "publish"

    def __init__(self, roots: int, nodes: int, durable: bool) -> None:
        self._why_not = ("the Checkpointer has several roots (a directory save holds one root's step directory)"
                         if roots > 1 else "the job spans several nodes with node-local roots" if nodes > 1
                         else "the Checkpointer drains to a durable tier (the checkpoint would leave the roots the "
                         "drain reads)" if durable else None)

    def target(self, directory: object) -> str:
        """The absolute path of a ``directory=`` save, or why it cannot be one (the same on
        every rank: the Checkpointer's arguments were checked at construction to agree)."""
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        path = os.path.abspath(os.fspath(directory))
        if self._why_not is not None:
            raise ValueError(f"save(directory={path!r}): {self._why_not}; save into a directory with one root, on "
                             "one node (or roots every node shares), without durable=")
        return path

    def propose(self, job: SaveJob) -> bool:
        return job.directory is not None

    def plan(self, job: SaveJob, proposals: Sequence[Proposal], plan: SavePlan) -> SavePlan:
        publishing = [r for r, p in enumerate(parts_of(proposals, self.name)) if p]
        if publishing and len(publishing) != len(proposals):
            raise CheckpointWriteError(
                f"checkpoint step {job.step}: save(directory=...) was given on rank(s) {publishing} only; every rank "
                "passes it (rank 0's directory is used)")
        return plan

    def committed(self, job: SaveJob, plan: SavePlan, written: Sequence[RankReport], outcome: Committed) -> None:
        """Rank 0 moves the committed checkpoint into its directory; every rank raises if that
        failed (the checkpoint then stays committed where the error says)."""
        if job.directory is None:
            return
        self.core.coordinator.release(job.step)  # moved out of the roots next: retention must not count it
        agree(self.core.comm, f"publishing checkpoint step {job.step} as {job.directory}",
              functools.partial(self._publish, job.step, job.directory))

    def _publish(self, step: int, directory: str) -> None:
        if self.core.comm.rank != 0:
            return
        coordinator = self.core.coordinator
        coordinator.janitor.drain()  # no deletion of the roots' old steps races the move
        publish_step(coordinator.roots[0], step, directory, coordinator.backend)
