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
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastpersist import catalog, sharded
from fastpersist.config import IOConfig, get_config
from fastpersist.dist import Comm, agree, default_comm, host_name, writer_ranks
from fastpersist.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError
from fastpersist.format import manifest as mf
from fastpersist.io.backend import FileBackend
from fastpersist.io.buffers import shared_pool
from fastpersist.plan import Extent, plan, plan_digest
from fastpersist.state import restore_into, to_saveable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveStats:
    """What one save did, on this rank and overall."""

    step: int
    bytes_total: int  # data bytes in the checkpoint (all objects, all ranks)
    bytes_written: int  # data bytes this rank wrote
    bytes_per_root: dict[int, int]  # data bytes this rank wrote, per root index
    seconds: float  # wall time of the whole save on this rank (until committed)
    write_seconds: float  # of which writing this rank's files

    @property
    def gbps(self) -> float:
        """Checkpoint bytes per second of save time, in GB/s."""
        return self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else 0.0


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


class Checkpointer:
    """Save and load sharded checkpoints under one or more roots (one per SSD).

    ``roots``: directories (one path or a list), the same list on every rank; each rank writes
    its share to its node's roots. ``writers``: who writes replicated state, ``"all"`` ranks
    (default), ``"node"`` (one per host), ``N`` (the first N ranks of each host) or a list of
    ranks. ``keep``: how many committed checkpoints to keep (None keeps all). ``comm`` and
    ``backend`` are the coordination and file seams (defaults: a private gloo group when
    torch.distributed is initialised, and real files). Every rank must construct the
    Checkpointer, in the same order relative to other process-group creation.
    """

    def __init__(
        self,
        roots: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        keep: int | None = None,
        writers: str | int | Sequence[int] = "all",
        comm: Comm | None = None,
        backend: FileBackend | None = None,
        config: IOConfig | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        paths = [roots] if isinstance(roots, (str, os.PathLike)) else list(roots)
        if not paths:
            raise CheckpointError("a Checkpointer needs at least one root directory")
        self.roots = [os.path.abspath(os.fspath(r)) for r in paths]
        if keep is not None and keep < 1:
            raise CheckpointError(f"keep must be at least 1 (or None to keep all), got {keep}")
        self.keep = keep
        self.comm = comm if comm is not None else default_comm(timeout_s)
        self.backend = backend or FileBackend()
        self._config = config
        hosts = self.comm.all_gather(host_name())
        self.writer_ranks = writer_ranks(writers, hosts)
        for root in self.roots:
            try:
                self.backend.makedirs(root)
            except OSError as e:
                raise CheckpointWriteError(f"cannot create checkpoint root {root}: {e.strerror or e}") from e

    @property
    def config(self) -> IOConfig:
        return self._config or get_config()

    @property
    def rank(self) -> int:
        return self.comm.rank

    # -----------------------------------------------------------------------------------------
    # save

    def save(self, step: int, state: Any, *, rank_state: Any = None,
             metadata: Mapping[str, Any] | None = None) -> SaveStats:
        """Save a checkpoint of ``state`` as step ``step`` (a collective: call on every rank).

        ``state`` must be the same on every rank (replicated: model weights, optimizer state of
        a data-parallel job, the step); it is written once, split over all writers. Pass what
        differs per rank (a rank's optimizer shard, its RNG state) as ``rank_state``: each rank
        writes its own. Stateful objects are saved through their ``state_dict()``.
        ``metadata`` (JSON-serializable) is stored in the manifest. Returns when the checkpoint
        is committed; raises :class:`CheckpointWriteError` on every rank if any rank fails.
        """
        start = time.perf_counter()
        name = catalog.step_dir(step)
        rep = sharded.prepare(mf.REPLICATED, to_saveable(state))
        own = sharded.prepare(mf.rank_object(self.rank), to_saveable(rank_state)) if rank_state is not None else None
        slots = [(r, j) for r in self.writer_ranks for j in range(len(self.roots))]
        digest = plan_digest(rep.sizes, len(slots), extra=rep.skeleton_checksum.to_bytes(8, "big"))
        proposals = agree(self.comm, f"preparing checkpoint step {step}", lambda: (digest, secrets.token_hex(6)))
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
                            lambda: self._write(name, save_id, rep, own, extents, slots))
            write_seconds = time.perf_counter() - t_write
            agree(self.comm, f"committing checkpoint step {step}",
                  lambda: self._commit(step, save_id, written, metadata) if self.rank == 0 else None)
        except CheckpointError:
            if not self._is_committed(step, save_id):  # a failure after the commit point keeps the files
                catalog.remove_files(self.roots, step, f"{save_id}-")
            raise
        if self.rank == 0:
            self._after_commit(step, save_id, written)
        mine = written[self.rank].reports
        per_root: dict[int, int] = {}
        for r in mine:
            per_root[r.root] = per_root.get(r.root, 0) + sum(e.nbytes for e in r.extents)
        total = sum(e.nbytes for w in written for r in w.reports for e in r.extents)
        stats = SaveStats(step, total, sum(per_root.values()), per_root, time.perf_counter() - start, write_seconds)
        logger.info("fastpersist: checkpoint step %d committed: %.1f MB in %.3f s (%.2f GB/s), this rank wrote %.1f MB",
                    step, total / 1e6, stats.seconds, stats.gbps, stats.bytes_written / 1e6)
        return stats

    def _write(self, name: str, save_id: str, rep: sharded.Prepared, own: sharded.Prepared | None,
               extents: list[Extent], slots: list[tuple[int, int]]) -> _Written:
        cfg = self.config
        pool = shared_pool(cfg.chunk_bytes, cfg.num_buffers)
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
            reports += sharded.write_slots(rep, jobs, self.backend, cfg, pool)
        if self.rank == 0:
            path = os.path.join(dirs[0], f"{save_id}-{rep.name}.skel")
            reports.append(sharded.write_skeleton(rep, 0, path, self.backend))
            objects[rep.name] = (rep.keys, rep.sizes)
        if own is not None:
            own_extents = plan(own.sizes, len(self.roots))
            own_jobs = [([e for e in own_extents if e.slot == j], j,
                         os.path.join(dirs[j], f"{save_id}-{own.name}-{j:04d}.bin")) for j in range(len(self.roots))]
            reports += sharded.write_slots(own, own_jobs, self.backend, cfg, pool)
            path = os.path.join(dirs[0], f"{save_id}-{own.name}.skel")
            reports.append(sharded.write_skeleton(own, 0, path, self.backend))
            objects[own.name] = (own.keys, own.sizes)
        for d in dirs:  # the new files' directory entries are durable too
            self.backend.fsync_dir(d)
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
        catalog.write_atomic(step_path, mf.MANIFEST_NAME, manifest.to_json(), self.backend)
        try:
            catalog.write_atomic(self.roots[0], catalog.LATEST, f"{catalog.step_dir(step)}\n".encode(), self.backend)
        except OSError as e:  # committed anyway: readers fall back to the highest committed step
            logger.warning("fastpersist: checkpoint step %d is committed but %s could not be updated: %s",
                           step, os.path.join(self.roots[0], catalog.LATEST), e)

    def _is_committed(self, step: int, save_id: str) -> bool:
        try:
            return catalog.read_manifest(os.path.join(self.roots[0], catalog.step_dir(step))).save_id == save_id
        except CheckpointError:
            return False

    def _after_commit(self, step: int, save_id: str, written: list[_Written]) -> None:
        """Coordinator: drop files of an earlier save of the same step, then apply retention."""
        keep = {(r.root, r.name) for w in written for r in w.reports}
        catalog.remove_files(self.roots, step, "", keep=keep)
        if self.keep is None:
            return
        committed = [e.step for e in catalog.scan(self.roots[0]) if e.committed]
        latest = catalog.read_latest(self.roots[0])
        for old in committed[: max(0, len(committed) - self.keep)]:
            if old not in (step, latest):
                catalog.remove_checkpoint(self.roots, old, self.backend)

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
