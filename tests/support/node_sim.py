"""Simulated nodes on one machine, for the node-loss tests: each rank gets a node id
(``FASTPERSIST_NODE``), its node's private roots (``BASE/<node>/r<j>``), and a backend that
refuses every path under another node's directory (:class:`fastpersist.storage.faults.NodeLocal`), so
that locality is enforced, not assumed; optionally a planned SIGKILL at a file operation.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from fastpersist.storage.faults import NodeLocal


class FaultyNode(NodeLocal):
    """:class:`NodeLocal` with one planned fault at the n-th ``op``: "write", "fsync", "rename" or
    "delete" SIGKILLs the process there (``kill``: the node is lost right there); otherwise
    "write" or "stage" (creating a restore's staging directory) fails with ENOSPC from then on."""

    def __init__(self, base: str, node: str, op: str, n: int, kill: bool) -> None:
        super().__init__(base, node)
        self.op, self.n, self.kill = op, n, kill
        self._count = 0
        self._lock = threading.Lock()

    def _tick(self, op: str) -> None:
        if op != self.op:
            return
        with self._lock:
            self._count += 1
            count = self._count
        if self.kill and count == self.n:
            os.kill(os.getpid(), signal.SIGKILL)
        if not self.kill and count >= self.n:
            raise OSError(28, "No space left on device (injected)")

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        self._tick("write")

    def before_fsync(self, path: str) -> None:
        self._tick("fsync")

    def before_rename(self, dst: str) -> None:
        self._tick("rename")

    def before_delete(self, path: str) -> None:
        super().before_delete(path)
        self._tick("delete")

    def makedirs(self, path: str) -> None:
        if "tmp-peer" in path:
            self._tick("stage")
        super().makedirs(path)


def node_of(rank: int, per_node: int, names: list[str] | None = None) -> str:
    index = rank // per_node
    return names[index] if names is not None else f"node{index}"


def roots_of(base: str, node: str, count: int = 2) -> list[str]:
    return [os.path.join(base, node, f"r{j}") for j in range(count)]


def checkpointer(base: str, rank: int, per_node: int, names: list[str] | None = None,
                 kill_at: tuple[str, int] | None = None, fail_at: tuple[str, int] | None = None, **kw: Any) -> Any:
    from fastpersist import Checkpointer

    node = node_of(rank, per_node, names)
    os.environ["FASTPERSIST_NODE"] = node
    backend = (FaultyNode(base, node, *kill_at, kill=True) if kill_at is not None else
               FaultyNode(base, node, *fail_at, kill=False) if fail_at is not None else NodeLocal(base, node))
    return Checkpointer(roots_of(base, node), backend=backend, **kw)
