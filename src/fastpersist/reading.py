"""The Checkpointer's reading: through its roots, the durable tier behind them, and, on several
nodes, the restore protocol (:mod:`fastpersist.peers`), in that order.

On one node nothing here needs a process group: the roots are read through a
:class:`~fastpersist.view.CheckpointView`, and a step they lack (or cannot read) comes from the
durable tier. On several nodes every call is collective (every rank calls it): the nodes agree
on the step and each receives what it lacks from the others; the durable tier comes next when
no node holds the step complete.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fastpersist.config import IOConfig
from fastpersist.durable.view import DurableView, latest_of_tiers, read_tiered
from fastpersist.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from fastpersist.format import manifest as mf
from fastpersist.dist import Comm
from fastpersist.nodes import Nodes
from fastpersist.peers import PeerRestore
from fastpersist.view import CheckpointView, check_keys, load_from, load_object

logger = logging.getLogger(__name__)


class Reads:
    """Loads for one Checkpointer (see the module)."""

    def __init__(self, view: CheckpointView, durable: CheckpointView | DurableView | None, comm: Comm, nodes: Nodes,
                 config: Callable[[], IOConfig]) -> None:
        self.view, self.durable, self._config = view, durable, config
        self.backend, self.rank = view.backend, comm.rank
        self.peers = PeerRestore(comm, nodes, view.roots, view.backend) if nodes.count > 1 else None

    def _read(self, step: int | str, read: Callable[[CheckpointView, int | str], Any],
              restore: Callable[[list[str], mf.Manifest], Any]) -> Any:
        """``read`` through the tiers; on several nodes, ``restore`` through the nodes' restore
        protocol, then the durable tier (for "latest": whichever holds the most recent commit;
        for a step: the durable tier when the nodes do not hold it complete)."""
        if self.peers is None:
            return read_tiered(self.view, self.durable, step, read)
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

    def load(self, step: int | str, into: Mapping[str, Any] | None, keys: Iterable[str] | None, map_location: Any,
             weights_only: bool, verify: bool | None) -> Any:
        check_keys(keys, into)
        return self._read(step, lambda v, s: v.load(
            s, into, keys=keys, map_location=map_location, weights_only=weights_only, verify=verify),
            lambda dirs, m: load_from(dirs, m, into, keys, map_location, weights_only, verify, self._config(),
                                      self.backend))

    def load_rank_state(self, step: int | str, into: Mapping[str, Any] | None, rank: int | None, map_location: Any,
                        weights_only: bool, verify: bool | None) -> Any:
        who = self.rank if rank is None else rank
        return self._read(step, lambda v, s: v.load_rank_state(
            s, into, rank=who, map_location=map_location, weights_only=weights_only, verify=verify),
            lambda dirs, m: load_object(dirs, m, mf.rank_object(who), into, map_location, weights_only, verify,
                                        self._config(), self.backend))

    def metadata(self, step: int | str) -> dict[str, Any]:
        if self.peers is None:
            return read_tiered(self.view, self.durable, step, lambda v, s: v.metadata(s))
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

    def latest_step(self) -> int | None:
        """On several nodes (collective): the most recent commit complete on the nodes or
        committed in the durable tier."""
        if self.peers is None:
            return latest_of_tiers(self.view, self.durable)[0]
        durable = self._durable_latest()
        chosen, _ = self.peers.resolve("latest")
        if chosen is not None and (durable is None or chosen.manifest.sequence > durable[1]):
            return chosen.manifest.step
        return durable[0] if durable is not None else None


class ReadMethods:
    """The Checkpointer's loads: through the roots, then the durable tier; on several nodes
    every load is collective (the restore protocol, :mod:`fastpersist.peers`). A mixin over
    the Checkpointer's :class:`Reads`."""

    _reads: Reads

    def load(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
             keys: Iterable[str] | None = None, map_location: Any = None, weights_only: bool = True,
             verify: bool | None = None) -> Any:
        """Load a checkpoint's state (sharded tensors resharded into ``into``'s DTensors); see
        :meth:`CheckpointView.load`. A step the local roots lack (new machines, lost disks) is
        read from the durable tier, if there is one; ``"latest"`` is the most recent commit
        of either. On several nodes this is collective: every rank calls it, and the bytes a
        node lacks come from the nodes that hold them."""
        return self._reads.load(step, into, keys, map_location, weights_only, verify)

    def load_rank_state(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
                        rank: int | None = None, map_location: Any = None, weights_only: bool = True,
                        verify: bool | None = None) -> Any:
        """Load the ``rank_state`` that ``rank`` (default: this rank) saved (collective on
        several nodes)."""
        return self._reads.load_rank_state(step, into, rank, map_location, weights_only, verify)

    def metadata(self, step: int | str = "latest") -> dict[str, Any]:
        """The ``metadata`` saved with ``step`` (collective on several nodes)."""
        return self._reads.metadata(step)

    def latest_step(self) -> int | None:
        """The most recently committed step (not necessarily the largest) of the local roots
        or the durable tier, or None. On several nodes (collective): the most recent commit
        complete on the job's nodes, else the durable tier's."""
        return self._reads.latest_step()
