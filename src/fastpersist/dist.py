"""Ranks, writer policies and failure-safe collective steps.

fastpersist never issues collectives on the training's process group: a :class:`GlooComm`
owns a separate gloo group (created collectively when the Checkpointer is built), so checkpoint
coordination works whatever backend trains (NCCL, gloo, ...) and can run from a background
thread without interleaving with the training's collectives. World size 1 uses
:class:`LocalComm` and needs no process group at all.

Every distributed step goes through :func:`agree`: each rank runs its part, catches its own
failure, and all ranks exchange outcomes; if any rank failed, every rank raises one
:class:`DistributedCheckpointError` carrying each failing rank's number and traceback. No rank
is left waiting in a collective that the others skipped.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import pickle
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from fastpersist import teardown
from fastpersist.errors import CheckpointError, CheckpointWriteError, DistributedCheckpointError

T = TypeVar("T")

logger = logging.getLogger(__name__)

teardown.install()  # gloo's worker threads finish before the interpreter finalizes


class Comm(Protocol):
    """The few collectives fastpersist needs (on objects, small)."""

    rank: int
    world_size: int

    def all_gather(self, obj: Any, channel: str = "work") -> list[Any]:
        """Gather ``obj`` from every rank. ``channel`` "work" is used by the thread that runs
        saves, "control" by the training thread; the two never share a group."""
        ...


class LocalComm:
    """World size 1: no process group."""

    rank = 0
    world_size = 1

    def all_gather(self, obj: Any, channel: str = "work") -> list[Any]:
        return [obj]


class GlooComm:
    """Collectives on gloo groups of its own, beside whatever group the training uses.

    A gloo group must not outlive the interpreter, nor hand gloo tensors that Python forgets
    first. Gloo's worker threads drop their references to a collective's tensors *after* the
    caller has returned from it; if that drop is the last reference, it frees a Python object
    and so takes the GIL, and if the interpreter is finalizing by then the thread is unwound
    through a ``noexcept`` frame and the process aborts (SIGABRT, "terminate called without an
    active exception"), although everything was saved. So every tensor this comm gives gloo
    stays referenced from Python for the next few collectives, and :meth:`close` destroys the
    groups (joining their threads, which then never need the GIL) before letting them go. The
    Checkpointer that created a comm closes it in ``close()``, when it is collected, and at
    interpreter exit while the interpreter is whole.
    """

    _KEEP = 8  # collectives whose tensors stay referenced (gloo has released them long before)

    def __init__(self, timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        # Two groups: the background save thread and the training thread each have their own,
        # so their collectives can never interleave.
        self._groups: dict[str, Any] = {"work": dist.new_group(backend="gloo", timeout=timeout),
                                        "control": dist.new_group(backend="gloo", timeout=timeout)}
        self._kept: dict[str, collections.deque[tuple[Any, ...]]] = {
            c: collections.deque(maxlen=self._KEEP) for c in self._groups}
        self._kept_p2p: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=2)  # large: kept briefly

    def all_gather(self, obj: Any, channel: str = "work") -> list[Any]:
        with self._collective(channel) as group:
            return self._all_gather(obj, group, self._kept[channel])

    @contextlib.contextmanager
    def _collective(self, channel: str) -> Iterator[Any]:
        """The channel's group; gloo's report of a dead or silent peer (a RuntimeError) becomes
        a CheckpointError naming this rank and the timeout."""
        group = self._groups.get(channel)
        if group is None:
            raise CheckpointError(f"checkpoint coordination on rank {self.rank} after its process groups were "
                                  "closed (the Checkpointer is closed)")
        try:
            yield group
        except RuntimeError as e:
            raise CheckpointError(
                f"checkpoint coordination failed on rank {self.rank}: another rank died or did not answer "
                f"within {self.timeout_s:.0f} s (gloo: {str(e).splitlines()[0][:300]})"
            ) from e

    def _all_gather(self, obj: Any, group: Any, kept: collections.deque[tuple[Any, ...]]) -> list[Any]:
        """``all_gather_object`` with tensors this comm keeps referenced (see the class)."""
        import torch

        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        kept.append((size, sizes))
        self._dist.all_gather(sizes, size, group=group)
        longest = max(int(n.item()) for n in sizes)
        mine = torch.zeros(max(1, longest), dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        kept.append((mine, gathered))
        self._dist.all_gather(gathered, mine, group=group)
        return [pickle.loads(t[: int(n.item())].numpy().tobytes()) for t, n in zip(gathered, sizes)]

    def broadcast(self, tensor: Any, src: int, channel: str = "control") -> None:
        """Broadcast a CPU tensor from rank ``src`` to every rank, in place (the restore
        protocol's bytes, :mod:`fastpersist.tiers.nodes.restore`)."""
        with self._collective(channel) as group:
            self._kept_p2p.append((tensor,))
            self._dist.broadcast(tensor, src=src, group=group)

    def exchange(self, sends: list[tuple[int, Any]], recvs: list[tuple[int, Any]], channel: str = "work") -> None:
        """Send each (rank, tensor) of ``sends`` and receive each (rank, tensor) of ``recvs`` at
        once, and wait for all (copies of unique bytes, :mod:`fastpersist.tiers.nodes.copies`)."""
        with self._collective(channel) as group:
            self._kept_p2p.append((*(t for _, t in sends), *(t for _, t in recvs)))
            reqs = [self._dist.isend(t, dst, group=group) for dst, t in sends]
            reqs += [self._dist.irecv(t, src, group=group) for src, t in recvs]
            for r in reqs:
                if r is not None:
                    r.wait()

    def close(self) -> None:
        """Destroy this comm's groups, joining their threads, then drop the tensors gloo had
        (idempotent; no collective). Works whether or not the training's process groups were
        destroyed first."""
        groups, self._groups = self._groups, {}
        while groups:
            _, group = groups.popitem()
            try:
                if self._dist.is_initialized():
                    self._dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as e:  # already destroyed with the default group
                logger.debug("fastpersist's process group was already destroyed: %s", e)
            del group  # the last reference: the group's threads are joined here
        self._kept.clear()
        self._kept_p2p.clear()


def default_comm(timeout_s: float = 600.0) -> Comm:
    """A :class:`GlooComm` when torch.distributed is initialised with several ranks, else local."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed support
        return LocalComm()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return GlooComm(timeout_s)
    return LocalComm()



def agree(comm: Comm, what: str, fn: Callable[[], T]) -> list[T]:
    """Run ``fn`` on every rank; return every rank's result, or raise on every rank.

    ``what`` names the step in the error ("writing checkpoint step 10"). At world size 1 there
    is nobody to tell: a failure is raised as it is (a :class:`CheckpointError` subclass; any
    other exception wrapped in :class:`CheckpointWriteError` naming the step).
    """
    if comm.world_size == 1:
        try:
            return [fn()]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointWriteError(f"{what} failed: {type(e).__name__}: {e}") from e
    local_error: BaseException | None = None
    try:
        outcome: tuple[bool, Any] = (True, fn())
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        local_error = e
        outcome = (False, "".join(traceback.format_exception(e)))
    outcomes = comm.all_gather(outcome)
    failures = {r: str(o[1]) for r, o in enumerate(outcomes) if not o[0]}
    if failures:
        ranks = sorted(failures)
        first = failures[ranks[0]].rstrip().splitlines()[-1]
        details = "".join(f"\n--- rank {r} ---\n{failures[r].rstrip()}" for r in ranks)
        err = DistributedCheckpointError(
            f"{what} failed on rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))}: {first}{details}",
            failures,
        )
        if local_error is not None:
            raise err from local_error
        raise err
    return [o[1] for o in outcomes]


def host_name() -> str:
    return socket.gethostname()
