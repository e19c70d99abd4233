"""The Checkpointer: sharded, parallel checkpoints of a training job, loadable at any world size.

The save protocol, on every rank (each numbered step is one :func:`fastpersist.dist.agree`, so a
failure anywhere raises everywhere and nobody waits in a collective the others skipped):

1. (all ranks) serialize the state locally; compute the plan; agree on the plan's hash (which
   covers the storages' sizes and the skeleton) and on a save id chosen by the coordinator.
2. (all ranks) write: every writer rank writes its slots of the replicated state (one file per
   root, all at once), every rank writes its own ``rank_state``; every file is fsync'd, then the
   directories.
3. (coordinator) commit: build the manifest from every rank's report and write it last,
   atomically and durably; then point ``latest`` at it.

If step 2 or 3 fails anywhere, no manifest exists, ``latest`` is unchanged, and each rank removes
the files it wrote for this save id. Loading needs no process group and no particular world
size: every extent is read straight into the destination buffer from whichever file holds it.

One save driver: ``save()`` only captures the state (stage.py: copies into the snapshot arena,
guarded tensors left live in overlap mode) and queues the job; one worker thread runs the
protocol for every job, in ``save()`` order, whatever the mode. In ``sync`` mode, or when the
copies would exceed the arena's budget, ``save()`` queues the job with the state left live and
waits for its commit. So commit order equals ``save()`` order on every rank, ``latest`` never
moves back to an older commit than one already acknowledged, and one thread issues the
protocol's collectives.

Before the commit, the ranks also agree that the replicated state is replicated: each rank
hashes the replicated bytes it holds (in a thread, while its writes run) and a difference
fails the save on every rank, naming the first differing tensor (``check_replicated``).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from fastpersist import catalog, dtensor, sharded, timeline
from fastpersist.config import IOConfig, get_config
from fastpersist.dist import Comm, agree, default_comm, host_name, writer_ranks
from fastpersist.errors import CheckpointerClosedError, CheckpointError, CheckpointWriteError
from fastpersist.format import manifest as mf
from fastpersist.handle import History, SaveHandle, SaveMetrics
from fastpersist.io.backend import FileBackend
from fastpersist.lock import RootLock
from fastpersist.plan import Extent, plan, plan_digest
from fastpersist.replicas import ReplicaDigests, check_replicas, check_replicated_chunks, tensor_digest
from fastpersist.roots import check_roots
from fastpersist.stage import Arena, Capture, copy_bytes, guarded_storages, scan
from fastpersist.state import to_saveable
from fastpersist.timeline import Retention
from fastpersist.view import CheckpointInfo, CheckpointView, Roots, list_checkpoints, load_checkpoint, root_list

logger = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "Checkpointer", "list_checkpoints", "load_checkpoint"]


@dataclass
class _Written:
    reports: list[sharded.FileReport]
    objects: dict[str, tuple[list[str], list[int], list[mf.TensorEntry]]]  # objects whose skeleton this rank wrote
    digests: list[int] | None = None  # per replicated storage, for the replica check
    chunk_digests: dict[int, int] = dataclasses.field(default_factory=dict)  # replicated shards held here


MODES = ("sync", "snapshot", "overlap")
_WHEN_BUSY = ("wait", "skip")


@dataclass
class _Job:
    step: int
    state: Any  # saveable: state_dicts taken; in the background modes, captured (see stage.py)
    rank_state: Any
    metadata: Mapping[str, Any] | None
    handle: SaveHandle
    started: float
    uses_arena: bool = False
    live: bool = False  # some tensors are written from live (guarded) memory
    inline: bool = False  # save() waits for the commit: the state was not copied
    number: int = 0  # this Checkpointer's n-th queued save (the same on every rank)
    prepared: tuple[sharded.Prepared, sharded.Prepared | None] | None = None  # pickled at save time
    shards: list[dtensor.LocalShard] | None = None  # this rank's chunks of the state's DTensors


class Checkpointer:
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
        comm: the coordination seam (default: a private gloo group, or none at world size 1).
        backend: the file seam (default: real files); see :mod:`fastpersist.faults`.
        config: I/O settings (default: the process-wide configuration).
        timeout_s: how long a rank waits for the others in a collective.
        clean_start: remove incomplete checkpoints left by a crashed run at the first save.
        history: how many recent saves' metrics :attr:`history` keeps.

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
        comm: Comm | None = None,
        backend: FileBackend | None = None,
        config: IOConfig | None = None,
        timeout_s: float = 600.0,
        clean_start: bool = True,
        history: int = 1000,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if when_busy not in _WHEN_BUSY:
            raise ValueError(f"when_busy must be one of {_WHEN_BUSY}, got {when_busy!r}")
        _positive_int("max_in_flight", max_in_flight)
        _positive_int("snapshot_bytes", snapshot_bytes, minimum=0)
        _positive_int("history", history)
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        paths = root_list(roots)
        self.comm = comm if comm is not None else default_comm(timeout_s)
        self.roots = self._check_roots_everywhere(paths)
        self.mode = mode
        self.retention = Retention(keep, keep_every, abandoned)
        self.max_in_flight = max_in_flight
        self.when_busy = when_busy
        self.check_replicated = bool(check_replicated)
        self.backend = backend or FileBackend()
        self._config = config
        self._view = CheckpointView(self.roots, config=config, backend=self.backend)
        self._arena = Arena(snapshot_bytes)
        self._protected: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a job leaves the in-flight list
        self._queued = 0
        self._in_flight: list[_Job] = []
        self._failed: list[SaveHandle] = []
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._broken: str | None = None  # set on every rank alike when the ranks fell out of step
        self._commits: dict[int, timeline.Commit] | None = None  # coordinator: read at the first save
        # Coordinator: retention deletes old checkpoints in this thread, off the save's path
        self._janitor: ThreadPoolExecutor | None = None
        self._deleting: set[int] = set()  # steps whose deletion is queued or running
        self.history = History(history)  # metrics of recent saves, and totals
        self.writer_ranks = writer_ranks(writers, self._hosts)
        self._clean_start = clean_start
        self._lock_file = RootLock(self.roots[0], self.backend)
        _at_exit(_finish_at_exit, weakref.ref(self))

    def _check_roots_everywhere(self, paths: list[str]) -> list[str]:
        """Check the roots on every rank; if any rank finds them unusable, every rank raises
        (nobody is left waiting in a collective the others skipped). Also learns the hosts."""
        error: Exception | None = None
        roots = paths
        try:
            roots = check_roots(paths)
        except (ValueError, CheckpointWriteError) as e:
            error = e
        outcomes = self.comm.all_gather((host_name(), error is None))
        self._hosts = [h for h, _ in outcomes]
        if error is not None:
            raise error
        bad = [r for r, (_, ok) in enumerate(outcomes) if not ok]
        if bad:
            raise CheckpointWriteError(f"the checkpoint roots {paths} cannot be used on rank(s) {bad}; see the "
                                       "error raised there")
        return roots

    @property
    def config(self) -> IOConfig:
        return self._config or get_config()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def snapshot_memory(self) -> int:
        """Host bytes the snapshot arena holds now (never more than ``snapshot_bytes``)."""
        return self._arena.allocated

    # -----------------------------------------------------------------------------------------
    # the overlap guard

    def protect(self, optimizer: torch.optim.Optimizer) -> None:
        """Write ``optimizer``'s parameters and state from live memory (overlap mode).

        ``optimizer.step()`` then waits, through a step pre-hook, until every in-flight
        checkpoint has written them; nothing else about training waits. Parameters must change
        only inside this optimizer's step.
        """
        if optimizer in self._protected:
            return
        self._protected.append(optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    def _guarded(self) -> set[int]:
        tensors = []
        for opt in self._protected:
            for group in opt.param_groups:
                tensors += [dtensor.local(p) for p in group["params"] if isinstance(p, torch.Tensor)]
            for st in opt.state.values():
                tensors += [dtensor.local(v) for v in st.values() if isinstance(v, torch.Tensor)]
        return guarded_storages(tensors)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            jobs = [j for j in self._in_flight if j.live]
        for job in jobs:
            t0 = time.perf_counter()
            job.handle.staged.result()
            job.handle.metrics.step_wait_s += time.perf_counter() - t0
        self._raise_failed()

    # -----------------------------------------------------------------------------------------
    # save

    def save(self, step: int, state: Any, *, rank_state: Any = None,
             metadata: Mapping[str, Any] | None = None) -> SaveHandle:
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
        if self._broken is not None:
            raise CheckpointWriteError(self._broken)
        _check_step(step)
        meta = _check_metadata(metadata)
        handle = SaveHandle(SaveMetrics(step, self.mode))
        if not self._make_room(handle):
            self._raise_failed()
            return handle
        saveable = to_saveable(state)
        own = to_saveable(rank_state) if rank_state is not None else None
        shards: list[dtensor.LocalShard] = []
        if dtensor.dtensor_type() is not None:  # no DTensor exists before its module is loaded
            saveable, shards = dtensor.split(saveable)  # the state itself where it holds none
        if own is not None and dtensor.holds_dtensors(own):
            raise ValueError("rank_state holds DTensors: pass sharded state (DTensors) in `state`; fastpersist "
                             "writes each rank's shards and reshards them at load")
        job = _Job(step, saveable, own, meta, handle, t0, shards=shards)
        job.inline = self.mode == "sync" or not self._stage(job)
        if not job.inline and not job.live:
            handle._set_staged()
        with self._lock:
            self._in_flight.append(job)
            self._queued += 1
            job.number = self._queued
        self._ensure_worker()
        # Queued on every rank alike (what a rank raises below differs with timing, so it must
        # come after the job is queued: otherwise the ranks' queues would fall out of step).
        self._queue.put(job)  # the worker starts now; nothing below may take time
        if not job.inline:
            handle.metrics.save_call_s = time.perf_counter() - t0
            self._raise_failed()
            return handle
        handle.metrics.inline = True
        try:
            handle.result()  # every earlier save first, then this one: one driver, one order
        finally:
            handle.metrics.save_call_s = time.perf_counter() - t0
            if handle.exception() is None:
                self._log(handle.metrics)
        self._raise_failed()
        return handle

    def _make_room(self, handle: SaveHandle) -> bool:
        """Back-pressure: False if this checkpoint is skipped."""
        with self._lock:
            busy = len(self._in_flight) >= self.max_in_flight
        if self.when_busy == "skip" and self.comm.world_size > 1:  # every rank must skip alike
            busy = any(self.comm.all_gather(busy, channel="control"))
        if not busy:
            return True
        if self.when_busy == "skip":
            handle.metrics.skipped = True
            handle._finish()
            self.history.append(handle.metrics)
            logger.info("checkpoint step %d skipped: %d still in flight", handle.step, self.max_in_flight)
            return False
        handle.metrics.waited_for_previous = True
        with self._room:
            self._room.wait_for(lambda: len(self._in_flight) < self.max_in_flight)
        return True

    def _stage(self, job: _Job) -> bool:
        """Make the job independent of training from now on, except for guarded tensors.

        Plain states (containers, tensors, immutable values) are captured structurally, and the
        pickling happens in the background; anything else is pickled now. Unguarded storages are
        copied into the arena. False if they do not fit (the save then runs inline, through the
        fixed staging pool).
        """
        live = self._guarded() if self.mode == "overlap" else set()
        objs = [job.state] + ([job.rank_state] if job.rank_state is not None else [])
        scans = [scan(o) for o in objs]
        local = [sh.tensor for sh in job.shards or []]
        shard_storages = scan(local)[1]
        if not all(is_plain for is_plain, _ in scans):
            rep = sharded.prepare(mf.REPLICATED, job.state)
            own = sharded.prepare(mf.rank_object(self.rank), job.rank_state) if job.rank_state is not None else None
            job.prepared = (rep, own)
            storages = rep.storages + (own.storages if own else []) + shard_storages
        else:
            storages = [s for _, found in scans for s in found] + shard_storages
        need = copy_bytes(storages, live)
        if not self._arena.fits(need):
            logger.info("checkpoint step %d needs %.1f MiB of snapshot memory, over the budget of %.1f MiB: "
                        "writing it from live memory, save() waits for its commit", job.step, need / 2**20,
                        self._arena.budget / 2**20)
            return False
        arena = self._arena.take(need) if need else None
        job.uses_arena = arena is not None
        try:
            # one capture for the whole job: a storage shared by the state, the rank state and
            # the shards is copied once (the arena was sized for each storage once)
            cap = Capture(live, arena)
            if job.prepared is not None:
                for prepared in job.prepared:
                    if prepared is not None:
                        prepared.storages[:] = [cap.storage(st) for st in prepared.storages]
            else:
                job.state = cap(job.state)
                if job.rank_state is not None:
                    job.rank_state = cap(job.rank_state)
            for sh, t in zip(job.shards or [], [cap(t) for t in local]):
                sh.tensor = t
            cap.finish()
            copied = cap.copied
        except BaseException:
            self._release(job)
            raise
        job.live = bool(live)
        job.handle.metrics.bytes_copied = copied
        return True

    def _release(self, job: _Job) -> None:
        if job.uses_arena:
            job.uses_arena = False
            self._arena.give_back()

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="fastpersist-checkpointer", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            error: BaseException | None = None
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - reported through the handle
                error = e
            finally:
                self._release(job)
            if error is None and not job.inline:
                self._log(job.handle.metrics)  # an inline job is logged by save(), which timed it
            with self._lock:
                if error is not None and not job.inline:
                    self._failed.append(job.handle)
            # A failure is raised to the caller (by wait(), the next save(), a guarded step or
            # close()), never also logged at ERROR; only one nobody collects is (at exit).
            logger.debug("checkpoint step %d finished: %s", job.step, "ok" if error is None else error)
            job.handle._finish(error)  # done (and its callbacks run) before it leaves the in-flight list
            with self._room:
                self._in_flight.remove(job)
                self._room.notify_all()

    def _raise_failed(self) -> None:
        """Raise the oldest background failure not yet seen by the caller (the others stay
        pending, for the next call)."""
        with self._lock:
            self._failed = [h for h in self._failed if not h.reported]
            if not self._failed:
                return
            first = self._failed.pop(0)
            first.reported = True
        raise first._error  # type: ignore[misc]

    def _log(self, m: SaveMetrics) -> None:
        self.history.append(m)
        logger.info("checkpoint step %d committed (%s%s): %.1f MiB in %.3f s (%.2f GiB/s); training blocked %.1f ms "
                    "(save %.1f + step %.1f); wrote %.1f MiB on this rank in %.3f s",
                    m.step, m.mode, ", inline" if m.inline else "", m.bytes_total / 2**20, m.total_s,
                    m.bytes_total / 2**30 / m.total_s if m.total_s > 0 else 0.0,
                    m.blocked_s * 1e3, m.save_call_s * 1e3, m.step_wait_s * 1e3, m.bytes_written / 2**20, m.write_s)

    def _run(self, job: _Job) -> None:
        """The save protocol (see the module docstring); in the worker thread or inline."""
        step = job.step
        if self._broken is not None:  # no collective: the other ranks stopped too
            job.handle._set_staged()
            raise CheckpointWriteError(self._broken)
        slots = [(r, j) for r in self.writer_ranks for j in range(len(self.roots))]
        try:
            proposals = agree(self.comm, f"preparing checkpoint step {step}", lambda: self._prepare_step(job, slots))
        except BaseException:
            job.handle._set_staged()
            raise
        rep, own = job.prepared  # type: ignore[misc]
        out_of_step = [r for r, p in enumerate(proposals) if p[2:4] != proposals[0][2:4]]
        if out_of_step:  # every rank sees it in the same step: all stop issuing collectives
            self._broken = (
                f"the ranks are out of step: rank 0 is saving step {proposals[0][2]} (its save #{proposals[0][3]}) "
                f"while rank {out_of_step[0]} is saving step {proposals[out_of_step[0]][2]} (its save "
                f"#{proposals[out_of_step[0]][3]}). Every rank must call save() with the same steps in the same "
                "order, and an exception raised by save() on one rank only (a bad argument) leaves that rank one "
                "save behind; this Checkpointer takes no more saves (nothing further is committed): restart "
                "the job's Checkpointers"
            )
            raise CheckpointWriteError(self._broken)
        differing = [r for r, p in enumerate(proposals) if p[0] != proposals[0][0]]
        if differing:
            raise CheckpointWriteError(
                f"checkpoint step {step}: the replicated state differs between ranks: ranks {differing} disagree "
                "with rank 0 on its structure (the keys, the tensors' sizes and dtypes, or the pickled values). "
                "`state` is written once for all ranks and must be the same on each; pass per-rank values "
                "(an optimizer shard, ZeRO/FSDP state) as rank_state"
            )
        save_id = proposals[0][1]
        layout = dtensor.assign([p[4] for p in proposals])
        extents = plan(rep.sizes, len(slots))
        written: list[_Written] = []
        t_write = time.perf_counter()
        try:
            written = agree(self.comm, f"writing checkpoint step {step}",
                            lambda: self._write(catalog.step_dir(step), save_id, job, rep, own, extents, slots,
                                                layout))
            job.handle.metrics.write_s = time.perf_counter() - t_write
            if self.check_replicated and self.comm.world_size > 1:
                check_replicas(step, [w.digests for w in written], rep, job.state)
                check_replicated_chunks(step, [w.chunk_digests for w in written], [c.key for c in layout.chunks])
            agree(self.comm, f"committing checkpoint step {step}",
                  lambda: self._commit(step, save_id, written, job.metadata, layout) if self.rank == 0 else None)
        except CheckpointError:
            if not self._is_committed(step, save_id):  # a failure after the commit point keeps the files
                catalog.remove_files(self.roots, step, f"{save_id}-", self.backend, prune=True)
            raise
        if self.rank == 0:
            try:
                self._after_commit(step, written)
            except Exception as e:  # noqa: BLE001 - committed: a cleanup failure must not fail the save
                logger.warning("checkpoint step %d is committed; cleaning up after it failed: %s", step, e)
        m = job.handle.metrics
        for r in written[self.rank].reports:
            m.bytes_per_root[r.root] = m.bytes_per_root.get(r.root, 0) + sum(e.nbytes for e in r.extents)
        m.bytes_written = sum(m.bytes_per_root.values())
        m.bytes_total = sum(e.nbytes for w in written for r in w.reports for e in r.extents)
        m.total_s = time.perf_counter() - job.started

    def _prepare_step(self, job: _Job, slots: list[tuple[int, int]]
                      ) -> tuple[str, str, int, int, list[dtensor.ChunkMeta]]:
        """Step 1 on this rank: serialize the state (unless save() did), propose the plan's
        digest, a save id, the step and this save's number (so ranks out of step are caught).
        The coordinator takes the root's lock on the first save and then, owning the roots,
        removes what a crashed run left there (before anyone writes)."""
        if job.prepared is None:
            rep = sharded.prepare(mf.REPLICATED, job.state)
            own = sharded.prepare(mf.rank_object(self.rank), job.rank_state) if job.rank_state is not None else None
            job.prepared = (rep, own)
        rep = job.prepared[0]
        digest = plan_digest(rep.sizes, len(slots), extra=rep.skeleton_checksum.to_bytes(8, "big"))
        if self.rank == 0 and job.step in self._deleting:  # saving a step retention is deleting: let it finish
            self._drain_deletions()
        if self.rank == 0 and not self._lock_file.held:
            self._lock_file.acquire()
            if self._clean_start:
                catalog.clean_incomplete(self.roots, self.backend)
            self._commits = {c.step: c for c in catalog.commits(self.roots[0])}
        return digest, secrets.token_hex(6), job.step, job.number, [sh.meta for sh in job.shards or []]

    def _write(self, name: str, save_id: str, job: _Job, rep: sharded.Prepared, own: sharded.Prepared | None,
               extents: list[Extent], slots: list[tuple[int, int]], layout: dtensor.Layout) -> _Written:
        check = self.check_replicated and self.comm.world_size > 1
        hashing = ReplicaDigests(rep) if check else None
        # replicated shards are hashed beside the writes too (xxhash releases the GIL)
        chunk_hashing = ThreadPoolExecutor(1, thread_name_prefix="fastpersist-hash") if check else None
        try:
            chunks = chunk_hashing.submit(self._chunk_digests, job.shards or [], layout) if chunk_hashing else None
            written = self._write_files(name, save_id, rep, own, extents, slots, job.shards or [], layout)
            if hashing is not None and chunks is not None:
                written.digests = hashing.result()
                written.chunk_digests = chunks.result()
                job.handle.metrics.replica_check_s = hashing.seconds
            return written
        finally:
            if hashing is not None:
                hashing.join()
            if chunk_hashing is not None:
                chunk_hashing.shutdown(wait=True)
            job.handle._set_staged()  # live tensors are no longer read (written, or failed)

    def _write_files(self, name: str, save_id: str, rep: sharded.Prepared, own: sharded.Prepared | None,
                     extents: list[Extent], slots: list[tuple[int, int]], shards: list[dtensor.LocalShard],
                     layout: dtensor.Layout) -> _Written:
        cfg = self.config
        dirs = [os.path.join(root, name) for root in self.roots]
        for d in dirs:
            try:
                self.backend.makedirs(d)
            except OSError as e:
                raise CheckpointWriteError(f"cannot create {d}: {e.strerror or e}") from e
        reports: list[sharded.FileReport] = []
        objects: dict[str, tuple[list[str], list[int], list[mf.TensorEntry]]] = {}
        jobs = []
        for s, (r, j) in enumerate(slots):
            if r == self.rank:
                mine = [e for e in extents if e.slot == s]
                jobs.append((mine, j, os.path.join(dirs[j], f"{save_id}-{rep.name}-{s:04d}.bin")))
        if jobs:
            reports += sharded.write_slots(rep, jobs, self.backend, cfg)
        if self.rank == 0:
            path = os.path.join(dirs[0], f"{save_id}-{rep.name}.skel")
            reports.append(sharded.write_skeleton(rep, 0, path, self.backend))
            objects[rep.name] = (rep.keys, rep.sizes, rep.tensors)
        if own is not None:
            own_extents = plan(own.sizes, len(self.roots))
            own_jobs = [([e for e in own_extents if e.slot == j], j,
                         os.path.join(dirs[j], f"{save_id}-{own.name}-{j:04d}.bin")) for j in range(len(self.roots))]
            reports += sharded.write_slots(own, own_jobs, self.backend, cfg)
            path = os.path.join(dirs[0], f"{save_id}-{own.name}.skel")
            reports.append(sharded.write_skeleton(own, 0, path, self.backend))
            objects[own.name] = (own.keys, own.sizes, own.tensors)
        reports += self._write_shards(name, save_id, shards, layout)
        for d in dirs:  # the new files' directory entries are durable too
            self.backend.fsync_dir(d)
        self.backend.event("after-data")
        return _Written(reports, objects)

    def _write_shards(self, name: str, save_id: str, shards: list[dtensor.LocalShard],
                      layout: dtensor.Layout) -> list[sharded.FileReport]:
        """Write this rank's pieces of the distinct chunks, balanced over the roots; in the
        reports an extent's ``storage`` is the chunk's index in ``layout.chunks``."""
        chunks = layout.chunks
        mine = [p for p in layout.pieces if p.rank == self.rank]
        if not mine:
            return []
        local = {(sh.meta.path, sh.meta.offsets, sh.meta.sizes): sh.tensor for sh in shards}
        tensors = [local[(chunks[p.chunk].path, chunks[p.chunk].offsets, chunks[p.chunk].sizes)] for p in mine]
        files = [(j, os.path.join(root, name, f"{save_id}-{mf.SHARDED}-r{self.rank:05d}-{j:04d}.bin"))
                 for j, root in enumerate(self.roots)]
        reports = sharded.write_chunks(mf.SHARDED, tensors, [(i, p.start, p.nbytes) for i, p in enumerate(mine)],
                                       files, self.backend, self.config)
        # tensor index i -> chunk index
        return [dataclasses.replace(r, extents=tuple(dataclasses.replace(e, storage=mine[e.storage].chunk)
                                                     for e in r.extents)) for r in reports]

    def _chunk_digests(self, shards: list[dtensor.LocalShard], layout: dtensor.Layout) -> dict[int, int]:
        """xxh3-64 of every shard this rank holds that other ranks hold too (the replica check)."""
        index = {(c.path, c.offsets, c.sizes): i for i, c in enumerate(layout.chunks)}
        out = {}
        for sh in shards:
            c = index.get((sh.meta.path, sh.meta.offsets, sh.meta.sizes))
            if c is not None and len(layout.holders[c]) > 1:
                out[c] = tensor_digest(sh.tensor)
        return out

    def _commit(self, step: int, save_id: str, written: list[_Written],
                metadata: Mapping[str, Any] | None, layout: dtensor.Layout) -> None:
        reports = [r for w in written for r in w.reports]
        files = tuple(mf.FileEntry(r.root, r.name, r.size) for r in reports)
        index = {(r.root, r.name): i for i, r in enumerate(reports)}
        objects: dict[str, mf.ObjectEntry] = {}
        for w in written:
            for obj, (keys, sizes, tensors) in w.objects.items():
                skel = next(r for r in reports if r.object == obj and r.skeleton_checksum is not None)
                data = [(index[(r.root, r.name)], r) for r in reports if r.object == obj and r.skeleton_checksum is None]
                objects[obj] = sharded.build_object(keys, sizes, index[(skel.root, skel.name)], skel, data, tensors)
        commits = list((self._commits or {}).values())
        abandoned = timeline.abandoned_by(step, commits)
        manifest = mf.Manifest(step, save_id, time.time(), self.comm.world_size, len(self.roots), files, objects,
                               user=dict(metadata or {}), sequence=timeline.next_sequence(commits),
                               sharded=sharded.build_sharded(layout, [(index[(r.root, r.name)], r) for r in reports
                                                                      if r.object == mf.SHARDED]),
                               root_paths=tuple(self.roots))
        step_path = os.path.join(self.roots[0], catalog.step_dir(step))
        # The commit point: the manifest is written last, after every rank's data is durable.
        catalog.write_atomic(step_path, mf.MANIFEST_NAME, manifest.to_json(), self.backend, events=True)
        if self._commits is not None:
            self._commits[step] = timeline.Commit(step, manifest.sequence, manifest.created)
        if abandoned:
            logger.warning("checkpoint step %d starts a new timeline: steps %s, committed earlier, are abandoned "
                           "(latest is now step %d); %s", step, ", ".join(map(str, abandoned)), step,
                           "they are kept and listed as abandoned" if self.retention.abandoned == "keep"
                           else "retention deletes them")
        self.backend.event("before-latest")
        try:
            catalog.write_atomic(self.roots[0], catalog.LATEST, f"{catalog.step_dir(step)}\n".encode(), self.backend)
            self.backend.event("after-latest")
        except OSError as e:  # committed anyway: readers find the most recent commit by its sequence
            latest = os.path.join(self.roots[0], catalog.LATEST)
            logger.warning("checkpoint step %d is committed but %s could not be updated: %s", step, latest, e)
            try:  # a stale pointer must not win a tie of manifest times: remove it (best effort)
                self.backend.unlink(latest)
            except OSError:
                pass

    def _is_committed(self, step: int, save_id: str) -> bool:
        try:
            return catalog.read_manifest(os.path.join(self.roots[0], catalog.step_dir(step))).save_id == save_id
        except CheckpointError:
            return False

    def _after_commit(self, step: int, written: list[_Written]) -> None:
        """Coordinator: drop files of an earlier save of the same step, then apply retention.
        Deletions are best effort: a failure is logged and never fails the save."""
        keep = {(r.root, r.name) for w in written for r in w.reports}
        catalog.remove_files(self.roots, step, "", self.backend, keep=keep)
        if self._commits is None:
            return
        with self._lock:
            protected = {j.step for j in self._in_flight} | {step} | self._deleting
            victims = self.retention.to_delete(list(self._commits.values()), protected)
            if not victims:
                return
            gone = {old: self._commits.pop(old) for old in victims}
            self._deleting |= set(victims)
        if self._janitor is None:
            self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastpersist-retention")
        self._janitor.submit(self._delete, gone)

    def _delete(self, gone: dict[int, timeline.Commit]) -> None:
        """Retention's deletions, in the janitor thread: the committed save (and the next one)
        do not wait for them. A checkpoint whose manifest could not be removed stays committed."""
        for old, commit in gone.items():
            try:
                kept = not catalog.remove_checkpoint(self.roots, old, self.backend)
            except Exception as e:  # noqa: BLE001 - best effort, like every retention deletion
                logger.warning("retention could not delete checkpoint step %d: %s", old, e)
                kept = True
            with self._lock:
                self._deleting.discard(old)
                if kept and self._commits is not None:
                    self._commits.setdefault(old, commit)

    def _drain_deletions(self) -> None:
        if self._janitor is not None:
            self._janitor.submit(lambda: None).result()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every checkpoint in flight (and the deletions retention started); raises
        the first failure not yet raised."""
        with self._room:
            if not self._room.wait_for(lambda: not self._in_flight, timeout):
                step = self._in_flight[0].step
                raise TimeoutError(f"checkpoint step {step} is still in flight after {timeout} s")
        self._drain_deletions()
        self._raise_failed()

    def close(self) -> None:
        """Wait for checkpoints in flight, stop the background thread, remove the guards and
        release the roots. Raises the first failure not yet raised. Idempotent."""
        self._closed = True
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join()
                self._worker = None
            if self._janitor is not None:
                self._janitor.shutdown(wait=True)
                self._janitor = None
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            self._protected.clear()
            self._lock_file.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------
    # load: through a read-only view (no directory created, no lock, no collective)

    def load(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
             keys: Iterable[str] | None = None, map_location: Any = None, weights_only: bool = True,
             verify: bool | None = None) -> Any:
        """Load a checkpoint's state (sharded tensors resharded into ``into``'s DTensors); see
        :meth:`CheckpointView.load`."""
        return self._view.load(step, into, keys=keys, map_location=map_location, weights_only=weights_only,
                               verify=verify)

    def load_rank_state(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
                        rank: int | None = None, map_location: Any = None, weights_only: bool = True,
                        verify: bool | None = None) -> Any:
        """Load the ``rank_state`` that ``rank`` (default: this rank) saved."""
        return self._view.load_rank_state(step, into, rank=self.rank if rank is None else rank,
                                          map_location=map_location, weights_only=weights_only, verify=verify)

    def metadata(self, step: int | str = "latest") -> dict[str, Any]:
        """The ``metadata`` saved with ``step``."""
        return self._view.metadata(step)

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint in the first root, committed or not, by step (after the deletions
        retention has started)."""
        self._drain_deletions()
        return self._view.list()

    def latest_step(self) -> int | None:
        """The most recently committed step (not necessarily the largest), or None."""
        return self._view.latest_step()


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def _check_step(step: object) -> None:
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
    """At interpreter exit, finish the checkpoints still in flight (the worker is a daemon
    thread: without this, a job that ends without close() would lose its last checkpoint)."""
    ck = ref()
    if ck is None or ck._worker is None:
        return
    try:
        ck.close()
    except Exception as e:  # noqa: BLE001 - exiting anyway; nobody else will see it: say what was lost
        logger.error("a checkpoint in flight at exit failed: %s", e)
