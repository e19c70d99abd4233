"""Which tier a read goes to: the local roots, the job's other nodes, the durable tier.

One resolver serves both readers: ``fastpersist.open`` (a view of roots, or of a durable tier
by its URL) and the Checkpointer, whose reads go through a :class:`Tiers`:

* on one node, nothing here needs a process group: the roots are read through a
  :class:`~fastpersist.loading.view.CheckpointView`; ``"latest"`` is the most recent commit of
  the roots and the durable tier (commit sequences continue across tiers); a step the roots
  lack, or whose local copy cannot be read (a lost or damaged file), comes from the durable tier;
* on several nodes every call is collective (every rank calls it): the nodes agree on the step
  and each receives what it lacks from the others (:mod:`fastpersist.tiers.nodes.restore`); the
  durable tier comes next when no node holds the step complete.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from fastpersist.config import IOConfig
from fastpersist.dist import Comm
from fastpersist.errors import CheckpointError, CheckpointNotFoundError, CheckpointReadError, IncompleteCheckpointError
from fastpersist.format import manifest as mf
from fastpersist.loading.engine import load_from, load_object
from fastpersist.loading.view import CheckpointView, Roots, check_keys
from fastpersist.storage.backend import FileBackend
from fastpersist.tiers.durable.store import is_url
from fastpersist.tiers.durable.view import DurableView
from fastpersist.tiers.nodes.restore import PeerRestore
from fastpersist.topology import NodeMap

logger = logging.getLogger(__name__)
T = TypeVar("T")

ReadView = Callable[[CheckpointView, int | str], T]  # a read through one tier's view
Restore = Callable[[list[str], mf.Manifest], T]  # the same read from directories and a manifest (nodes)


def open(roots: Roots, *, config: IOConfig | None = None,  # noqa: A001 - fastpersist.open
         backend: FileBackend | None = None) -> CheckpointView:
    """Read-only access to the checkpoints under ``roots``; see :class:`CheckpointView`.

    ``roots`` may also be a durable tier in object storage (an ``s3://bucket/prefix`` URL):
    the view then lists and loads what was drained there (see
    :class:`fastpersist.tiers.durable.view.DurableView`; same methods). A durable tier in a
    directory is a checkpoint root like any other."""
    if isinstance(roots, str) and is_url(roots):
        return DurableView(roots, config=config)
    return CheckpointView(roots, config=config, backend=backend)


class Tiers:
    """The reads of one Checkpointer, through its tiers (see the module)."""

    def __init__(self, view: CheckpointView, durable: CheckpointView | DurableView | None, comm: Comm,
                 nodes: NodeMap, config: Callable[[], IOConfig]) -> None:
        self.view, self.durable, self._config = view, durable, config
        self.backend, self.rank = view.backend, comm.rank
        self.peers = PeerRestore(comm, nodes, view.roots, view.backend) if nodes.count > 1 else None

    def latest_step(self) -> int | None:
        """The most recent commit of the roots (on several nodes, complete on the nodes:
        collective) or of the durable tier."""
        if self.peers is None:
            return self._latest_here()[0]
        durable = self._durable_latest()
        chosen, _ = self.peers.resolve("latest")
        if chosen is not None and (durable is None or chosen.manifest.sequence > durable[1]):
            return chosen.manifest.step
        return durable[0] if durable is not None else None

    def read(self, step: int | str, read: ReadView[T], restore: Restore[T]) -> T:
        """``read`` through the tiers; on several nodes, ``restore`` through the nodes' restore
        protocol, then the durable tier (for "latest": whichever holds the most recent commit;
        for a step: the durable tier when the nodes do not hold it complete)."""
        if self.peers is None:
            return self._read_here(step, read)
        durable = self._durable_latest() if step == "latest" else None
        try:
            return self.peers.load(step, restore, durable[1] if durable is not None else -1)
        except (CheckpointNotFoundError, IncompleteCheckpointError) as e:
            if self.durable is None:
                raise
            if durable is not None:
                logger.info("loading checkpoint step %d from the durable tier (the most recent commit)", durable[0])
                return read(self.durable, durable[0])
            try:
                self.durable.manifest(step)
            except CheckpointNotFoundError:
                raise e from None
            logger.warning("%s; loading it from the durable tier", e)
            return read(self.durable, step)

    def load(self, step: int | str, into: Mapping[str, Any] | None, keys: Iterable[str] | None, map_location: Any,
             weights_only: bool, verify: bool | None) -> Any:
        check_keys(keys, into)
        return self.read(step, lambda v, s: v.load(
            s, into, keys=keys, map_location=map_location, weights_only=weights_only, verify=verify),
            lambda dirs, m: load_from(dirs, m, into, keys, map_location, weights_only, verify, self._config(),
                                      self.backend))

    def load_rank_state(self, step: int | str, into: Mapping[str, Any] | None, rank: int | None, map_location: Any,
                        weights_only: bool, verify: bool | None) -> Any:
        who = self.rank if rank is None else rank
        return self.read(step, lambda v, s: v.load_rank_state(
            s, into, rank=who, map_location=map_location, weights_only=weights_only, verify=verify),
            lambda dirs, m: load_object(dirs, m, mf.rank_object(who), into, map_location, weights_only, verify,
                                        self._config(), self.backend))

    def metadata(self, step: int | str) -> dict[str, Any]:
        if self.peers is None:
            return self._read_here(step, _metadata)
        if step == "latest":
            latest = self.latest_step()
            if latest is None:
                raise CheckpointNotFoundError(f"no committed checkpoint on this job's nodes under {self.view.roots[0]}")
            step = latest
        try:
            chosen, _ = self.peers.resolve(step, complete=False)  # the manifest is all it needs
            if chosen is not None:
                return dict(chosen.manifest.user)
        except CheckpointNotFoundError:
            if self.durable is None:
                raise
        if self.durable is None:  # pragma: no cover - resolve of a step either returns or raises
            raise CheckpointNotFoundError(f"no committed checkpoint step {step}")
        return self.durable.metadata(step)

    # ------------------------------------------------------------------------------------
    # one node: the roots, then the durable tier

    def _latest_here(self) -> tuple[int | None, bool]:
        """The most recent commit of either tier (commit sequences continue across tiers, see
        :class:`fastpersist.saving.coordinator.Coordinator`), and whether it is the durable tier's."""
        here = self.view.latest_step()
        durable = self.durable
        there = durable.latest_step() if durable is not None else None
        if there is None or durable is None:
            return here, False
        if here is None or self.view.manifest(here).sequence < durable.manifest(there).sequence:
            return there, True
        return here, False

    def _read_here(self, step: int | str, read: ReadView[T]) -> T:
        """``read(view, step)`` from the tier that holds ``step``: ``"latest"`` is the most
        recent commit of either tier (from the durable tier, ``"latest"`` itself, so that a
        damaged one falls back to an older one there); a step the local roots lack, or whose
        local copy cannot be read, is read from the durable tier if it holds it."""
        durable = self.durable
        if durable is None:
            return read(self.view, step)
        if step == "latest":
            latest, remote = self._latest_here()
            if remote:
                logger.info("loading checkpoint step %d from the durable tier %s (the most recent commit)", latest,
                            durable.roots[0])
                return read(durable, "latest")
            if latest is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.view.roots[0]} or in "
                                              f"{durable.roots[0]}")
            step = latest
        try:
            return read(self.view, step)
        except CheckpointReadError as e:
            try:
                durable.manifest(step)
            except CheckpointNotFoundError:
                raise e from None
            if not isinstance(e, CheckpointNotFoundError):
                logger.warning("checkpoint step %s cannot be read from the local roots (%s): loading it from the "
                               "durable tier %s", step, e, durable.roots[0])
            return read(durable, step)

    def _durable_latest(self) -> tuple[int, int] | None:
        """The durable tier's latest commit (step, sequence) as rank 0 sees it, on every rank."""
        if self.durable is None:  # every rank alike (the ranks' durable locations were compared)
            return None
        seen = None
        if self.rank == 0:
            try:
                latest = self.durable.latest_step()
                seen = (latest, self.durable.manifest(latest).sequence) if latest is not None else None
            except CheckpointError as e:
                logger.warning("the durable tier cannot be read (%s): restoring from the nodes only", e)
        return self.peers.share(seen) if self.peers is not None else seen


