"""The Checkpointer: sharded, parallel checkpoints of a training job, loadable at any world size.

A facade over the parts that do the work, each in a module of its own:

* :mod:`fastpersist.stage`: what ``save()`` copies (the snapshot arena) and the overlap guard
  (protected optimizers' steps wait for the writes of their tensors);
* :mod:`fastpersist.driver`: the one queue and worker thread that run every save in ``save()``
  order, back-pressure (``max_in_flight``, ``when_busy``) and background failures;
* :mod:`fastpersist.protocol`: the save protocol's steps and messages, on every rank;
* :mod:`fastpersist.rank_writer`: what one rank writes (step 2);
* :mod:`fastpersist.coordinator`: rank 0's lock, clean start, commit and ``latest``;
* :mod:`fastpersist.retention`: which old checkpoints to delete, deleted in a thread of its own;
* :mod:`fastpersist.view`: reading (``load``, ``list``), without side effects.

In ``sync`` mode, or when the copies would exceed the arena's budget, ``save()`` queues the
job with the state left live and waits for its commit; otherwise it returns once the state is
staged. Either way one worker runs the protocol, so commit order equals ``save()`` order on
every rank and ``latest`` never moves back to an older commit than one already acknowledged.
"""

from __future__ import annotations

import atexit
import builtins
import functools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from fastpersist import dtensor
from fastpersist.config import IOConfig, get_config
from fastpersist.coordinator import Coordinator
from fastpersist.dist import Comm, LocalComm, default_comm, host_name, writer_ranks
from fastpersist.driver import SaveDriver
from fastpersist.durable.drain import Drainer
from fastpersist.durable.store import DirStore, Store, open_store
from fastpersist.durable.view import durable_view
from fastpersist.errors import CheckpointerClosedError, CheckpointWriteError
from fastpersist.handle import Completion, History, SaveHandle, SaveMetrics
from fastpersist.incremental import Incremental, block_size
from fastpersist.io.backend import FileBackend
from fastpersist.job import SaveJob
from fastpersist.objects.write import prepare_lanes
from fastpersist.nodes import Nodes, check_redundancy, node_id
from fastpersist.protocol import SaveProtocol
from fastpersist.publish import check_directory_save, publish_everywhere
from fastpersist.rank_writer import RankWriter
from fastpersist.roots import check_roots
from fastpersist.stage import OverlapGuard, Stager
from fastpersist.state import to_saveable
from fastpersist.timeline import Retention
from fastpersist.reading import ReadMethods, Reads
from fastpersist.view import CheckpointInfo, CheckpointView, Roots, list_checkpoints, load_checkpoint, root_list

logger = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "Checkpointer", "list_checkpoints", "load_checkpoint"]

MODES = ("sync", "snapshot", "overlap")


