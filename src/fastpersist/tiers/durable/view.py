"""Reading the durable tier: ``fastpersist.open("s3://bucket/prefix")``.

A durable copy is a one-root checkpoint (see :mod:`fastpersist.tiers.durable.drain`). In a directory
(a shared filesystem) it is read in place by a :class:`~fastpersist.loading.view.CheckpointView`. In
object storage, :class:`DurableView` lists the manifests there and, to load or verify a step,
fetches its objects (ranged reads, several in flight) into a private local directory, reads it
with the same loader (every checksum verified, any world size, resharding, ``keys=``) and
removes the directory. Errors name the objects, not the local copy.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastpersist.storage import catalog
from fastpersist import timeline
from fastpersist.config import IOConfig
from fastpersist.tiers.durable.drain import read_commits
from fastpersist.tiers.durable.store import DirStore, Store, open_store
from fastpersist.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from fastpersist.format import manifest as mf
from fastpersist.storage.backend import FileBackend
from fastpersist.objects.verify import Problem
from fastpersist.loading.view import CheckpointInfo, CheckpointView, TensorInfo, resolve_step, tensor_infos

logger = logging.getLogger(__name__)

FETCH_THREADS = 8


class DurableView(CheckpointView):
    """Read-only access to the checkpoints drained to object storage.

    Args:
        location: an ``s3://bucket/prefix`` URL (endpoint and credentials from the client's
            standard environment) or a :class:`~fastpersist.tiers.durable.store.Store`.
        config: I/O settings for reading the fetched copy.
        staging: the local directory fetched checkpoints pass through, created if need be
            (default: the system's temporary directory; a Checkpointer passes its first root);
            each load removes its copy when it ends.
        backend: the file seam of the local copy: the fetch writes it, and the load reads
            it, through ``backend`` (default: real files; see :mod:`fastpersist.storage.faults`).
    """

    def __init__(self, location: str | Store, *, config: IOConfig | None = None, staging: str | None = None,
                 backend: FileBackend | None = None) -> None:
        self.store = open_store(location)
        self.url = self.store.url
        self.roots = [self.url]
        self._config = config
        self.backend = backend or FileBackend()  # for the fetched copy
        self.staging = staging

    def _commits(self) -> dict[int, timeline.Commit]:
        return {c.step: c for c in read_commits(self.store)}

    def latest_step(self) -> int | None:
        return timeline.latest(self._commits().values())

    def _resolve(self, step: int | str) -> int:
        if step == "latest":
            found = self.latest_step()
            if found is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.url}")
            return found
        return resolve_step(self.url, step)  # a number: checked as every view checks it

    def manifest(self, step: int | str = "latest") -> mf.Manifest:
        s = self._resolve(step)
        key = f"{catalog.step_dir(s)}/{mf.MANIFEST_NAME}"
        try:
            raw = self.store.get(key, mf.MAX_MANIFEST_BYTES)
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(f"no committed checkpoint step {s} in {self.url} ({e})") from e
        return mf.parse(self.store.where(key), raw)

    def metadata(self, step: int | str = "latest") -> dict[str, Any]:
        return dict(self.manifest(step).user)

    def tensors(self, step: int | str = "latest") -> builtins.list[TensorInfo]:
        return tensor_infos(self.manifest(step))

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every checkpoint in the durable tier, by step (incomplete drains too, not committed)."""
        keys = self.store.list("")
        steps = sorted({s for k in keys if (s := catalog.parse_step_dir(k.split("/", 1)[0])) is not None})
        manifests: dict[int, mf.Manifest] = {}
        for s in steps:
            if f"{catalog.step_dir(s)}/{mf.MANIFEST_NAME}" in keys:
                try:
                    manifests[s] = self.manifest(s)
                except CheckpointError:
                    continue
        commits = [timeline.Commit(s, m.sequence, m.created) for s, m in manifests.items()]
        dead, latest = timeline.abandoned_steps(commits), timeline.latest(commits)
        out = []
        for s in steps:
            path = self.store.where(catalog.step_dir(s))
            m = manifests.get(s)
            out.append(CheckpointInfo(s, path, False) if m is None else
                       CheckpointInfo(s, path, True, s == latest, m.nbytes, len(m.files), m.created, m.world_size,
                                      tuple(sorted(m.objects)), s in dead, m.sequence))
        return out

    # ------------------------------------------------------------------------------------
    # reading a step: fetched, then read like a local checkpoint

    def missing(self, manifest: mf.Manifest) -> builtins.list[Problem]:
        """The objects of ``manifest`` that are missing or shorter than it lists (one listing)."""
        prefix = catalog.step_dir(manifest.step)
        have = self.store.list(f"{prefix}/")
        out = []
        for f in manifest.files:
            key = f"{prefix}/{f.name}"
            size = have.get(key)
            if size is None or size < f.size:
                out.append(Problem(self.store.where(key), "file", None,
                                   "missing: the checkpoint lists it" if size is None else
                                   f"truncated: {size} bytes, the manifest says {f.size}"))
        return out

    def fetch(self, step: int | str, root: str | os.PathLike[str], *,
              progress: Callable[[int], None] | None = None) -> int:
        """Copy a durable checkpoint into the local checkpoint root ``root`` (its manifest
        written last, so an interrupted fetch is an incomplete checkpoint); returns its step.
        ``progress``, if given, hears the byte count of each piece downloaded (from several
        threads). A missing or short object is a CorruptCheckpointError naming it."""
        manifest = self.manifest(step)
        problems = self.missing(manifest)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CorruptCheckpointError(f"{problems[0].path} is {problems[0].message}{more}")
        d = os.path.join(os.fspath(root), catalog.step_dir(manifest.step))
        files = self.backend
        files.makedirs(d)
        jobs = [(f.name, f.size) for f in manifest.files]
        errors: builtins.list[BaseException] = []
        lock = threading.Lock()

        def one(item: tuple[str, int]) -> None:
            name, size = item
            key = f"{catalog.step_dir(manifest.step)}/{name}"
            try:
                path = os.path.join(d, name)
                try:  # a new file, never written through a name another checkpoint shares (hard links)
                    files.unlink(path)
                except FileNotFoundError:
                    pass
                file = files.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "off", 0)
                try:
                    pos = 0
                    for data in self.store.chunks(key, size):
                        files.pwrite(file, data, pos)
                        pos += memoryview(data).nbytes
                        if progress is not None:
                            progress(len(data))
                    files.fsync(file)
                finally:
                    file.close()
            except BaseException as e:  # noqa: BLE001 - gathered, the first is raised
                with lock:
                    errors.append(e)

        with ThreadPoolExecutor(max_workers=min(FETCH_THREADS, max(1, len(jobs))),
                                thread_name_prefix="fastpersist-fetch") as ex:
            list(ex.map(one, sorted(jobs, key=lambda j: -j[1])))
        if errors:
            e = errors[0]
            if isinstance(e, CheckpointNotFoundError):  # deleted since the listing
                raise CorruptCheckpointError(f"{e}: checkpoint step {manifest.step} lists it") from e
            if isinstance(e, CheckpointError):
                raise e
            raise CheckpointError(f"cannot fetch checkpoint step {manifest.step} from {self.url}: {e}") from e
        catalog.write_atomic(d, mf.MANIFEST_NAME, manifest.to_json(), files)
        return manifest.step

    @contextlib.contextmanager
    def _fetched(self, step: int | str,
                 progress: Callable[[int], None] | None = None) -> Iterator[tuple[CheckpointView, str]]:
        # in the staging directory, created if need be (a Checkpointer's first root: fast, and a
        # copy a crash leaves there is removed by the root's clean start), else the system's
        # temporary one
        staging = self.staging
        files = self.backend
        if staging is not None and not files.is_dir(staging):
            try:  # a Checkpointer's first root, not created yet (new machines): its place is here
                files.makedirs(staging)
            except OSError:
                staging = None
        top = files.make_temp_dir(".fastpersist-tmp-fetch-", staging)
        try:
            s = self.fetch(step, top, progress=progress)
            local = os.path.join(top, catalog.step_dir(s))
            try:
                yield CheckpointView(top, config=self._config, backend=files), local
            except CheckpointError as e:  # name the objects, not the private copy
                raise type(e)(str(e).replace(local, self.store.where(catalog.step_dir(s)))) from e
        finally:
            _remove_copy(files, top)

    def load(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
             keys: Iterable[str] | None = None, map_location: Any = None, weights_only: bool = True,
             verify: bool | None = None) -> Any:
        """Load a drained checkpoint (see :meth:`fastpersist.loading.view.CheckpointView.load`).

        For ``"latest"``, a checkpoint found damaged (a checksum that fails, an object missing
        or truncated) is reported in the log and the next older one of the live timeline is
        loaded instead; the error names every step tried when none loads. A step asked for
        by number is that step or an error."""
        steps: builtins.list[int | str] = [step] if step != "latest" else \
            builtins.list(reversed(timeline.live_steps(self._commits().values())))
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.url}")
        errors: builtins.list[str] = []
        for s in steps:
            try:
                with self._fetched(s) as (view, _):
                    return view.load("latest", into, keys=keys, map_location=map_location,
                                     weights_only=weights_only, verify=verify)
            except CorruptCheckpointError as e:
                if step != "latest":
                    raise
                errors.append(str(e))
                logger.warning("durable checkpoint step %s cannot be loaded: %s; trying the next older one", s, e)
        raise CorruptCheckpointError(f"no checkpoint of {self.url} could be loaded: {'; '.join(errors)}")

    def load_rank_state(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
                        rank: int | None = None, map_location: Any = None, weights_only: bool = True,
                        verify: bool | None = None) -> Any:
        with self._fetched(step) as (view, _):
            return view.load_rank_state("latest", into, rank=rank, map_location=map_location,
                                        weights_only=weights_only, verify=verify)

    def verify(self, step: int | str = "latest", *,
               progress: Callable[[int], None] | None = None) -> builtins.list[Problem]:
        """Fetch ``step`` and check every checksum; the problems found, naming the objects.
        ``progress`` hears the bytes downloaded."""
        missing = self.missing(self.manifest(step))
        if missing:
            return missing
        with self._fetched(step, progress) as (view, local):
            problems = view.verify("latest")
            where = self.store.where(os.path.basename(local))
            return [Problem(p.path.replace(local, where), p.what, p.offset, p.message.replace(local, where))
                    for p in problems]


def _remove_copy(files: FileBackend, top: str) -> None:
    """Remove a fetched copy (best effort: what is left is removed by the root's clean start)."""
    def warn(path: str, e: OSError) -> None:
        logger.warning("could not remove %s (a fetched copy): %s", path, e.strerror or e)

    try:
        files.rmtree(top, warn)
    except OSError as e:
        warn(top, e)


def durable_view(durable: str | os.PathLike[str] | Store, config: IOConfig | None,
                 staging: str | None = None, backend: FileBackend | None = None) -> CheckpointView | DurableView:
    """Read-only access to a durable tier: a directory is a checkpoint root like any other;
    object storage is fetched through ``staging`` (see :class:`DurableView`). ``backend``: the
    file seam of local files (default: real files)."""
    store = open_store(durable)
    if isinstance(store, DirStore):
        return CheckpointView(store.url, config=config, backend=backend if backend is not None else store.backend)
    return DurableView(store, config=config, staging=staging, backend=backend)
