"""The Checkpointer: sharded, parallel checkpoints of a training job, loadable at any world size.

A facade over the parts that do the work (docs/DESIGN.md, "Layers"):

* :mod:`fastpersist.saving.stage`: what ``save()`` copies (the snapshot arena, the capture) and
  :mod:`fastpersist.saving.guard`: protected optimizers' steps wait for their tensors' writes;
* :mod:`fastpersist.saving.driver`: the one queue and worker thread that run every save in
  ``save()`` order, back-pressure (``max_in_flight``, ``when_busy``) and background failures;
* :mod:`fastpersist.saving.protocol`: the save protocol's phases, on every rank, with the
  extensions built from the options (incremental reuse, the replica check, copies on other
  nodes, the durable drain, publishing into a named directory);
* :mod:`fastpersist.tiers.resolve`: reading (``load``, ``latest_step``) through the tiers.

In ``sync`` mode, or when the copies would exceed the arena's budget, ``save()`` queues the
job with the state left live and waits for its commit; otherwise it returns once the state is
staged. Either way one worker runs the protocol, so commit order equals ``save()`` order on
every rank and ``latest`` never moves back to an older commit than one already acknowledged.
"""

from __future__ import annotations

import atexit
import builtins
import sys
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fastpersist.config import IOConfig, get_config
from fastpersist.dist import Comm, LocalComm, default_comm, host_name
from fastpersist.errors import CheckpointerClosedError, CheckpointWriteError
from fastpersist.loading.view import CheckpointInfo, CheckpointView, Roots, list_checkpoints, load_checkpoint, root_list
from fastpersist.options import Durable, Nodes, Options, Retention, Shorthands, from_shorthands
from fastpersist.saving.arguments import check_arguments, check_metadata, check_step, choose_engine, positive_int
from fastpersist.saving.coordinator import Coordinator
from fastpersist.saving.extension import Extension
from fastpersist.saving.extensions.incremental import IncrementalSaves, block_size
from fastpersist.saving.extensions.publish import Publish
from fastpersist.saving.extensions.replicas import ReplicaCheck
from fastpersist.saving.handle import SaveHandle
from fastpersist.saving.job import SaveJob
from fastpersist.saving.protocol import SaveProtocol, close_all
from fastpersist.saving.rank_writer import RankWriter
from fastpersist.saving.remote import SaveProcess, crosses, process_spec
from fastpersist.saving.saver import Saver
from fastpersist.storage.backend import FileBackend
from fastpersist.storage.roots import check_roots
from fastpersist.tiers.durable.extension import DurableDrain
from fastpersist.tiers.durable.store import DirStore, Store, open_store
from fastpersist.tiers.durable.view import durable_view
from fastpersist.tiers.nodes.extension import NodeCopies
from fastpersist.tiers.resolve import ReadMethods, Tiers
from fastpersist.topology import NodeMap, Placement, check_redundancy, node_id, writer_ranks

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack of **kwargs is Python 3.12's

logger = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_BYTES = 2 << 30

__all__ = ["CheckpointInfo", "Checkpointer", "list_checkpoints", "load_checkpoint"]


