"""One writer per checkpoint root: a lock file held by the job that writes there.

Two jobs pointed at the same root by mistake would delete each other's in-progress saves (the
start-up cleanup) and race on ``latest``. The coordinator of a Checkpointer therefore holds
``<first root>/.fastpersist.lock`` with ``flock`` from its first save until ``close()``. The
kernel releases a flock when its process dies, so a lock left by a crashed job is recognised
as stale simply because it can be taken; the file's content (pid, host, time) only serves the
error message and the log. Readers (load, list, ls, verify) never take the lock.

flock is advisory and local to one machine (NFS support varies); roots shared by jobs on
different machines need a scheduler that keeps them apart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time

from fastpersist.errors import CheckpointWriteError
from fastpersist.storage.backend import FileBackend

logger = logging.getLogger(__name__)

LOCK_NAME = ".fastpersist.lock"


class RootLock:
    def __init__(self, root: str, backend: FileBackend) -> None:
        self.path = os.path.join(root, LOCK_NAME)
        self.backend = backend
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> None:
        if self.held:
            return
        try:
            self.backend.makedirs(os.path.dirname(self.path))
            fd = self.backend.lock(self.path)
        except BlockingIOError as e:
            raise CheckpointWriteError(
                f"the checkpoint root {os.path.dirname(self.path)} is in use by another Checkpointer "
                f"({_holder(self.path, self.backend)}); two jobs writing one root would destroy each other's "
                "checkpoints: use another root, or stop the other job (close() releases the root)"
            ) from e
        except OSError as e:
            raise CheckpointWriteError(f"cannot lock {self.path}: {e.strerror or e}") from e
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        try:
            previous = self.backend.swap_lock_note(fd, self.path, info)
        except OSError as e:
            with contextlib.suppress(OSError):  # the descriptor is closed all the same; keep this error
                self.backend.unlock(fd, self.path)
            raise CheckpointWriteError(f"cannot lock {self.path}: {e.strerror or e}") from e
        if previous.strip():
            logger.info("took over %s, left by a job that is no longer running (%s)", self.path, _describe(previous))
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            # an empty lock file tells the next job nothing was left behind
            self.backend.unlock(fd, self.path)


def _holder(path: str, backend: FileBackend) -> str:
    try:
        return _describe(backend.read_lock_note(path))
    except OSError:
        return "holder unknown"


def _describe(raw: bytes) -> str:
    try:
        info = json.loads(raw)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"pid {info['pid']} on {info['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
