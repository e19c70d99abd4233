"""The drain: committed checkpoints copied from the node-local roots to the durable tier.

After a checkpoint is committed locally, every rank that wrote files for it uploads them, in a
thread of its own (one per Checkpointer, nice'd), at a bounded bandwidth, off the save path:

1. each file is read from the local root and every extent's checksum is checked as it goes by
   (a damaged local copy is never uploaded), uploaded (multipart, several parts in flight),
   then read back from the durable tier and checked again (what is there is what was written);
2. a rank other than 0 then puts a small marker, ``step-N/_drain/<save id>.rank-<r>``, naming
   what it uploaded;
3. rank 0, once it has uploaded its own files and found every writer's marker, checks that
   every file of the checkpoint is there with its size, and writes the durable copy's manifest
   **last**, create-if-absent: a drain killed at any instant leaves no manifest, so it never
   looks complete. Then it applies the durable tier's retention and removes the markers.

The durable copy is a one-root checkpoint: the local manifest with every file renamed into
the step's one directory (``root<i>-<name>`` for root ``i > 0``), its extents and checksums
unchanged. The drain issues no collective (it never touches a process group); which steps are
drained, rank 0 decides before its local commit and every rank learns from the commit's
all-gather (see :meth:`Drainer.take`). A failure is logged and set on the save handle's
``durable`` future; it never fails training or a save, and the local copy it came from is kept
(retention spares it) until the drain ends.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

from fastpersist.storage import catalog
from fastpersist import timeline
from fastpersist.options import Retention
from fastpersist.tiers.durable.store import PART_BYTES, Store, StoreAccessError, StoreError
from fastpersist.errors import ChecksumMismatchError, CheckpointError
from fastpersist.format import manifest as mf
from fastpersist.objects.write import FileReport
from fastpersist.storage.backend import REAL_FILES, FileBackend

logger = logging.getLogger(__name__)

DRAIN_DIR = "_drain"
FAILED = ".failed"  # a rank's marker that its part of the drain failed (holds the error)
ATTEMPTS = 5  # uploads of one file before the drain of a step fails (a server restart takes a while)
BACKOFF_S = (1.0, 5.0, 15.0, 30.0)
QUEUE = 2  # drains in flight on rank 0 (one running, one waiting); a due step beyond is skipped


def durable_name(root: int, name: str) -> str:
    """A file's name in the durable copy (one directory for all the checkpoint's roots)."""
    return name if root == 0 else f"root{root}-{name}"


@dataclass(frozen=True)
class DrainFile:
    """One file a rank uploads: where it lies locally and its checksummed ranges."""

    root: int
    name: str
    size: int
    ranges: tuple[tuple[int, int, int], ...]  # (file offset, nbytes, xxh3-64)


@dataclass
class DrainTask:
    step: int
    save_id: str
    files: list[DrainFile]
    writers: list[int]  # the ranks that wrote files (rank 0 waits for their markers)
    future: cf.Future[bool]


class RangeChecker:
    """Checks the checksummed ranges of a file as its bytes stream by, in order."""

    def __init__(self, ranges: Sequence[tuple[int, int, int]], where: str) -> None:
        self.ranges = sorted(ranges)
        self.where = where
        self._next = 0  # the first range not yet complete
        self._hash = xxhash.xxh3_64()

    def feed(self, pos: int, data: bytes | memoryview) -> None:
        end = pos + len(data)
        view = memoryview(data)
        while self._next < len(self.ranges):
            off, n, want = self.ranges[self._next]
            if off >= end:
                return
            lo, hi = max(off, pos), min(off + n, end)
            if hi > lo:
                self._hash.update(view[lo - pos: hi - pos])
            if off + n > end:
                return
            if self._hash.intdigest() != want:
                raise ChecksumMismatchError(f"{self.where}: bytes {off}..{off + n} fail their checksum "
                                            f"(stored {want:016x}, read {self._hash.intdigest():016x})")
            self._hash.reset()
            self._next += 1

    def finish(self) -> None:
        if self._next < len(self.ranges):
            off, n, _ = self.ranges[self._next]
            raise CheckpointError(f"{self.where}: ended before bytes {off}..{off + n}")


class Throttle:
    """A token bucket: at most ``rate`` bytes per second on average (None: unbounded)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._start = time.monotonic()
        self._bytes = 0

    def take(self, nbytes: int) -> None:
        if not self.rate:
            return
        self._bytes += nbytes
        ahead = self._bytes / self.rate - (time.monotonic() - self._start)
        if ahead > 0:
            time.sleep(ahead)
        elif ahead < -1.0:  # idle for a while: no burst credit beyond one second
            self._start, self._bytes = time.monotonic() - 1.0, 0