class Checkpointer(ReadMethods):
    """Save and load sharded checkpoints under one or more roots (one per SSD).

    Every rank of a job constructs the Checkpointer with the same arguments (it creates its
    own gloo groups when torch.distributed is initialised) and calls :meth:`save` with the
    same steps in the same order. Nothing is written until the first save.

    Args:
        roots: one directory or a list (ideally one per SSD), the same on every rank; distinct
            directories, none inside another. Each rank writes its share to its node's roots.
        mode: ``"snapshot"`` (default: save() copies the state into a bounded host arena and
            the write runs in the background), ``"overlap"`` (the FastPersist mode: tensors of
            protected optimizers are written from live memory while the next iteration runs,
            see :meth:`protect`; everything else is copied), or ``"sync"`` (save() returns
            when the checkpoint is committed).
        keep: keep the last ``keep`` checkpoints of the live timeline (None: all).
        keep_every: also keep every live step that is a multiple of this.
        abandoned: what retention does with checkpoints of an abandoned timeline (after a
            resume from an older step): ``"keep"`` (default) or ``"delete"``.
        max_in_flight: checkpoints pending at once; beyond that save() waits or skips.
        when_busy: ``"wait"`` (default) or ``"skip"`` (the checkpoint is not taken; every
            rank decides alike).
        snapshot_bytes: the arena's budget; a state whose copies would not fit is written
            from live memory, save() waiting for its commit, instead of growing memory.
        writers: who writes replicated state: ``"all"`` ranks (default), ``"node"``, ``N``
            per node, or a list of ranks.
        check_replicated: before committing, check that ``state`` holds the same bytes on
            every rank (default True; costs one hash of the state per rank, overlapped with
            the writes). Turn off only for jobs that guarantee replication.
        comm: the coordination seam (default: a private gloo group, or none at world size 1);
            ``"local"``: this process alone, even in a distributed job (what a framework that
            saves on one rank only needs).
        backend: the file seam (default: real files); see :mod:`fastpersist.faults`.
        config: I/O settings (default: the process-wide configuration).
        timeout_s: how long a rank waits for the others in a collective.
        clean_start: remove incomplete checkpoints left by a crashed run at the first save.
        history: how many recent saves' metrics :attr:`history` keeps.
        durable: a directory (shared filesystem) or ``s3://bucket/prefix`` URL (credentials
            from the environment) that committed checkpoints are drained to in the background
            (:mod:`fastpersist.durable`); :meth:`load` falls back to it for steps the local
            roots lack; :meth:`close` finishes the drains in flight.
        node, redundancy: this process's node id (default ``$FASTPERSIST_NODE``, else the
            host name: a node's ranks share its local roots, a rank opens only its own node's),
            and on how many nodes every byte lies (default 2 on several nodes, 1 on one; more
            than the nodes is refused). On several nodes loads are collective (restored from
            whichever nodes hold the bytes, :mod:`fastpersist.peers`).
        durable_every: drain the first checkpoint, then the first one at least this many
            steps after the last drained (default 1). ``durable_keep``: the durable tier's
            retention (None: keep all; its latest is never deleted). ``durable_bandwidth``:
            bytes/s one rank's drain may move (None: unbounded).
        incremental: do not write again the replicated bytes that are unchanged since the last
            checkpoint this Checkpointer committed (units of 4 MiB, or of the size given in bytes,
            compared by sample, then by xxh3-128); the new checkpoint names the last one's files
            holding them (hard links),
            so deleting any checkpoint never loses another's bytes (:mod:`fastpersist.incremental`).
            One node (or one shared filesystem) only.

    Raises:
        ValueError, TypeError: an argument is wrong (named in the message).
        CheckpointWriteError: a root is a file, not writable or cannot be created.

    Example::

        ckpt = fastpersist.Checkpointer(["/nvme0/run1", "/nvme1/run1"], keep=3)
        for step in range(steps):
            train_one_step()
            ckpt.save(step, {"model": model, "optim": optimizer, "step": step})
        ckpt.close()
    """

    def __init__(
        self,
        roots: Roots,
        *,
        mode: str = "snapshot",
        keep: int | None = None,
        keep_every: int | None = None,
        abandoned: str = "keep",
        max_in_flight: int = 1,
        when_busy: str = "wait",
        snapshot_bytes: int = 2 << 30,
        writers: str | int | Sequence[int] = "all",
        check_replicated: bool = True,
        comm: Comm | str | None = None,
        backend: FileBackend | None = None,
        config: IOConfig | None = None,
        timeout_s: float = 600.0,
        clean_start: bool = True,
        history: int = 1000,
        durable: str | os.PathLike[str] | Store | None = None,
        durable_every: int = 1,
        durable_keep: int | None = None,
        durable_bandwidth: float | None = None,
        node: str | None = None,
        redundancy: int | None = None,
        incremental: bool | int = False,
    ) -> None:
        _check_arguments(mode, max_in_flight, snapshot_bytes, history, timeout_s)
        block = block_size(incremental)
        retention = Retention(keep, keep_every, abandoned)
        paths = root_list(roots)
        self.comm = _comm(comm, timeout_s)
        # A comm of our own is closed (its process groups destroyed) by close(), when the
        # Checkpointer is collected, or at exit: never left to the interpreter's teardown.
        close_comm = getattr(self.comm, "close", None) if comm is None else None
        self._close_comm = weakref.finalize(self, close_comm) if close_comm is not None else None
        self.roots, hosts, self.nodes, store = _roots_everywhere(self.comm, paths, durable, node, redundancy)
        self.writer_ranks = writer_ranks(writers, hosts if self.nodes.count == 1 else self.nodes.per_rank())
        self.redundancy = check_redundancy(redundancy, self.nodes, self.writer_ranks)
        if block is not None and self.nodes.count > 1:
            raise ValueError("incremental=True needs every root on one node (or one shared filesystem): a checkpoint "
                             f"reuses the last one's files by hard links, and this job spans {self.nodes.count} nodes")
        self.mode = mode
        self.backend = backend or FileBackend()
        self._config = config
        self._view = CheckpointView(self.roots, config=config, backend=self.backend)
        self.history = History(history)  # metrics of recent saves, and totals
        self.check_replicated = bool(check_replicated)
        self._closed = False
        self._driver = SaveDriver(self._run, self._finished, self.comm, max_in_flight, when_busy,
                                  (config or get_config()).switch_interval_us)
        self._stager = Stager(snapshot_bytes, self.comm.rank)
        self._guard = OverlapGuard(self._driver.in_flight, self._driver.raise_failed)
        self._drainer = _drainer(store, self.roots, self.comm.rank, durable_every, durable_keep, abandoned,
                                 durable_bandwidth, timeout_s, self.config.drain_nice)
        self._coordinator = Coordinator(self.roots, self.backend, retention, self.comm.world_size, clean_start,
                                        self._drainer.known_commits if self._drainer is not None else None,
                                        self.nodes, self.comm.rank)
        self._protocol = SaveProtocol(
            self.comm, RankWriter(self.comm.rank, self.roots, self.backend, lambda: self.config,
                                  self.check_replicated and self.comm.world_size > 1, self.nodes, self.redundancy,
                                  getattr(self.comm, "exchange", None)),
            self._coordinator, self.writer_ranks, len(self.roots), self.check_replicated,
            lambda: {j.step for j in self._driver.in_flight()}, self._drainer, self.nodes, self.redundancy,
            Incremental(self.comm.rank, self.comm.world_size, block) if block is not None else None)
        self._reads = Reads(self._view, durable_view(store, config, self.roots[0]) if store is not None else None,
                            self.comm, self.nodes, lambda: self.config)
        _at_exit(_finish_at_exit, weakref.ref(self))

    @property
    def config(self) -> IOConfig:
        return self._config or get_config()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def max_in_flight(self) -> int:
        return self._driver.max_in_flight

    @property
    def when_busy(self) -> str:
        return self._driver.when_busy

    @property
    def retention(self) -> Retention:
        return self._coordinator.retention

    @property
    def in_flight(self) -> builtins.list[SaveHandle]:
        """The handles of the checkpoints saved and not yet committed (or failed), oldest first."""
        return [job.handle for job in self._driver.in_flight()]

    @property
    def snapshot_memory(self) -> int:
        """Host bytes the snapshot arena holds now (never more than ``snapshot_bytes``)."""
        return self._stager.arena.allocated

    def reserve(self, state: Any = None, *, rank_state: Any = None, nbytes: int | None = None) -> Future[int]:
        """Make the memory of the coming saves ready now, on a thread of this rank, so the first
        save does not pay the first touch of fresh memory (docs/DESIGN.md, "The first save and
        `reserve()`"). Call it once the state has its full size (after the first optimizer
        step). A save that comes before the reservation is done waits for the rest of it.

        Args:
            state, rank_state: what the coming saves will pass to :meth:`save`, sized here (on
                the calling thread) as :meth:`save` would copy it; or ``nbytes`` instead.

        Returns:
            A future of the bytes of snapshot memory ready (0 in ``sync`` mode or over
            ``snapshot_bytes``); the staging buffers are made ready in every mode.

        Raises:
            TypeError, ValueError: both or neither of ``state`` and ``nbytes``, or a wrong ``nbytes``.
            CheckpointerClosedError: after :meth:`close`.
        """
        if self._closed:
            raise CheckpointerClosedError("reserve() after close(): this Checkpointer takes no more saves")
        if (state is None) == (nbytes is None):
            raise TypeError("reserve() takes the state the coming saves will pass, or nbytes, not both")
        if nbytes is not None:
            _positive_int("nbytes", nbytes, minimum=0)
        if self.mode == "sync":  # sync saves copy nothing
            nbytes = 0
        elif nbytes is None:
            saveable, own, shards = _saveable(state, rank_state)
            live = self._guard.storages() if self.mode == "overlap" else set()
            nbytes = self._stager.need(saveable, own, [sh.tensor for sh in shards], live)
        # the staging buffers of one file per root written at once
        return self._stager.reserve(nbytes, functools.partial(prepare_lanes, self.config, len(self.roots)))

    def protect(self, optimizer: torch.optim.Optimizer) -> None:
        """Write ``optimizer``'s parameters and state from live memory (overlap mode).

        ``optimizer.step()`` then waits, through a step pre-hook, until every in-flight
        checkpoint has written them; nothing else about training waits. Parameters must change
        only inside this optimizer's step.
        """
        self._guard.protect(optimizer)

    def save(self, step: int, state: Any, *, rank_state: Any = None,
             metadata: Mapping[str, Any] | None = None,
             directory: str | os.PathLike[str] | None = None) -> SaveHandle:
        """Checkpoint ``state`` as step ``step`` (call on every rank); returns a handle.

        Args:
            step: a non-negative integer. A step not greater than the live timeline's last
                one starts a new timeline (see :mod:`fastpersist.timeline`); an existing
                checkpoint of the same step is replaced.
            state: what to save, the same on every rank (replicated: model weights, the
                optimizer state of a data-parallel job, the step); it is written once, split
                over all writers. Stateful objects are saved through ``state_dict()``.
            rank_state: what differs per rank (its optimizer shard, its RNG state), written
                by that rank alone.
            metadata: a JSON object stored in the manifest (see :meth:`metadata`).
            directory: once committed, move the checkpoint into this directory, atomically
                replacing what it held, before the handle completes (see :mod:`fastpersist.publish`).

        Returns:
            A :class:`SaveHandle`: a future of the commit; ``handle.staged`` is the moment
            training may modify the saved tensors. What is saved is the state at this call,
            bit for bit, whatever training does next.

        Raises:
            TypeError, ValueError: ``step`` or ``metadata`` is wrong.
            CheckpointError: an earlier checkpoint failed in the background (raised once),
                or, when save() waits for the commit (sync mode, over the snapshot budget),
                this one failed.
            CheckpointerClosedError: after :meth:`close`.
        """
        t0 = time.perf_counter()
        if self._closed:
            raise CheckpointerClosedError(f"save(step={step!r}) after close(): this Checkpointer takes no more saves")
        if self._protocol.broken is not None:
            raise CheckpointWriteError(self._protocol.broken)
        check_step(step)
        meta = _check_metadata(metadata)
        target = None if directory is None else check_directory_save(
            directory, len(self.roots), self.nodes.count, self._drainer is not None)
        completion = Completion(SaveHandle(SaveMetrics(step, self.mode)))
        if not self._driver.make_room(completion):
            self.history.append(completion.handle.metrics)
            self._driver.raise_failed()
            return completion.handle
        job = _new_job(step, state, rank_state, meta, completion, t0)
        job.directory = target
        live = self._guard.storages() if self.mode == "overlap" else set()
        job.inline = self.mode == "sync" or not self._stager.stage(job, live, self.config.snapshot_pipeline)
        # Queued on every rank alike (what a rank raises below differs with timing, so it must
        # come after the job is queued: otherwise the ranks' queues would fall out of step).
        try:
            self._driver.submit(job)
            self._stager.copy(job)  # the snapshot's copies, while its writes start (fastpersist.io.fills)
        except BaseException as e:
            if job.fill is not None:  # interrupted or failed before every byte was copied: the
                job.fill.fail(e)  # writer must not wait for them, it fails the job instead
            completion.mark_reported()  # raised here; not raised again by a later call
            raise
        finally:
            if not job.inline and not job.live:
                completion.staged()
        handle = completion.handle
        if not job.inline:
            handle.metrics.save_call_s = time.perf_counter() - t0
            self._driver.raise_failed(besides=completion)  # its writes began during its copies
            return handle
        handle.metrics.inline = True
        try:
            handle.result()  # every earlier save first, then this one: one driver, one order
        finally:
            handle.metrics.save_call_s = time.perf_counter() - t0
            if handle.exception() is None:
                self._log(handle.metrics)
        self._driver.raise_failed()
        return handle

    def _run(self, job: SaveJob) -> None:
        """The save protocol for one job (in the driver's worker)."""
        self._protocol.run(job)
        if job.directory is not None:
            publish_everywhere(self.comm, job.step, self.roots[0], job.directory, self.backend, self._coordinator)
        job.metrics.total_s = time.perf_counter() - job.started

    def _finished(self, job: SaveJob, error: BaseException | None) -> None:
        self._stager.release(job)
        if error is None and not job.inline:
            self._log(job.metrics)  # an inline job is logged by save(), which timed it

    def _log(self, m: SaveMetrics) -> None:
        self.history.append(m)
        logger.info("%s", m.summary())

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every checkpoint in flight (and the deletions retention started); raises
        the first failure not yet raised."""
        self._driver.wait(timeout)
        self._coordinator.janitor.drain()
        self._driver.raise_failed()

    def close(self) -> None:
        """Wait for checkpoints in flight, stop the background threads, remove the guards and
        release the roots. Raises the first failure not yet raised. Idempotent."""
        self._closed = True
        try:
            self.wait()
        finally:
            self._driver.stop()
            self._stager.arena.join()
            self._guard.remove()
            _close_all(self._drainer.close if self._drainer is not None else None, self._coordinator.close,
                       self._close_comm)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every checkpoint in the first root (on several nodes: this node's), committed or
        not, by step (after the deletions retention has started)."""
        self._coordinator.janitor.drain()
        return self._view.list()


