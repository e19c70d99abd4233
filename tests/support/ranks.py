"""Several ranks simulated in one process, for unit tests of the save protocol and its
extensions (the way DCP tests its planner): each rank is a thread with a :class:`ThreadComm`,
a :class:`fastpersist.dist.Comm` whose collectives meet at a barrier. Real multi-rank behaviour
(gloo, processes, timeouts) is what the multi-process tests check; this harness checks that the
ranks' logic agrees."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class _Meeting:
    """The shared side of a group of ThreadComms: one slot per rank, per channel."""

    def __init__(self, world: int, timeout: float) -> None:
        self.world = world
        self.timeout = timeout
        self.barriers = {c: threading.Barrier(world) for c in ("work", "control")}
        self.slots: dict[str, list[Any]] = {c: [None] * world for c in ("work", "control")}
        self.mailbox: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.lock = threading.Lock()


class ThreadComm:
    """One simulated rank's comm (see the module). A rank that never arrives breaks the barrier
    after ``timeout`` seconds, so a test fails instead of hanging."""

    def __init__(self, meeting: _Meeting, rank: int) -> None:
        self._m = meeting
        self.rank = rank
        self.world_size = meeting.world

    def all_gather(self, obj: Any, channel: str = "work") -> list[Any]:
        m = self._m
        m.slots[channel][self.rank] = obj
        m.barriers[channel].wait(m.timeout)
        out = list(m.slots[channel])
        m.barriers[channel].wait(m.timeout)  # nobody overwrites a slot before everyone read it
        return out

    def broadcast(self, tensor: torch.Tensor, src: int, channel: str = "control") -> None:
        got = self.all_gather(tensor.clone() if self.rank == src else None, channel)
        tensor.copy_(got[src])

    def exchange(self, sends: list[tuple[int, Any]], recvs: list[tuple[int, Any]], channel: str = "work") -> None:
        m = self._m
        with m.lock:
            for dst, t in sends:
                m.mailbox.setdefault((self.rank, dst), []).append(t.clone())
        m.barriers[channel].wait(m.timeout)
        with m.lock:
            for src, t in recvs:
                t.copy_(m.mailbox[(src, self.rank)].pop(0))
        m.barriers[channel].wait(m.timeout)


def comms(world: int, timeout: float = 60.0) -> list[ThreadComm]:
    meeting = _Meeting(world, timeout)
    return [ThreadComm(meeting, r) for r in range(world)]


def on_ranks(world: int, fn: Callable[[int, ThreadComm], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, comm)`` on ``world`` simulated ranks at once; every rank's result, or each
    rank's exception as its result (a test asserts on them)."""
    cs = comms(world, timeout)
    out: list[Any] = [None] * world

    def run(r: int) -> None:
        try:
            out[r] = fn(r, cs[r])
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
        if t.is_alive():
            raise AssertionError(f"{t.name} is still running: a simulated rank hangs")
    return out
