"""The training process's side of the save process (``Checkpointer(engine="process")``).

With the process engine, training keeps only the capture: ``save()`` copies the state into the
shared snapshot arena and the save driver's worker hands :class:`SaveProcess` a small message
(:mod:`fastpersist.saving.ship`). Everything else of a save (pickling the skeleton, hashing,
the O_DIRECT writes, the commit protocol, retention, node copies, incremental reuse, the drain)
runs in a process of its own (:mod:`fastpersist.save_process`), so its Python never holds the
training process's GIL.

The save process is started with ``python -m fastpersist.save_process`` (a fresh interpreter:
never a fork of a process with threads or CUDA, and never a re-import of the training script,
as multiprocessing's spawn would do), one per rank, when the Checkpointer is built; it imports
only torch and fastpersist. The two talk over a Unix socket pair: pickled messages, each
length-prefixed, the arena's memfd passed along (``SCM_RIGHTS``) when it grows. The save
processes of a job form a gloo group of their own; its store is served by rank 0's training
process (bound when the Checkpointer is built, so nobody waits for a save process to start).

Failures: the save process dying fails the save in flight and every later one with an error
naming its process id and how it ended; the Checkpointer is then broken for good (a new one
starts new save processes: the group of the dead one's peers cannot be re-formed from one rank,
and what it had written is not known). The training process dying closes its end of the socket:
the save process finishes the save it holds (a save it holds was captured whole), closes, and
exits; it also watches its parent's process id, for a socket end a forked child kept open.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from fastpersist.dist import Comm
from fastpersist.errors import CheckpointError, CheckpointWriteError
from fastpersist.saving.arena import Arena
from fastpersist.saving.handle import Completion
from fastpersist.saving.job import SaveJob
from fastpersist.saving.sharing import SharedLive

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")


class Channel:
    """Pickled messages over a Unix stream socket, each ``(kind, *fields)``, with file
    descriptors attached where a message carries them. One sender at a time (a lock)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: tuple[Any, ...], fds: tuple[int, ...] = ()) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        header = _HEADER.pack(len(payload))
        with self._send_lock:
            if fds:
                sent = self.sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
                if sent < len(header):
                    self.sock.sendall(header[sent:])
            else:
                self.sock.sendall(header)
            self.sock.sendall(payload)

    def recv(self) -> tuple[tuple[Any, ...], list[int]] | None:
        """The next message and the descriptors that came with it; None at the other end's close."""
        header, fds, _, _ = socket.recv_fds(self.sock, _HEADER.size, 4)
        if not header:
            return None
        header += self._exactly(_HEADER.size - len(header))
        (n,) = _HEADER.unpack(header)
        return pickle.loads(self._exactly(n)), list(fds)

    def _exactly(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self.sock.recv(min(n, 1 << 20))
            if not chunk:
                raise EOFError("the other process closed the socket inside a message")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class SaveProcess:
    """One rank's save process, seen from training (see the module).

    Built collectively (every rank, in the Checkpointer's constructor): rank 0 serves the save
    processes' store. :meth:`ship` hands a packed job over, from ``save()``; :meth:`run` is the
    save driver's ``run(job)``: it waits for the save process to commit the job.
    """

    def __init__(self, spec: Mapping[str, Any], arena: Arena, sharing: SharedLive, comm: Comm, single_node: bool,
                 timeout_s: float) -> None:
        self.rank, self.world = comm.rank, comm.world_size
        self._arena = arena
        self._sharing = sharing
        self._regions_mapped: set[Any] = set()  # the regions the save process maps
        self._timeout_s = timeout_s
        self._store = None
        group = None
        if self.world > 1:
            import torch.distributed as dist

            if self.rank == 0:  # served here: the save processes meet without waiting for one another's start
                self._store = dist.TCPStore("0.0.0.0" if not single_node else "127.0.0.1", 0, None, True,
                                            datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
                host = "127.0.0.1" if single_node else (os.environ.get("MASTER_ADDR") or socket.getfqdn())
                here = (host, self._store.port)
            else:
                here = None
            group = comm.all_gather(here, channel="control")[0]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {k: v for k, v in os.environ.items() if k != "FASTPERSIST_ENGINE"}  # it saves in threads itself
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fastpersist.save_process", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.channel = Channel(ours)
        self.channel.send(("init", dict(spec), self.rank, self.world, group))
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._ready: Future[None] = Future()
        self._waiting: dict[int, Future[dict[str, Any]]] = {}
        self._draining: dict[int, Future[bool]] = {}
        self._closed: Future[None] = Future()
        self._settling: dict[int, Future[None]] = {}
        self._staging: dict[int, Completion] = {}
        self._futures: dict[int, tuple[Future[dict[str, Any]], Future[bool]]] = {}  # by save, until run() takes them
        self._number = 0  # saves shipped
        self._token = 0
        self._mapped: Any = None  # the SharedMemory the save process maps now
        self._receiver = threading.Thread(target=self._receive, name="fastpersist-save-process", daemon=True)
        self._receiver.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def ship(self, job: SaveJob, message: bytes) -> None:
        """Hand the packed ``job`` (:meth:`fastpersist.saving.stage.Stager.pack`) to the save
        process, from ``save()``: once this returns the save process holds it whole, and
        commits it even if training ends at once."""
        if self.broken is not None:
            raise CheckpointWriteError(self.broken)
        arena = self._arena.memory
        if arena is not None and job.uses_arena and arena is not self._mapped:
            self._send(("map", "a", arena.size), (arena.fd,))  # the arena grew: map the new memory
            self._mapped = arena
        regions = {("r", r.number): r for r in self._sharing.regions}
        for name in self._regions_mapped - regions.keys():  # let go of (its tensors all replaced)
            self._send(("unmap", name))
        for name in regions.keys() - self._regions_mapped:  # tensors moved into shared memory since the last save
            self._send(("map", name, regions[name].size), (regions[name].memory.fd,))
        self._regions_mapped = set(regions)
        with self._lock:
            self._number += 1
            job.shipped = number = self._number
            done: Future[dict[str, Any]] = Future()
            drained: Future[bool] = Future()
            self._waiting[number], self._draining[number] = done, drained
            self._futures[number] = (done, drained)  # run()'s, whenever it comes (the replies may come first)
            self._staging[number] = job.completion
        self._send(("save", number, message))

    def run(self, job: SaveJob) -> None:
        """Wait for the save process to commit ``job`` (the save driver's worker); its metrics
        and drain are relayed to the job's handle, its failure raised."""
        number = job.shipped
        with self._lock:
            futures = self._futures.pop(number, None)
        if futures is None:
            raise CheckpointWriteError(f"internal: checkpoint step {job.step} was never shipped")
        done, drained = futures
        try:
            result = self._wait(done, f"checkpoint step {job.step}")
        finally:
            with self._lock:
                self._staging.pop(number, None)
                self._waiting.pop(number, None)
        for name, value in result["metrics"].items():
            setattr(job.metrics, name, value)
        if result["draining"]:
            drained.add_done_callback(_relay(job.completion.draining()))
        else:
            with self._lock:
                self._draining.pop(number, None)
        error = result["error"]
        if error is not None:
            raise error

    def _send(self, message: tuple[Any, ...], fds: tuple[int, ...] = ()) -> None:
        try:
            self.channel.send(message, fds)
        except OSError as e:  # its end is closed: it is gone
            self._ended()
            raise CheckpointWriteError(self.broken or f"the save process's channel failed: {e}") from e

    def _wait(self, future: Future[Any], what: str) -> Any:
        """``future``'s result; the save process's death (or its refusal) raised naming it."""
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if self.process.poll() is not None:  # dead, and the receiver has not noticed yet
                    self._ended()

    def _receive(self) -> None:
        try:
            while True:
                got = self.channel.recv()
                if got is None:
                    break
                message, _ = got
                self._dispatch(message)
        except Exception as e:  # noqa: BLE001 - the channel failed: reported as the process's end
            logger.debug("the save process's channel failed: %s", e)
        self._ended()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            self._ready.set_result(None)
        elif kind == "failed":  # could not start: the Checkpointer in the save process raised
            self._fail(_error(message[1], "the save process could not start")
                       or CheckpointWriteError("the save process could not start"))
        elif kind == "staged":  # the live tensors are written: a guarded optimizer step may go on
            with self._lock:
                completion = self._staging.pop(message[1], None)
            if completion is not None:
                completion.staged()
        elif kind == "done":
            _, number, metrics, draining, error = message
            with self._lock:
                future = self._waiting.pop(number, None)  # run() holds it too (its _futures entry)
            if future is not None:
                future.set_result({"metrics": metrics, "draining": draining, "error": _error(error, "the save")})
        elif kind == "drained":
            _, number, ok, error = message
            with self._lock:
                drained = self._draining.pop(number, None)
            if drained is not None:
                if error is not None:
                    drained.set_exception(_error(error, "the drain"))
                else:
                    drained.set_result(ok)
        elif kind == "settled":
            with self._lock:
                settled = self._settling.pop(message[1], None)
            if settled is not None:
                settled.set_result(None)
        elif kind == "closed":
            error = _error(message[1], "closing the save process")
            if error is not None:
                self._closed.set_exception(error)
            else:
                self._closed.set_result(None)

    def _ended(self) -> None:
        """The save process is gone (or its channel broke): fail whatever waits on it."""
        if self._closed.done():
            return
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        how = ("is not responding" if code is None else f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with status {code}")
        self._fail(CheckpointWriteError(
            f"the save process of rank {self.rank} (pid {self.process.pid}) {how}: the checkpoints it had not "
            "committed are lost (nothing partial is committed), and this Checkpointer saves no more; build a new "
            "one to start a new save process"))

    def _fail(self, error: CheckpointError) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = str(error)
            waiting: list[Future[Any]] = [*self._waiting.values(), *self._draining.values(),
                                          *self._settling.values()]
            self._waiting.clear()
            self._draining.clear()
            self._settling.clear()
        for future in [self._ready, self._closed, *waiting]:
            if not future.done():
                future.set_exception(error)

    def settle(self) -> None:
        """Wait until the deletions retention started in the save process are done."""
        if self.broken is not None or self.process.poll() is not None:
            return
        settled: Future[None] = Future()
        with self._lock:
            self._token += 1
            token = self._token
            self._settling[token] = settled
        self._send(("settle", token))
        self._wait(settled, "settling")

    def close(self) -> None:
        """Close the save process (after the saves it holds) and wait for it to exit; raises
        the first failure of its close (a drain that did not finish)."""
        try:
            if self.process.poll() is None and self.broken is None:
                try:
                    self.channel.send(("close",))
                except OSError:
                    pass
                else:
                    self._wait(self._closed, "close")
        finally:
            try:
                self.process.wait(timeout=self._timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("the save process (pid %d) did not exit after close: killed", self.process.pid)
                self.process.kill()
                self.process.wait()
            self.channel.close()
            self._receiver.join(timeout=10)
            self._store = None


def process_spec(**arguments: Any) -> dict[str, Any]:
    """The Checkpointer's arguments the save process builds its own from, checked to cross
    the process boundary (a durable store object must pickle)."""
    for name, value in arguments.items():
        if not crosses(value):
            raise ValueError(f"engine='process': the save process cannot be given {name}={value!r} (it does not "
                             "pickle); pass it by value (a durable tier by its location)")
    return arguments


def crosses(value: Any) -> bool:
    """Whether ``value`` can be handed to the save process (it pickles)."""
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - anything that does not pickle stays here
        return False
    return True


def _relay(future: Future[bool]) -> Any:
    def relay(drained: Future[bool]) -> None:
        if future.done():
            return
        error = drained.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(drained.result())
    return relay


def _error(sent: Any, what: str) -> CheckpointError | None:
    """An error the save process sent (pickled, or its type name and text where it would not pickle)."""
    if sent is None:
        return None
    if isinstance(sent, CheckpointError):
        return sent
    if isinstance(sent, BaseException):
        error = CheckpointWriteError(f"{what} failed in the save process: {type(sent).__name__}: {sent}")
        error.__cause__ = sent
        return error
    return CheckpointWriteError(f"{what} failed in the save process: {sent}")