def _new_job(step: int, state: Any, rank_state: Any, meta: Mapping[str, Any] | None, completion: Completion,
             t0: float) -> SaveJob:
    """A save's job: the state made saveable, its DTensors taken out (their shards)."""
    saveable, own, shards = _saveable(state, rank_state)
    return SaveJob(step, saveable, own, meta, completion, t0, shards)


def _saveable(state: Any, rank_state: Any) -> tuple[Any, Any, list[dtensor.LocalShard]]:
    """(state, rank_state) made saveable, and the state's DTensors' local shards."""
    saveable = to_saveable(state)
    own = to_saveable(rank_state) if rank_state is not None else None
    shards: list[dtensor.LocalShard] = []
    if dtensor.dtensor_type() is not None:  # no DTensor exists before its module is loaded
        saveable, shards = dtensor.split(saveable)  # the state itself where it holds none
    if own is not None and dtensor.holds_dtensors(own):
        raise ValueError("rank_state holds DTensors: pass sharded state (DTensors) in `state`; fastpersist "
                         "writes each rank's shards and reshards them at load")
    return saveable, own, shards


@dataclass(frozen=True)
class _RootsReport:
    """What one rank tells the others about its roots at construction (one all-gather)."""

    host: str
    ok: bool  # its roots, node id and durable location were usable
    durable: str | None  # the durable location's URL
    node: str
    roots: list[str]
    redundancy: int | None


