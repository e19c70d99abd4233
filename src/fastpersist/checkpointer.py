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

``save()`` itself only captures the state (stage.py: copies into the snapshot arena, guarded
tensors left live in overlap mode) and queues the job; one worker thread runs the protocol for
each job in order, so every rank issues the same collectives in the same order. In ``sync``
mode, or when the copies would exceed the arena's budget, the protocol runs inside ``save()``.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastpersist import catalog, sharded
from fastpersist.config import IOConfig, get_config
from fastpersist.dist import Comm, agree, default_comm, host_name, writer_ranks
from fastpersist.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError
from fastpersist.format import manifest as mf
from fastpersist.handle import SaveHandle, SaveMetrics
from fastpersist.io.backend import FileBackend
from fastpersist.lock import RootLock
from fastpersist.plan import Extent, plan, plan_digest
from fastpersist.retention import Retention
from fastpersist.stage import Arena, capture, capture_storages, copy_bytes, guarded_storages, scan
from fastpersist.state import restore_into, to_saveable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint found in the roots (see :meth:`Checkpointer.list`)."""

    step: int
    path: str
    committed: bool
    latest: bool = False
    nbytes: int = 0
    files: int = 0
    created: float = 0.0
    world_size: int = 0
    objects: tuple[str, ...] = field(default_factory=tuple)


@dataclass
class _Written:
    reports: list[sharded.FileReport]
    objects: dict[str, tuple[list[str], list[int]]]  # objects whose skeleton this rank wrote


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
    prepared: tuple[sharded.Prepared, sharded.Prepared | None] | None = None  # pickled at save time


class Checkpointer:
    """Save and load sharded checkpoints under one or more roots (one per SSD).

    ``roots``: directories (one path or a list), the same list on every rank; each rank writes
    its share to its node's roots. ``mode``: ``"snapshot"`` (default: copy the state into a
    bounded host arena inside save(), write in the background), ``"overlap"`` (the FastPersist
    mode: tensors of protected optimizers are written from live memory while the next
    iteration runs, see :meth:`protect`; everything else is copied), or ``"sync"`` (save()
    returns when committed). ``snapshot_bytes``: the arena's budget; a state larger than it is
    written synchronously through the fixed staging pool instead of growing memory.
    ``max_in_flight`` checkpoints may be pending at once; beyond that save() waits
    (``when_busy="wait"``) or skips the checkpoint (``"skip"``). ``keep`` / ``keep_every``:
    retention (last K committed, plus every M-th step). ``writers``: who writes replicated
    state, ``"all"`` ranks (default), ``"node"``, ``N`` per node or a list of ranks. ``comm``
    and ``backend`` are the coordination and file seams. Every rank must construct the
    Checkpointer (it creates its own gloo groups when torch.distributed is initialised).
    """

    def __init__(
        self,
        roots: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        mode: str = "snapshot",
        keep: int | None = None,
        keep_every: int | None = None,
        max_in_flight: int = 1,
        when_busy: str = "wait",
        snapshot_bytes: int = 2 << 30,
        writers: str | int | Sequence[int] = "all",
        comm: Comm | None = None,
        backend: FileBackend | None = None,
        config: IOConfig | None = None,
        timeout_s: float = 600.0,
        clean_start: bool = True,
    ) -> None:
        paths = [roots] if isinstance(roots, (str, os.PathLike)) else list(roots)
        if not paths:
            raise CheckpointError("a Checkpointer needs at least one root directory")
        if mode not in MODES:
            raise CheckpointError(f"mode must be one of {MODES}, got {mode!r}")
        if when_busy not in _WHEN_BUSY:
            raise CheckpointError(f"when_busy must be one of {_WHEN_BUSY}, got {when_busy!r}")
        if max_in_flight < 1:
            raise CheckpointError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.roots = [os.path.abspath(os.fspath(r)) for r in paths]
        self.mode = mode
        self.retention = Retention(keep, keep_every)
        self.max_in_flight = max_in_flight
        self.when_busy = when_busy
        self.comm = comm if comm is not None else default_comm(timeout_s)
        self.backend = backend or FileBackend()
        self._config = config
        self._arena = Arena(snapshot_bytes)
        self._protected: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._lock = threading.Lock()
        self._in_flight: list[_Job] = []
        self._failed: list[SaveHandle] = []
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self.history: list[SaveMetrics] = []  # metrics of every save, in order
        hosts = self.comm.all_gather(host_name())
        self.writer_ranks = writer_ranks(writers, hosts)
        for root in self.roots:
            try:
                self.backend.makedirs(root)
            except OSError as e:
                raise CheckpointWriteError(f"cannot create checkpoint root {root}: {e.strerror or e}") from e
        self._clean_start = clean_start
        self._lock_file = RootLock(self.roots[0])
        atexit.register(_finish_at_exit, weakref.ref(self))

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
                tensors += [p for p in group["params"] if isinstance(p, torch.Tensor)]
            for st in opt.state.values():
                tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return guarded_storages(tensors)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            jobs = [j for j in self._in_flight if j.live]
        for job in jobs:
            t0 = time.perf_counter()
            job.handle._wait_data_written()
            job.handle.metrics.step_wait_s += time.perf_counter() - t0
        self._raise_failed()

    # -----------------------------------------------------------------------------------------
    # save

    def save(self, step: int, state: Any, *, rank_state: Any = None,
             metadata: Mapping[str, Any] | None = None) -> SaveHandle:
        """Checkpoint ``state`` as step ``step`` (call on every rank); returns a handle.

        ``state`` must be the same on every rank (replicated: model weights, the optimizer
        state of a data-parallel job, the step); it is written once, split over all writers.
        Pass what differs per rank (its optimizer shard, its RNG state) as ``rank_state``.
        Stateful objects are saved through ``state_dict()``. ``metadata`` (JSON) goes into the
        manifest. What is saved is the state at this call, bit for bit, whatever training does
        next. An earlier checkpoint's background failure is raised here (once).
        """
        t0 = time.perf_counter()
        catalog.step_dir(step)  # validates the step before anything else
        self._raise_failed()
        handle = SaveHandle(SaveMetrics(step, self.mode))
        if not self._make_room(handle):
            return handle
        saveable = to_saveable(state)
        own = to_saveable(rank_state) if rank_state is not None else None
        job = _Job(step, saveable, own, metadata, handle, t0)
        if self.mode == "sync" or not self._stage(job):
            try:
                self._run(job)
            except BaseException as e:
                handle._finish(e)
                handle.reported = True
                raise
            handle.metrics.save_call_s = time.perf_counter() - t0
            handle._finish()
            self._log(handle.metrics)
            return handle
        with self._lock:
            self._in_flight.append(job)
        self._ensure_worker()
        handle.metrics.save_call_s = time.perf_counter() - t0
        self._queue.put(job)  # the worker starts now; nothing below may take time
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
            logger.info("fastpersist: checkpoint step %d skipped: %d still in flight", handle.step, self.max_in_flight)
            return False
        handle.metrics.waited_for_previous = True
        while True:
            with self._lock:
                if len(self._in_flight) < self.max_in_flight:
                    return True
                oldest = self._in_flight[0].handle
            oldest._done.wait()
            self._raise_failed()

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
        if not all(is_plain for is_plain, _ in scans):
            rep = sharded.prepare(mf.REPLICATED, job.state)
            own = sharded.prepare(mf.rank_object(self.rank), job.rank_state) if job.rank_state is not None else None
            job.prepared = (rep, own)
            storages = rep.storages + (own.storages if own else [])
        else:
            storages = [s for _, found in scans for s in found]
        need = copy_bytes(storages, live)
        if not self._arena.fits(need):
            logger.info("fastpersist: checkpoint step %d needs %.1f MB of snapshot memory, over the budget of "
                        "%.1f MB: writing it now, through the staging pool", job.step, need / 1e6, self._arena.budget / 1e6)
            return False
        arena = self._arena.take(need) if need else None
        job.uses_arena = arena is not None
        try:
            if job.prepared is not None:
                pos, copied = capture_storages(job.prepared[0].storages, live, arena)
                if job.prepared[1] is not None:
                    copied += capture_storages(job.prepared[1].storages, live, arena, pos)[1]
            else:
                job.state, pos, copied = capture(job.state, live, arena)
                if job.rank_state is not None:
                    job.rank_state, _, more = capture(job.rank_state, live, arena, pos)
                    copied += more
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
            with self._lock:  # out of the in-flight list before anyone waiting on the handle wakes
                self._in_flight.remove(job)
                if error is not None:
                    self._failed.append(job.handle)
            job.handle._finish(error)
            if error is None:
                self._log(job.handle.metrics)
            else:
                logger.error("fastpersist: checkpoint step %d failed: %s", job.step, error)

    def _raise_failed(self) -> None:
        """Raise the first background failure not yet seen by the caller."""
        with self._lock:
            pending = [h for h in self._failed if not h.reported]
            self._failed = []
        for h in pending[1:]:
            h.reported = True
        if pending:
            pending[0].reported = True
            raise pending[0]._error  # type: ignore[misc]

    def _log(self, m: SaveMetrics) -> None:
        self.history.append(m)
        logger.info("fastpersist: checkpoint step %d committed (%s): %.1f MB in %.3f s (%.2f GB/s); training "
                    "blocked %.1f ms (save %.1f + step %.1f); wrote %.1f MB on this rank in %.3f s",
                    m.step, m.mode, m.bytes_total / 1e6, m.total_s, m.gbps, m.blocked_s * 1e3, m.save_call_s * 1e3,
                    m.step_wait_s * 1e3, m.bytes_written / 1e6, m.write_s)

    def _run(self, job: _Job) -> None:
        """The save protocol (see the module docstring); in the worker thread or inline."""
        try:
            if job.prepared is not None:
                rep, own = job.prepared
            else:
                rep = sharded.prepare(mf.REPLICATED, job.state)
                own = sharded.prepare(mf.rank_object(self.rank), job.rank_state) if job.rank_state is not None else None
        except BaseException:
            job.handle._data_written.set()
            raise
        step = job.step
        slots = [(r, j) for r in self.writer_ranks for j in range(len(self.roots))]
        digest = plan_digest(rep.sizes, len(slots), extra=rep.skeleton_checksum.to_bytes(8, "big"))
        proposals = agree(self.comm, f"preparing checkpoint step {step}", lambda: self._prepare_step(digest))
        differing = [r for r, (d, _) in enumerate(proposals) if d != proposals[0][0]]
        if differing:
            raise CheckpointWriteError(
                f"checkpoint step {step}: the replicated state differs between ranks (ranks {differing} "
                "disagree with rank 0 on its structure or values); pass per-rank values as rank_state"
            )
        save_id = proposals[0][1]
        extents = plan(rep.sizes, len(slots))
        written: list[_Written] = []
        t_write = time.perf_counter()
        try:
            written = agree(self.comm, f"writing checkpoint step {step}",
                            lambda: self._write(catalog.step_dir(step), save_id, job, rep, own, extents, slots))
            job.handle.metrics.write_s = time.perf_counter() - t_write
            agree(self.comm, f"committing checkpoint step {step}",
                  lambda: self._commit(step, save_id, written, job.metadata) if self.rank == 0 else None)
        except CheckpointError:
            if not self._is_committed(step, save_id):  # a failure after the commit point keeps the files
                catalog.remove_files(self.roots, step, f"{save_id}-", prune=True)
            raise
        if self.rank == 0:
            self._after_commit(step, written)
        m = job.handle.metrics
        for r in written[self.rank].reports:
            m.bytes_per_root[r.root] = m.bytes_per_root.get(r.root, 0) + sum(e.nbytes for e in r.extents)
        m.bytes_written = sum(m.bytes_per_root.values())
        m.bytes_total = sum(e.nbytes for w in written for r in w.reports for e in r.extents)
        m.total_s = time.perf_counter() - job.started

    def _prepare_step(self, digest: str) -> tuple[str, str]:
        """Step 1 on this rank. The coordinator takes the root's lock on the first save and
        then, owning the roots, removes what a crashed run left there (before anyone writes)."""
        if self.rank == 0 and not self._lock_file.held:
            self._lock_file.acquire()
            if self._clean_start:
                catalog.clean_incomplete(self.roots)
        return digest, secrets.token_hex(6)

    def _write(self, name: str, save_id: str, job: _Job, rep: sharded.Prepared, own: sharded.Prepared | None,
               extents: list[Extent], slots: list[tuple[int, int]]) -> _Written:
        try:
            return self._write_files(name, save_id, rep, own, extents, slots)
        finally:
            job.handle._data_written.set()  # live tensors are no longer read (written, or failed)

    def _write_files(self, name: str, save_id: str, rep: sharded.Prepared, own: sharded.Prepared | None,
                     extents: list[Extent], slots: list[tuple[int, int]]) -> _Written:
        cfg = self.config
        dirs = [os.path.join(root, name) for root in self.roots]
        for d in dirs:
            try:
                self.backend.makedirs(d)
            except OSError as e:
                raise CheckpointWriteError(f"cannot create {d}: {e.strerror or e}") from e
        reports: list[sharded.FileReport] = []
        objects: dict[str, tuple[list[str], list[int]]] = {}
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
            objects[rep.name] = (rep.keys, rep.sizes)
        if own is not None:
            own_extents = plan(own.sizes, len(self.roots))
            own_jobs = [([e for e in own_extents if e.slot == j], j,
                         os.path.join(dirs[j], f"{save_id}-{own.name}-{j:04d}.bin")) for j in range(len(self.roots))]
            reports += sharded.write_slots(own, own_jobs, self.backend, cfg)
            path = os.path.join(dirs[0], f"{save_id}-{own.name}.skel")
            reports.append(sharded.write_skeleton(own, 0, path, self.backend))
            objects[own.name] = (own.keys, own.sizes)
        for d in dirs:  # the new files' directory entries are durable too
            self.backend.fsync_dir(d)
        self.backend.event("after-data")
        return _Written(reports, objects)

    def _commit(self, step: int, save_id: str, written: list[_Written],
                metadata: Mapping[str, Any] | None) -> None:
        reports = [r for w in written for r in w.reports]
        files = tuple(mf.FileEntry(r.root, r.name, r.size) for r in reports)
        index = {(r.root, r.name): i for i, r in enumerate(reports)}
        objects: dict[str, mf.ObjectEntry] = {}
        for w in written:
            for obj, (keys, sizes) in w.objects.items():
                skel = next(r for r in reports if r.object == obj and r.skeleton_checksum is not None)
                data = [(index[(r.root, r.name)], r) for r in reports if r.object == obj and r.skeleton_checksum is None]
                objects[obj] = sharded.build_object(keys, sizes, index[(skel.root, skel.name)], skel, data)
        manifest = mf.Manifest(step, save_id, time.time(), self.comm.world_size, len(self.roots), files, objects,
                               user=dict(metadata or {}))
        step_path = os.path.join(self.roots[0], catalog.step_dir(step))
        # The commit point: the manifest is written last, after every rank's data is durable.
        catalog.write_atomic(step_path, mf.MANIFEST_NAME, manifest.to_json(), self.backend, events=True)
        self.backend.event("before-latest")
        try:
            catalog.write_atomic(self.roots[0], catalog.LATEST, f"{catalog.step_dir(step)}\n".encode(), self.backend)
            self.backend.event("after-latest")
        except OSError as e:  # committed anyway: readers fall back to the highest committed step
            logger.warning("fastpersist: checkpoint step %d is committed but %s could not be updated: %s",
                           step, os.path.join(self.roots[0], catalog.LATEST), e)

    def _is_committed(self, step: int, save_id: str) -> bool:
        try:
            return catalog.read_manifest(os.path.join(self.roots[0], catalog.step_dir(step))).save_id == save_id
        except CheckpointError:
            return False

    def _after_commit(self, step: int, written: list[_Written]) -> None:
        """Coordinator: drop files of an earlier save of the same step, then apply retention."""
        keep = {(r.root, r.name) for w in written for r in w.reports}
        catalog.remove_files(self.roots, step, "", keep=keep)
        committed = [e.step for e in catalog.scan(self.roots[0]) if e.committed]
        with self._lock:
            protected = {j.step for j in self._in_flight} | {step}
        for old in self.retention.to_delete(committed, catalog.read_latest(self.roots[0]), protected):
            catalog.remove_checkpoint(self.roots, old, self.backend)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every checkpoint in flight; raises the first failure not yet raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [j.handle for j in self._in_flight]
            if not pending:
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not pending[0]._done.wait(left):
                raise TimeoutError(f"checkpoint step {pending[0].step} is still in flight after {timeout} s")
        self._raise_failed()

    def close(self) -> None:
        """Wait for checkpoints in flight, stop the background thread, remove the guards."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join()
                self._worker = None
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
    # load

    def _resolve(self, step: int | str) -> int:
        if step == "latest":
            found = catalog.read_latest(self.roots[0])
            if found is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.roots[0]}")
            return found
        if isinstance(step, str):
            raise CheckpointError(f"step must be an integer or 'latest', got {step!r}")
        return step

    def _open(self, step: int | str) -> tuple[list[str], mf.Manifest]:
        s = self._resolve(step)
        name = catalog.step_dir(s)
        manifest = catalog.read_manifest(os.path.join(self.roots[0], name))
        return [os.path.join(r, name) for r in self.roots], manifest

    def load(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
             map_location: Any = None, weights_only: bool = True, verify: bool | None = None) -> Any:
        """Load the replicated state of a checkpoint (``"latest"`` by default), at any world size.

        With ``into`` (a dict of the same keys as the saved state), stateful objects are
        restored in place through ``load_state_dict``. Returns the loaded state.
        """
        dirs, manifest = self._open(step)
        return _load_object(dirs, manifest, mf.REPLICATED, into, map_location, weights_only, verify, self.config)

    def load_rank_state(self, step: int | str = "latest", rank: int | None = None, into: Mapping[str, Any] | None = None,
                        *, map_location: Any = None, weights_only: bool = True, verify: bool | None = None) -> Any:
        """Load the ``rank_state`` that ``rank`` (default: this rank) saved."""
        dirs, manifest = self._open(step)
        name = mf.rank_object(self.rank if rank is None else rank)
        return _load_object(dirs, manifest, name, into, map_location, weights_only, verify, self.config)

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint in the first root, committed or not, oldest first."""
        return list_checkpoints(self.roots[0])

    def latest_step(self) -> int | None:
        return catalog.read_latest(self.roots[0])


def _finish_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    """At interpreter exit, finish the checkpoints still in flight (the worker is a daemon
    thread: without this, a job that ends without close() would lose its last checkpoint)."""
    ck = ref()
    if ck is None or ck._worker is None:
        return
    try:
        ck.close()
    except Exception as e:  # noqa: BLE001 - exiting anyway; say what was lost
        logger.error("fastpersist: a checkpoint in flight at exit failed: %s", e)


def _load_object(dirs: list[str], manifest: mf.Manifest, name: str, into: Mapping[str, Any] | None,
                 map_location: Any, weights_only: bool, verify: bool | None, config: IOConfig) -> Any:
    do_verify = config.verify if verify is None else verify
    obj = sharded.read_object(dirs, manifest, name, map_location=map_location, weights_only=weights_only,
                              verify=do_verify, config=config)
    if into is not None:
        restore_into(obj, into, dirs[0])
    return obj


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """The checkpoints under ``root`` (the first root of a Checkpointer), oldest first."""
    latest = catalog.read_latest(root)
    out = []
    for e in catalog.scan(root):
        if not e.committed:
            out.append(CheckpointInfo(e.step, e.path, False))
            continue
        try:
            m = catalog.read_manifest(e.path)
        except CheckpointError as err:
            logger.warning("fastpersist: %s", err)
            out.append(CheckpointInfo(e.step, e.path, False))
            continue
        out.append(CheckpointInfo(e.step, e.path, True, e.step == latest, m.nbytes, len(m.files), m.created,
                                  m.world_size, tuple(sorted(m.objects))))
    return out


def load_checkpoint(path: str | os.PathLike[str], other_roots: Sequence[str | os.PathLike[str]] = (), *,
                    rank: int | None = None, map_location: Any = None, weights_only: bool = True,
                    verify: bool | None = None, config: IOConfig | None = None) -> Any:
    """Load a checkpoint from its directory in the first root, without a Checkpointer.

    ``other_roots`` are the checkpoint's other roots, in order (their directory of the same
    name is used). ``rank`` selects a rank's own state instead of the replicated one.
    """
    first = os.path.abspath(os.fspath(path))
    name = os.path.basename(first.rstrip(os.sep))
    dirs = [first] + [os.path.join(os.path.abspath(os.fspath(r)), name) for r in other_roots]
    manifest = catalog.read_manifest(first)
    obj = mf.REPLICATED if rank is None else mf.rank_object(rank)
    return _load_object(dirs, manifest, obj, None, map_location, weights_only, verify, config or get_config())