class Drainer:
    """One Checkpointer's drain on one rank: a queue and a thread."""

    def __init__(self, store: Store, roots: Sequence[str], rank: int, *, every: int, keep: int | None,
                 abandoned: str, bandwidth: float | None, timeout_s: float, nice: int = 10,
                 ended: Callable[[], None] | None = None, backend: FileBackend | None = None) -> None:
        self.store = store
        self.roots = list(roots)
        self.backend = backend or REAL_FILES  # the local roots' file seam: the files uploaded are read through it
        self.rank = rank
        self.every = every
        self.retention = Retention(keep, None, abandoned)
        self.bandwidth = bandwidth
        self.timeout_s = timeout_s
        self.nice = nice
        self._last: int | None = None  # the last step drained (queued)
        self.skipped = 0  # due steps not drained because the queue was full (rank 0)
        self._lock = threading.Lock()
        self._active: collections.Counter[int] = collections.Counter()  # steps taken, queued or draining
        self._executor: cf.ThreadPoolExecutor | None = None
        self._commits: dict[int, timeline.Commit] | None = None  # rank 0: the durable tier's
        self._read: cf.Future[dict[int, timeline.Commit]] | None = None
        # called (rank 0, drain thread) when a drain ends: the local retention it held back may run
        self.ended = ended

    # ------------------------------------------------------------------------------------
    # the save's side (in the save driver's worker)

    def due(self, step: int) -> bool:
        """Whether ``step`` is due: the first checkpoint, then the first at least ``every``
        steps after the last drained (or below it: a new timeline)."""
        return self._last is None or step >= self._last + self.every or step <= self._last

    def take(self, step: int) -> bool:
        """Rank 0, before committing ``step``: whether to drain it. A due step is skipped while
        one drain runs and another waits (the queue stays bounded when drains are slower than
        saves; the next due step is taken as soon as there is room). A step taken is marked:
        retention spares its local copy, and the drain's clean-up its durable directory, from
        now until its drain ends."""
        if not self.due(step):
            return False
        with self._lock:
            if self._active.total() >= QUEUE:
                self.skipped += 1
                logger.info("checkpoint step %d is not drained: %d drains are still in flight", step,
                            self._active.total())
                return False
            self._active[step] += 1
        return True

    def forget(self, step: int) -> None:
        """One drain of ``step`` (taken, queued or running) is over."""
        with self._lock:
            self._active[step] -= 1
            if self._active[step] <= 0:
                del self._active[step]

    def pending(self) -> set[int]:
        with self._lock:
            return set(self._active)

    def submit(self, step: int, save_id: str, files: list[DrainFile], writers: list[int],
               future: cf.Future[bool]) -> None:
        """Queue the drain of ``step`` (committed locally); ``future`` hears how it ended."""
        self._last = step
        with self._lock:
            if self.rank != 0:  # rank 0 counted it when it took it
                self._active[step] += 1
            try:
                self._thread().submit(self._run, DrainTask(step, save_id, files, writers, future))
            except BaseException:  # never queued: no longer held back (taken, on rank 0)
                self._active[step] -= 1
                if self._active[step] <= 0:
                    del self._active[step]
                raise

    def _thread(self) -> cf.ThreadPoolExecutor:
        if self._executor is None:  # under self._lock
            self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="fastpersist-drain",
                                                   initializer=_lower_priority, initargs=(self.nice,))
        return self._executor

    def read_ahead(self) -> None:
        """Rank 0: start reading what the durable tier holds (its commit order), in the
        drain's thread, so that the first commit does not wait for the network."""
        with self._lock:
            self._read = self._thread().submit(self._durable)

    def close(self) -> None:
        """Finish the drains queued (as close() finishes saves) and stop the thread."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _durable(self) -> dict[int, timeline.Commit]:
        """The checkpoints committed in the durable tier (rank 0, drain thread; read once)."""
        with self._lock:
            known = self._commits
        if known is None:
            known = {c.step: c for c in read_commits(self.store)}
            with self._lock:
                self._commits = known
        return known

    def known_commits(self, timeout_s: float = 30.0) -> list[timeline.Commit]:
        """What :meth:`read_ahead` found (waiting at most ``timeout_s``); empty, with a warning,
        if the durable tier could not be read: commit sequences then continue from the local
        roots' alone."""
        read, self._read = self._read, None  # waited for once
        if read is not None:
            try:
                read.result(timeout_s)
            except Exception as e:  # noqa: BLE001 - the drains report their own failures
                logger.warning("cannot read the durable tier %s yet (%s): commit order continues from the local "
                               "roots until a drain reads it (a drain never commits there out of order)",
                               self.store.url, e)
        with self._lock:
            return list((self._commits or {}).values())

    # ------------------------------------------------------------------------------------
    # the drain thread

    def _run(self, task: DrainTask) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = self._upload_all(task)
            if self.rank == 0:
                self._commit(task)
            elif task.files:
                marker = json.dumps({"rank": self.rank, "files": [[durable_name(f.root, f.name), f.size]
                                                                  for f in task.files]}).encode()
                self.store.put(_marker(task, self.rank), marker)
            dt = time.perf_counter() - t0
            logger.info("checkpoint step %d drained to %s: %.1f MiB from this rank in %.2f s%s", task.step,
                        self.store.url, nbytes / 2**20, dt, " (committed there)" if self.rank == 0 else "")
            task.future.set_result(True)
        except BaseException as e:  # noqa: BLE001 - reported on the handle and logged, never raised
            if self.rank != 0 and task.files:  # rank 0 stops waiting for this rank's part (best effort)
                try:
                    self.store.put(_marker(task, self.rank) + FAILED, str(e).encode()[:4096])
                except Exception:  # noqa: BLE001 - rank 0 then waits until its timeout
                    pass
            logger.warning("checkpoint step %d could not be drained to the durable tier %s: %s; it stays committed "
                           "locally, and a later step is drained when due", task.step, self.store.url, e)
            task.future.set_exception(e)
        finally:
            self.forget(task.step)
            if self.ended is not None:
                try:
                    self.ended()
                except Exception as e:  # noqa: BLE001 - retention is best effort
                    logger.warning("retention after the drain of checkpoint step %d failed: %s", task.step, e)

    def _upload_all(self, task: DrainTask) -> int:
        throttle = Throttle(self.bandwidth)
        for f in task.files:
            for attempt in range(ATTEMPTS):
                try:
                    self._upload(task, f, throttle)
                    break
                except _SourceFailed as e:
                    raise e.error from None  # the local copy is damaged or gone: another attempt reads the same
                except StoreAccessError:
                    raise  # the credentials were refused: a retry within seconds will not help
                except (StoreError, OSError, CheckpointError) as e:
                    if attempt + 1 == ATTEMPTS:
                        raise
                    wait = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
                    logger.info("checkpoint step %d: uploading %s failed (%s); again in %.0f s", task.step, f.name,
                                e, wait)
                    time.sleep(wait)
        return sum(f.size for f in task.files)

    def _upload(self, task: DrainTask, f: DrainFile, throttle: Throttle) -> None:
        d = catalog.step_dir(task.step)
        local = os.path.join(self.roots[f.root], d, f.name)
        key = f"{d}/{durable_name(f.root, f.name)}"
        source = RangeChecker(f.ranges, local)
        failure: list[BaseException] = []

        def chunks() -> Iterator[bytes]:
            try:
                file = self.backend.open_read(local, "off")
            except BaseException as e:
                failure.append(e)
                raise
            try:
                pos = 0
                while pos < f.size:
                    try:
                        data = self.backend.pread(file, pos, min(PART_BYTES, f.size - pos))
                    except OSError as e:
                        raise CheckpointError(f"cannot read {local} at offset {pos} to upload it: "
                                              f"{e.strerror or e}") from e
                    if not data:
                        raise CheckpointError(f"{local} is truncated: {pos} bytes, {f.size} expected")
                    source.feed(pos, data)
                    throttle.take(len(data))
                    pos += len(data)
                    yield data
                source.finish()
                if hasattr(os, "posix_fadvise"):  # the upload's reads leave the page cache to training
                    os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except BaseException as e:
                failure.append(e)
                raise
            finally:
                file.close()

        try:
            self.store.put_file(key, chunks(), f.size)
        except BaseException:
            if failure:
                raise _SourceFailed(failure[0]) from None
            raise
        if failure:
            raise _SourceFailed(failure[0])
        back = RangeChecker(f.ranges, self.store.where(key))
        pos = 0
        for data in self.store.chunks(key, f.size):
            back.feed(pos, data)
            throttle.take(len(data))
            pos += len(data)
        back.finish()

    def _commit(self, task: DrainTask) -> None:
        """Rank 0: every writer's files are there; write the durable manifest last."""
        d = catalog.step_dir(task.step)
        local = catalog.read_manifest(os.path.join(self.roots[0], d))
        if local.save_id != task.save_id:
            raise CheckpointError(f"checkpoint step {task.step} was saved again before its drain finished")
        want = {_marker(task, r) for r in task.writers if r != 0}
        deadline = time.monotonic() + self.timeout_s
        pause = 0.05
        while True:
            present = self.store.list(f"{d}/")
            failed = sorted(k for k in present if k.endswith(FAILED) and task.save_id in k)
            if failed:
                why = self.store.get(failed[0], 4096).decode(errors="replace")
                raise CheckpointError(f"checkpoint step {task.step}: rank {_rank(failed[0][:-len(FAILED)])} could "
                                      f"not upload its part: {why}")
            missing = want - set(present)
            if not missing:
                break
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint step {task.step}: ranks {sorted(_rank(m) for m in missing)} did "
                                      f"not finish their part of the drain within {self.timeout_s:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
        manifest = durable_manifest(local)
        commits = dict(self._durable())  # before the commit: a failure here leaves nothing half done
        newer = [c for c in commits.values() if c.step != task.step and c.sequence >= manifest.sequence]
        if manifest.sequence and newer:  # the local commit order began before the durable tier was read
            top = max(newer, key=lambda c: c.sequence)
            raise CheckpointError(f"checkpoint step {task.step} (commit sequence {manifest.sequence}) would come "
                                  f"before step {top.step} (sequence {top.sequence}) in the durable tier, which was "
                                  "not readable when this job started; later steps are drained in order")
        names = {k[len(d) + 1:]: size for k, size in present.items()}
        for entry in manifest.files:
            if names.get(entry.name) != entry.size:
                have = names.get(entry.name)
                raise CheckpointError(f"{self.store.where(d + '/' + entry.name)}: "
                                      f"{'missing' if have is None else f'{have} bytes'}, the checkpoint lists "
                                      f"{entry.size} bytes")
        key = f"{d}/{mf.MANIFEST_NAME}"
        if not self.store.put_new(key, manifest.to_json()):
            old = mf.parse(self.store.where(key), self.store.get(key, mf.MAX_MANIFEST_BYTES))
            if old.save_id != manifest.save_id:  # the step was saved again (a new timeline)
                self.store.delete(key)
                if not self.store.put_new(key, manifest.to_json()):
                    raise CheckpointError(f"{self.store.where(key)}: another drain committed this step meanwhile")
        keep = {f"{d}/{e.name}" for e in manifest.files} | {key}
        for k in present:  # markers, and files of an earlier drain of the same step
            if k not in keep:
                _quietly(self.store.delete, k)
        commits[task.step] = timeline.Commit(task.step, manifest.sequence, manifest.created)
        with self._lock:
            self._commits = commits
        self._apply_retention(task.step, commits)

    def _apply_retention(self, step: int, commits: dict[int, timeline.Commit]) -> None:
        """The durable tier's retention (never the step just drained, the latest there), and
        the leftovers of drains that were killed (steps without a manifest, not in flight)."""
        victims = self.retention.to_delete(list(commits.values()), {step})
        try:
            present = self.store.list("")
        except CheckpointError as e:
            logger.warning("durable retention skipped: %s", e)
            return
        by_step, leftovers = _leftovers(present, self.pending())
        for s in sorted(set(victims) | leftovers):
            manifest = f"{catalog.step_dir(s)}/{mf.MANIFEST_NAME}"
            try:
                self.store.delete(manifest)  # first: it stops being a checkpoint
            except CheckpointError as e:
                logger.warning("durable retention could not delete checkpoint step %d: %s", s, e)
                continue
            with self._lock:
                commits.pop(s, None)
            for k in by_step.get(s, []):
                if k != manifest:
                    _quietly(self.store.delete, k)