def _metadata(view: CheckpointView, step: int | str) -> dict[str, Any]:
    return view.metadata(step)


class ReadMethods:
    """The Checkpointer's loads: through the roots, then the durable tier; on several nodes
    every load is collective (the restore protocol, :mod:`fastpersist.tiers.nodes.restore`).
    A mixin over the Checkpointer's :class:`Tiers`."""

    _tiers: Tiers

    def load(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
             keys: Iterable[str] | None = None, map_location: Any = None, weights_only: bool = True,
             verify: bool | None = None) -> Any:
        """Load a checkpoint's state (sharded tensors resharded into ``into``'s DTensors); see
        :meth:`CheckpointView.load`. A step the local roots lack (new machines, lost disks) is
        read from the durable tier, if there is one; ``"latest"`` is the most recent commit
        of either. On several nodes this is collective: every rank calls it, and the bytes a
        node lacks come from the nodes that hold them."""
        return self._tiers.load(step, into, keys, map_location, weights_only, verify)

    def load_rank_state(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
                        rank: int | None = None, map_location: Any = None, weights_only: bool = True,
                        verify: bool | None = None) -> Any:
        """Load the ``rank_state`` that ``rank`` (default: this rank) saved (collective on
        several nodes)."""
        return self._tiers.load_rank_state(step, into, rank, map_location, weights_only, verify)

    def metadata(self, step: int | str = "latest") -> dict[str, Any]:
        """The ``metadata`` saved with ``step`` (collective on several nodes)."""
        return self._tiers.metadata(step)

    def latest_step(self) -> int | None:
        """The most recently committed step (not necessarily the largest) of the local roots
        or the durable tier, or None. On several nodes (collective): the most recent commit
        complete on the job's nodes, else the durable tier's."""
        return self._tiers.latest_step()


