"""The durable tier as an extension of the save: committed checkpoints drained in the background.

Rank 0 decides, inside the commit step and before the commit point, whether the step is drained
(:meth:`Drainer.take`: due, and the drain queue has room): a step taken is marked at once, so
local retention spares it from the moment any rank can learn of its commit. Every rank hears the
decision with the commit's outcome and queues its part of the drain (its own files); nothing
waits for it. The drain thread asks the core to apply retention again when a drain ends (the
local copy it held back may go then). New commits are numbered after every commit found in the
durable tier (a job restarted on empty disks from a drained checkpoint keeps one timeline).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastpersist import timeline
from fastpersist.options import Durable
from fastpersist.saving.extension import Extension
from fastpersist.saving.messages import Committed, RankReport, SavePlan
from fastpersist.storage.backend import FileBackend
from fastpersist.tiers.durable.drain import Drainer, drain_files
from fastpersist.tiers.durable.store import Store

if TYPE_CHECKING:
    from fastpersist.saving.job import SaveJob

logger = logging.getLogger(__name__)


class DurableDrain(Extension):
    """Drains this rank's files of each due checkpoint to ``store`` (see the module)."""

    name = "durable"
    option = "durable"

    def __init__(self, store: Store, roots: Sequence[str], rank: int, option: Durable, abandoned: str,
                 timeout_s: float, nice: int, backend: FileBackend | None = None) -> None:
        self.rank = rank
        self.drainer = Drainer(store, roots, rank, every=option.every, keep=option.keep, abandoned=abandoned,
                               bandwidth=option.bandwidth, timeout_s=timeout_s, nice=nice,
                               ended=self._ended if rank == 0 else None, backend=backend)
        self._taken: int | None = None  # rank 0: the step its drain took in this save's commit
        if rank == 0:
            self.drainer.read_ahead()

    def _ended(self) -> None:
        """A drain ended (rank 0, drain thread): the local copy it held back may go now."""
        self.core.retain()

    def start(self, job: SaveJob) -> None:
        self._taken = None

    def elsewhere(self) -> list[timeline.Commit]:
        return self.drainer.known_commits() if self.rank == 0 else []

    def decide(self, job: SaveJob, plan: SavePlan) -> bool:
        taken = self.drainer.take(job.step)
        self._taken = job.step if taken else None
        return taken

    def committed(self, job: SaveJob, plan: SavePlan, written: Sequence[RankReport], outcome: Committed) -> None:
        if not outcome.parts.get(self.name):
            return  # not due, or the queue is full: the handle says it is not drained
        writers = [r for r, w in enumerate(written) if w.reports]
        try:
            files = drain_files(written[self.rank].reports)
        except Exception as e:  # noqa: BLE001 - committed: the durable tier must not fail the save
            if self.rank == 0:
                self.drainer.forget(job.step)  # taken at the commit, never queued: no longer held back
            self._not_queued(job, e)
            return
        try:  # a drain that cannot be queued is no longer held back either (Drainer.submit)
            self.drainer.submit(job.step, plan.save_id, files, writers, job.completion.draining())
        except Exception as e:  # noqa: BLE001 - committed: the durable tier must not fail the save
            self._not_queued(job, e)

    @staticmethod
    def _not_queued(job: SaveJob, error: Exception) -> None:
        logger.warning("checkpoint step %d is committed; queueing its drain failed: %s", job.step, error)
        job.completion.not_drained()

    def failed(self, job: SaveJob, plan: SavePlan, outcome: Committed | None) -> None:
        if self._taken == job.step:  # rank 0 took it, then the commit failed somewhere: never queued
            self.drainer.forget(job.step)
            self._taken = None

    def protected(self) -> set[int]:
        return self.drainer.pending()

    def close(self) -> None:
        self.drainer.close()