def _leftovers(keys: Iterable[str], draining: set[int]) -> tuple[dict[int, list[str]], set[int]]:
    """The durable tier's keys by step, and the steps whose drain was killed: objects without
    a manifest, not being drained now."""
    by_step: dict[int, list[str]] = {}
    for k in keys:
        s = catalog.parse_step_dir(k.split("/", 1)[0])
        if s is not None:
            by_step.setdefault(s, []).append(k)
    committed = {s for s, ks in by_step.items() if f"{catalog.step_dir(s)}/{mf.MANIFEST_NAME}" in ks}
    return by_step, {s for s in by_step if s not in committed and s not in draining}


class _SourceFailed(Exception):
    """The local copy could not be read or is damaged (``error``): not worth another attempt,
    unlike a failure of the upload or of the read-back (a byte damaged on the way is retried)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _marker(task: DrainTask, rank: int) -> str:
    return f"{catalog.step_dir(task.step)}/{DRAIN_DIR}/{task.save_id}.rank-{rank}"


def _rank(marker: str) -> int:
    return int(marker.rsplit("-", 1)[1])


def _quietly(fn: object, key: str) -> None:
    try:
        fn(key)  # type: ignore[operator]
    except CheckpointError as e:
        logger.warning("%s", e)


def _lower_priority(nice: int) -> None:
    """The drain thread runs at a lower CPU priority than training (Linux: per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def durable_manifest(local: mf.Manifest) -> mf.Manifest:
    """The durable copy's manifest: one root, the files renamed into it (no root path: the
    copy is read wherever it is), all else unchanged."""
    files = tuple(mf.FileEntry(0, durable_name(f.root, f.name), f.size, f.node) for f in local.files)
    return dataclasses.replace(local, roots=1, files=files, root_paths=())


def read_commits(store: Store) -> list[timeline.Commit]:
    """The checkpoints committed in ``store`` (damaged manifests skipped with a warning)."""
    out = []
    for key in sorted(store.list("")):
        parts = key.split("/")
        if len(parts) != 2 or parts[1] != mf.MANIFEST_NAME:
            continue
        step = catalog.parse_step_dir(parts[0])
        if step is None:
            continue
        try:
            m = mf.parse(store.where(key), store.get(key, mf.MAX_MANIFEST_BYTES))
        except CheckpointError as e:
            logger.warning("%s", e)
            continue
        out.append(timeline.Commit(step, m.sequence, m.created))
    return out


def drain_files(reports: Sequence[FileReport]) -> list[DrainFile]:
    """What one rank uploads: the files of its save report, with their checksummed ranges."""
    out = []
    for r in reports:
        if r.skeleton_checksum is not None:  # a skeleton file: one checksum over the whole file
            ranges: tuple[tuple[int, int, int], ...] = ((0, r.size, r.skeleton_checksum),)
        else:
            ranges = tuple((e.offset, e.nbytes, e.checksum) for e in r.extents)
        out.append(DrainFile(r.root, r.name, r.size, ranges))
    return out