class Checkpointer(ReadMethods):
    """Save and load sharded checkpoints under one or more roots (one per SSD).

    Every rank of a job constructs the Checkpointer with the same arguments (it creates its
    own gloo groups when torch.distributed is initialised) and calls :meth:`save` with the
    same steps in the same order. Nothing is written until the first save.

    Args:
        roots: one directory or a list (ideally one per SSD): distinct directories, none inside
            another; the ranks of one node give the same ones (on several nodes, each node its own).
        mode: ``"snapshot"`` (default: save() copies the state into a bounded host arena and
            the write runs in the background), ``"overlap"`` (the FastPersist mode: tensors of
            protected optimizers are written from live memory while the next iteration runs,
            see :meth:`protect`; everything else is copied), or ``"sync"`` (save() returns
            when the checkpoint is committed).
        retention: which checkpoints to keep (:class:`fastpersist.Retention`; default: all).
        durable: a durable tier committed checkpoints are drained to in the background
            (:class:`fastpersist.Durable`, or its location alone: a directory or an
            ``s3://bucket/prefix`` URL); :meth:`load` falls back to it for steps the local roots
            lack; :meth:`close` finishes the drains in flight.
        nodes: this process's node id and how many nodes hold each byte
            (:class:`fastpersist.Nodes`; on several nodes loads are collective, restored from
            whichever nodes hold the bytes).
        incremental: do not write again the replicated bytes unchanged since the last
            checkpoint this Checkpointer committed (True: units of 4 MiB, or a unit size in
            bytes); the new checkpoint names the last one's files holding them (hard links),
            so deleting any checkpoint never loses another's bytes. One node only.
        max_in_flight: checkpoints pending at once; beyond that save() waits or skips.
        when_busy: ``"wait"`` (default) or ``"skip"`` (the checkpoint is not taken; every
            rank decides alike).
        snapshot_bytes: the arena's budget (default 2 GiB; with ``engine="process"``, none); a
            state whose copies would not fit is written from live memory, save() waiting for its
            commit, instead of growing memory (the process engine refuses it: its save process
            reads only shared memory).
        writers: who writes replicated state: ``"all"`` ranks (default), ``"node"``, ``N``
            per node, or a list of ranks.
        check_replicated: before committing, check that ``state`` holds the same bytes on
            every rank (default True; one hash of the state per rank, beside the writes).
        comm: the coordination seam (default: a private gloo group, or none at world size 1);
            ``"local"``: this process alone, even in a distributed job.
        backend: the file seam (default: real files); see :mod:`fastpersist.faults`.
        config: I/O settings (default: the process-wide configuration).
        timeout_s: how long a rank waits for the others in a collective.
        clean_start: remove incomplete checkpoints left by a crashed run at the first save.
        history: how many recent saves' metrics :attr:`history` keeps.
        engine: ``"thread"`` (threads of this process) or ``"process"`` (a save process per
            rank does everything but the capture; docs/DESIGN.md, "The save process"); default:
            ``FASTPERSIST_ENGINE``, else ``"thread"``.
        **shorthands: the options' fields by their keyword names: ``keep``, ``keep_every``,
            ``abandoned`` (retention), ``durable_every``, ``durable_keep``,
            ``durable_bandwidth`` (durable), ``node``, ``redundancy`` (nodes).

    Raises:
        ValueError, TypeError: an argument is wrong (named in the message).
        CheckpointWriteError: a root is a file, not writable or cannot be created.

    Example::

        ckpt = fastpersist.Checkpointer(["/nvme0/run1", "/nvme1/run1"], retention=fastpersist.Retention(keep=3))
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
        retention: Retention | None = None,
        durable: str | os.PathLike[str] | Store | Durable | None = None,
        nodes: Nodes | None = None,
        incremental: bool | int = False,
        max_in_flight: int = 1,
        when_busy: str = "wait",
        snapshot_bytes: int | None = None,
        writers: str | int | Sequence[int] = "all",
        check_replicated: bool = True,
        comm: Comm | str | None = None,
        backend: FileBackend | None = None,
        config: IOConfig | None = None,
        timeout_s: float = 600.0,
        clean_start: bool = True,
        history: int = 1000,
        engine: str | None = None,
        **shorthands: Unpack[Shorthands],
    ) -> None:
        options = from_shorthands(retention, durable, nodes, dict(shorthands))
        engine, snapshot_bytes = _engine_and_budget(engine, backend, options, snapshot_bytes)
        check_arguments(mode, max_in_flight, snapshot_bytes, history, timeout_s)
        block = block_size(incremental)
        paths = root_list(roots)
        self.comm = _comm(comm, timeout_s)
        # A comm of our own is closed (its process groups destroyed) by close(), when the
        # Checkpointer is collected, or at exit: never left to the interpreter's teardown.
        close_comm = getattr(self.comm, "close", None) if comm is None else None
        self._close_comm = weakref.finalize(self, close_comm) if close_comm is not None else None
        self.backend = backend or FileBackend()
        self.roots, hosts, self.nodes, store = _roots_everywhere(self.comm, paths, options, self.backend, engine)
        self.writer_ranks = writer_ranks(writers, hosts if self.nodes.count == 1 else self.nodes.per_rank())
        self.redundancy = check_redundancy(options.nodes.redundancy, self.nodes, self.writer_ranks)
        if block is not None and self.nodes.count > 1:
            raise ValueError("incremental=True needs every root on one node (or one shared filesystem): a checkpoint "
                             f"reuses the last one's files by hard links, and this job spans {self.nodes.count} nodes")
        self.mode = mode
        self._config = config
        self.options = options
        self.check_replicated = bool(check_replicated)
        self._closed = False
        self.engine = engine
        self._saver = Saver(self._run, self.comm, mode=mode, max_in_flight=max_in_flight, when_busy=when_busy,
                            snapshot_bytes=snapshot_bytes, history=history, config=self._current_config,
                            roots=len(self.roots), shipped=engine == "process")
        self.history = self._saver.history  # metrics of recent saves, and totals
        self._publish = Publish(len(self.roots), self.nodes.count, store is not None)
        self._protocol: SaveProtocol | None = None
        self._remote: SaveProcess | None = None
        if engine == "process":  # the save process builds the protocol from the same arguments
            spec = process_spec(roots=paths, retention=options.retention, durable=options.durable, nodes=options.nodes,
                                incremental=incremental, writers=writers, check_replicated=check_replicated,
                                config=config, timeout_s=timeout_s, clean_start=clean_start, history=history)
            self._remote = SaveProcess(spec, self._saver.stager.arena, self._saver.sharing, self.comm,
                                       self.nodes.count == 1, timeout_s)
            self._saver.ship = self._remote.ship
        else:
            self._protocol = self._save_protocol(clean_start, self._extensions(block, store, timeout_s))
        self._engine: SaveProtocol | SaveProcess = self._remote or self._protocol  # type: ignore[assignment]
        self._view = CheckpointView(self.roots, config=config, backend=self.backend)
        durable_reads = durable_view(store, config, self.roots[0], self.backend) if store is not None else None
        self._tiers = Tiers(self._view, durable_reads, self.comm, self.nodes, self._current_config)
        _at_exit(_finish_at_exit, weakref.ref(self))

    def _extensions(self, block: int | None, store: Store | None, timeout_s: float) -> list[Extension]:
        """What varies in a save, built from the options; their hooks run in this order. A new
        tier or feature is an extension: one line here."""
        rank, world = self.comm.rank, self.comm.world_size
        chosen: list[Extension | None] = [
            IncrementalSaves(rank, world, block) if block is not None else None,
            ReplicaCheck() if self.check_replicated and world > 1 else None,
            NodeCopies(self.nodes, rank, self.roots, self.backend, self.redundancy, getattr(self.comm, "exchange", None))
            if self.nodes.count > 1 else None,
            DurableDrain(store, self.roots, rank, self.options.durable, self.options.retention.abandoned, timeout_s,
                         self.config.drain_nice, self.backend)
            if store is not None and self.options.durable is not None else None,
            self._publish,
        ]
        return [ext for ext in chosen if ext is not None]

    def _save_protocol(self, clean_start: bool, extensions: list[Extension]) -> SaveProtocol:
        rank, nodes = self.comm.rank, self.nodes
        leads = nodes.count > 1 and nodes.is_leader(rank)
        coordinator = Coordinator(self.roots, self.backend, self.options.retention, self.comm.world_size,
                                  clean_start, nodes, rank)
        writer = RankWriter(rank, self.roots, self.backend, self._current_config,
                            nodes.of_rank[rank] if leads else None)
        placement = Placement.of(self.writer_ranks, len(self.roots), nodes, self.redundancy)
        return SaveProtocol(self.comm, writer, coordinator, placement, nodes=nodes, extensions=extensions,
                            in_flight=self._saver.driver.steps)

    def _current_config(self) -> IOConfig:
        return self.config

    @property
    def config(self) -> IOConfig:
        return self._config or get_config()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def max_in_flight(self) -> int:
        return self._saver.driver.max_in_flight

    @property
    def when_busy(self) -> str:
        return self._saver.driver.when_busy

    @property
    def retention(self) -> Retention:
        return self.options.retention

    @property
    def in_flight(self) -> builtins.list[SaveHandle]:
        """The handles of the checkpoints saved and not yet committed (or failed), oldest first."""
        return [job.handle for job in self._saver.driver.in_flight()]

    @property
    def snapshot_memory(self) -> int:
        """Host bytes the snapshot arena holds now (never more than ``snapshot_bytes``)."""
        return self._saver.stager.arena.allocated

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
            positive_int("nbytes", nbytes, minimum=0)
        return self._saver.reserve(state, rank_state, nbytes)

    def protect(self, optimizer: torch.optim.Optimizer) -> None:
        """Write ``optimizer``'s parameters and state from live memory (overlap mode).

        ``optimizer.step()`` then waits, through a step pre-hook, until every in-flight
        checkpoint has written them; nothing else about training waits. Parameters must change
        only inside this optimizer's step.
        """
        self._saver.guard.protect(optimizer)

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
                replacing what it held, before the handle completes (see :mod:`fastpersist.saving.extensions.publish`).

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
        if self._engine.broken is not None:
            raise CheckpointWriteError(self._engine.broken)
        check_step(step)
        meta = check_metadata(metadata)
        target = None if directory is None else self._publish.target(directory)
        return self._saver.save(step, state, rank_state, meta, target, t0)

    def _run(self, job: SaveJob) -> None:  # in the driver's worker: the protocol, or the save process
        self._engine.run(job)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every checkpoint in flight (and the deletions retention started); raises
        the first failure not yet raised."""
        self._saver.wait(timeout)
        self._engine.settle()
        self._saver.driver.raise_failed()

    def close(self) -> None:
        """Wait for checkpoints in flight, stop the background threads, remove the guards and
        release the roots. Raises the first failure not yet raised. Idempotent."""
        self._closed = True
        try:
            self.wait()
        finally:
            close_all(self._saver.close, self._engine.close, self._close_comm)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every checkpoint in the first root (on several nodes: this node's), committed or
        not, by step (after the deletions retention has started)."""
        self._engine.settle()
        return self._view.list()


@dataclass(frozen=True)
class _RootsReport:
    """What one rank tells the others about its roots at construction (one all-gather)."""

    host: str
    ok: bool  # its roots, node id and durable location were usable
    durable: str | None  # the durable location's URL
    node: str
    roots: list[str]
    redundancy: int | None
    engine: str


def _roots_everywhere(comm: Comm, paths: list[str], options: Options, backend: FileBackend, engine: str = "thread"
                      ) -> tuple[list[str], list[str], NodeMap, Store | None]:
    """Check the roots, the node id and the durable location on every rank; if any rank finds
    them unusable, or the ranks were given different durable locations, or ranks of one node
    different roots, every rank raises (nobody is left waiting in a collective the others
    skipped). Returns the checked roots, every rank's host name, the job's nodes and the
    durable tier's store."""
    error: Exception | None = None
    roots, store, me = paths, None, ""
    host = host_name()
    redundancy = options.nodes.redundancy
    try:
        me = node_id(options.nodes.node, host)
        roots = check_roots(paths)
        store = open_store(options.durable.location, backend) if options.durable is not None else None
        if isinstance(store, DirStore) and any(os.path.realpath(store.url) == os.path.realpath(r) for r in roots):
            raise ValueError(f"durable: {store.url} is one of the local roots; the durable tier must be elsewhere")
    except (ValueError, TypeError, ImportError, CheckpointWriteError) as e:
        error = e
    outcomes: list[_RootsReport] = comm.all_gather(_RootsReport(
        host, error is None, store.url if store is not None else None, me, roots, redundancy, engine))
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
    if len({o.engine for o in outcomes}) > 1:  # the save processes form a group: every rank has one, or none
        raise ValueError(f"engine: the ranks run different engines ({[o.engine for o in outcomes]} by rank: a "
                         "backend or a durable store object keeps a rank on the thread engine); every rank must run "
                         "the same one")
    if len({o.redundancy for o in outcomes}) > 1:
        raise ValueError(f"redundancy: the ranks were given different values ({[o.redundancy for o in outcomes]} by "
                         "rank); every rank must pass the same one")
    nodes = NodeMap.from_ids([o.node for o in outcomes])
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


def _engine_and_budget(engine: str | None, backend: FileBackend | None, options: Options,
                       snapshot_bytes: int | None) -> tuple[str, int]:
    """The engine (an environment-chosen process engine stays on threads for a durable store
    object of this process) and the arena's budget (none by default for the process engine: it
    writes only from shared memory)."""
    explicit = engine is not None
    engine = choose_engine(engine, backend)
    if engine == "process" and not explicit and not crosses(options.durable):
        engine = "thread"
    if snapshot_bytes is None:
        snapshot_bytes = DEFAULT_SNAPSHOT_BYTES if engine == "thread" else sys.maxsize
    return engine, snapshot_bytes


def _comm(comm: Comm | str | None, timeout_s: float) -> Comm:
    if comm is None:
        return default_comm(timeout_s)
    if isinstance(comm, str):
        if comm != "local":
            raise ValueError(f"comm must be a Comm, None or \"local\", got {comm!r}")
        return LocalComm()
    return comm


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