def _roots_everywhere(comm: Comm, paths: list[str], durable: str | os.PathLike[str] | Store | None,
                      node: str | None = None, redundancy: int | None = None
                      ) -> tuple[list[str], list[str], Nodes, Store | None]:
    """Check the roots, the node id and the durable location on every rank; if any rank finds
    them unusable, or the ranks were given different durable locations, or ranks of one node
    different roots, every rank raises (nobody is left waiting in a collective the others
    skipped). Returns the checked roots, every rank's host name, the job's nodes and the
    durable tier's store."""
    error: Exception | None = None
    roots, store, me = paths, None, ""
    host = host_name()
    try:
        me = node_id(node, host)
        roots = check_roots(paths)
        store = open_store(durable) if durable is not None else None
        if isinstance(store, DirStore) and any(os.path.realpath(store.url) == os.path.realpath(r) for r in roots):
            raise ValueError(f"durable: {store.url} is one of the local roots; the durable tier must be elsewhere")
    except (ValueError, TypeError, ImportError, CheckpointWriteError) as e:
        error = e
    outcomes: list[_RootsReport] = comm.all_gather(_RootsReport(
        host, error is None, store.url if store is not None else None, me, roots, redundancy))
    if error is not None:
        raise error
    bad = [r for r, o in enumerate(outcomes) if not o.ok]
    if bad:
        raise CheckpointWriteError(f"the checkpoint roots {paths}, the node id or the durable location cannot be used "
                                   f"on rank(s) {bad}; see the error raised there")
    urls = sorted({o.durable for o in outcomes if o.durable is not None})
    if len(urls) > 1 or (urls and any(o.durable is None for o in outcomes)):
        raise ValueError(f"durable: the ranks were given different durable locations ({urls}, or none on some); "
                         "every rank must pass the same one")
    if len({o.redundancy for o in outcomes}) > 1:
        raise ValueError(f"redundancy: the ranks were given different values ({[o.redundancy for o in outcomes]} by "
                         "rank); every rank must pass the same one")
    nodes = Nodes.from_ids([o.node for o in outcomes])
    for r, o in enumerate(outcomes):
        lead = nodes.leader(nodes.of_rank[r])
        if len(o.roots) != len(roots) or o.roots != outcomes[lead].roots:
            raise ValueError(f"roots: rank {r} (node {o.node!r}) was given roots {o.roots}, rank {lead} of the same "
                             f"node {outcomes[lead].roots}, rank {comm.rank} {roots}: every rank gives as many roots, "
                             "and the ranks of one node the same ones")
    if nodes.count > 1 and not all(callable(getattr(comm, m, None)) for m in ("broadcast", "exchange")):
        raise TypeError(f"comm: a job on several nodes ({', '.join(nodes.ids)}) needs a comm with broadcast() and "
                        f"exchange() (as fastpersist.dist.GlooComm has), got a {type(comm).__name__}")
    return roots, [o.host for o in outcomes], nodes, store


