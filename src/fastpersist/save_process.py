"""The save process: one per rank, where a ``Checkpointer(engine="process")`` saves.

Started by the training process (:class:`fastpersist.saving.remote.SaveProcess`) as
``python -m fastpersist.save_process FD PARENT_PID``: FD is its end of a Unix socket pair.
It builds the same Checkpointer the training process was given (in sync mode: each save it
receives was captured whole, into the shared arena, and is committed before the next), inside
a gloo group of the job's save processes, then saves what it is sent until it is told to close,
its parent ends (the socket's end, or a new parent process id), or it gets SIGTERM; in each case
it finishes the save it holds, closes the Checkpointer (the drains in flight finish) and exits 0.
SIGINT is ignored: a terminal's Ctrl-C reaches the whole process group, and the training
process decides what happens to the saves in flight (its exit closes the Checkpointer).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0


class _Terminated(Exception):
    """SIGTERM while waiting for the next message."""


class _Loop:
    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.idle = False
        self.stopping = False

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.stopping = True
        if self.idle:
            raise _Terminated()

    def next(self) -> Any:
        """The next message; None at the end (the training process closed its end or is gone, or SIGTERM)."""
        self.idle = True
        try:
            if self.stopping:
                return None
            return self.channel.recv()
        except (_Terminated, OSError, EOFError):
            return None
        finally:
            self.idle = False

    def send(self, message: tuple[Any, ...]) -> None:
        """Send to the training process; if it is gone, there is nobody to tell."""
        try:
            self.channel.send(message)
        except OSError:
            pass


def _watch_parent(parent: int, sock: socket.socket) -> None:
    """End the loop when the parent is gone, even if a child it forked keeps its socket end open."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    try:
        sock.shutdown(socket.SHUT_RD)  # the loop's recv returns: the end of messages
    except OSError:
        pass


def _sendable(error: BaseException | None) -> Any:
    """``error`` if it survives pickling, else its type and text."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any error that does not round-trip goes as text
        return f"{type(error).__name__}: {error}"


def _checkpointer(spec: dict[str, Any], rank: int, world: int, group: tuple[str, int] | None) -> Any:
    from fastpersist.checkpointer import Checkpointer

    timeout = datetime.timedelta(seconds=spec.get("timeout_s", 600.0))
    if world > 1:
        import torch.distributed as dist

        host, port = group  # type: ignore[misc]
        store = dist.TCPStore(host, port, world, False, timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore("fastpersist-save", store), rank=rank,
                                world_size=world, timeout=timeout)
        return Checkpointer(**spec, mode="sync", comm=None, engine="thread")
    return Checkpointer(**spec, mode="sync", comm="local", engine="thread")  # here, the save runs in threads


def _metrics(handle: Any) -> dict[str, Any]:
    m = handle.metrics
    return {name: getattr(m, name) for name in ("bytes_total", "bytes_written", "bytes_reused", "bytes_per_root",
                                                 "write_s", "replica_check_s", "probe_s", "templated")}


def _save(ck: Any, loop: _Loop, number: int, message: bytes, memory: dict[Any, Any]) -> None:
    from fastpersist.saving.ship import decode

    t0 = time.perf_counter()
    handle, error = None, None

    def staged() -> None:  # the training process's guarded optimizer steps may go on
        loop.send(("staged", number))

    try:
        shipped = decode(message, memory)
        del message
        handle = ck._saver.save_captured(shipped, t0, staged)
    except BaseException as e:  # noqa: BLE001 - sent back to the training process
        error = e
    loop.send(("done", number, _metrics(handle) if handle is not None else {}, handle is not None and error is None,
               _sendable(error)))
    if handle is not None and error is None:
        def drained(future: Any) -> None:
            failure = future.exception()
            loop.send(("drained", number, None if failure else future.result(), _sendable(failure)))

        handle.durable.add_done_callback(drained)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, parent = int(argv[1]), int(argv[2])
    sock = socket.socket(fileno=fd)
    from fastpersist.saving.remote import Channel

    channel = Channel(sock)
    loop = _Loop(channel)
    signal.signal(signal.SIGTERM, loop.on_sigterm)
    threading.Thread(target=_watch_parent, args=(parent, sock), name="fastpersist-parent", daemon=True).start()
    got = loop.next()
    if got is None:
        return 0
    _, spec, rank, world, group = got[0]
    from fastpersist.config import get_config

    nice = (spec.get("config") or get_config()).save_process_nice
    if nice:  # Linux: this thread's; every thread started after inherits it
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        ck = _checkpointer(spec, rank, world, group)
    except BaseException as e:  # noqa: BLE001 - sent back: the training process raises it at its first save
        loop.send(("failed", _sendable(e)))
        return 1
    loop.send(("ready",))
    from fastpersist.io.buffers import map_shared

    memory: dict[Any, Any] = {}
    while True:
        got = loop.next()
        if got is None:
            break
        message, fds = got
        kind = message[0]
        if kind == "map":  # the snapshot arena (grown), or a region of tensors moved into shared memory
            memory[message[1]] = map_shared(fds[0], message[2])
            os.close(fds[0])
        elif kind == "unmap":  # unmapped once the saves that read it are done (their tensors hold it)
            memory.pop(message[1], None)
        elif kind == "save":
            _save(ck, loop, message[1], message[2], memory)
        elif kind == "settle":
            ck._engine.settle()
            loop.send(("settled", message[1]))
        elif kind == "close":
            break
    error = None
    try:
        ck.close()
    except BaseException as e:  # noqa: BLE001 - sent back
        error = e
    loop.send(("closed", _sendable(error)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