def _comm(comm: Comm | str | None, timeout_s: float) -> Comm:
    if comm is None:
        return default_comm(timeout_s)
    if isinstance(comm, str):
        if comm != "local":
            raise ValueError(f"comm must be a Comm, None or \"local\", got {comm!r}")
        return LocalComm()
    return comm


def _close_all(*closers: Callable[[], object] | None) -> None:
    """Call each closer in order, every one even if an earlier one raised (the first error is
    raised at the end)."""
    if not closers:
        return
    first, rest = closers[0], closers[1:]
    try:
        if first is not None:
            first()
    finally:
        _close_all(*rest)


def _check_arguments(mode: str, max_in_flight: int, snapshot_bytes: int, history: int, timeout_s: float) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _positive_int("max_in_flight", max_in_flight)
    _positive_int("snapshot_bytes", snapshot_bytes, minimum=0)
    _positive_int("history", history)
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def _drainer(store: Store | None, roots: list[str], rank: int, every: int, keep: int | None,
             abandoned: str, bandwidth: float | None, timeout_s: float, nice: int) -> Drainer | None:
    """The durable tier's drain on this rank (None without a durable tier); arguments checked."""
    _positive_int("durable_every", every)
    if keep is not None:
        _positive_int("durable_keep", keep)
    if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float))
                                  or bandwidth <= 0):
        raise ValueError(f"durable_bandwidth must be a positive number of bytes per second, got {bandwidth!r}")
    if store is None:
        return None
    drainer = Drainer(store, roots, rank, every=every, keep=keep, abandoned=abandoned, bandwidth=bandwidth,
                      timeout_s=timeout_s, nice=nice)
    if rank == 0:
        drainer.read_ahead()
    return drainer


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def check_step(step: object) -> None:
    """Refuse a step that is not a non-negative integer (by name, before anything is written)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A JSON-safe copy of ``metadata``, checked before any byte is written."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    bad_keys = [k for k in metadata if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"metadata keys must be strings, got {bad_keys[0]!r}")
    try:
        text = json.dumps(dict(metadata), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        bad = next((k for k, v in metadata.items() if not _json_ok(v)), None)
        where = f" (key {bad!r})" if bad is not None else ""
        raise TypeError(f"metadata must hold JSON values (str keys; str, int, finite float, bool, None, lists, "
                        f"dicts){where}: {e}") from e
    return dict(json.loads(text))


def _json_ok(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False)  # refuses NaN and infinities too
    except (TypeError, ValueError):
        return False
    return True


def _at_exit(fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` when the interpreter exits, before concurrent.futures stops taking
    work (a save in flight needs its thread pools): threading's exit hooks run in reverse
    order of registration, before atexit's, and concurrent.futures registered its own there
    when it was imported, before any Checkpointer existed."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every supported Python has it
        atexit.register(fn, *args)
        return
    register(fn, *args)


def _finish_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    """At interpreter exit, close a Checkpointer the job did not close: finish the checkpoints
    still in flight (the worker is a daemon thread: without this, a job that ends without
    close() would lose its last checkpoint), then destroy its process groups while the
    interpreter is still whole (see :class:`fastpersist.dist.GlooComm`)."""
    ck = ref()
    if ck is None or ck._closed:
        return
    try:
        ck.close()
    except Exception as e:  # noqa: BLE001 - exiting anyway; nobody else will see it: say what was lost
        logger.error("a checkpoint in flight at exit failed: %s", e)
