"""Reading checkpoints without side effects: ``fastpersist.open(roots)``.

A :class:`CheckpointView` lists, loads, verifies and describes the checkpoints under a set of
roots. It never creates a directory, takes a lock, writes a byte or needs a process group, so
it is what the command line, a notebook, an evaluation job or a second process should use
while (or after) a job writes there. The :class:`~fastpersist.Checkpointer` reads through one.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastpersist import timeline
from fastpersist.config import IOConfig, get_config
from fastpersist.errors import CheckpointError, CheckpointNotFoundError
from fastpersist.format import copies
from fastpersist.format import manifest as mf
from fastpersist.loading.engine import check_keys, load_from, load_object, load_state, present_in
from fastpersist.objects import verify as objverify
from fastpersist.storage import catalog
from fastpersist.storage.backend import REAL_FILES, FileBackend

logger = logging.getLogger(__name__)

Roots = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint found in the roots (see :meth:`CheckpointView.list`).

    ``abandoned``: a later commit of a smaller or equal step started a new timeline (the job
    resumed from an older checkpoint); see :mod:`fastpersist.timeline`.
    """

    step: int
    path: str
    committed: bool
    latest: bool = False
    nbytes: int = 0
    files: int = 0
    created: float = 0.0
    world_size: int = 0
    objects: tuple[str, ...] = field(default_factory=tuple)
    abandoned: bool = False
    sequence: int = 0


def root_list(roots: Roots) -> list[str]:
    paths = [roots] if isinstance(roots, (str, os.PathLike)) else list(roots)
    if not paths:
        raise ValueError("roots: at least one root directory is needed")
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"roots: expected paths, got a {type(p).__name__}")
    return [os.path.abspath(os.fspath(p)) for p in paths]


def resolve_step(root: str, step: int | str) -> int:
    if step == "latest":
        found = catalog.read_latest(root)
        if found is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {root}")
        return found
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an integer or 'latest', got {step!r}")
    if step < 0:
        raise ValueError(f"step must be a non-negative integer or 'latest', got {step}")
    return step


def _current_rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return 0
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class CheckpointView:
    """Read-only access to the checkpoints under ``roots`` (the Checkpointer's roots, in order).

    Args:
        roots: one directory or a list, as given to the Checkpointer that wrote them.
        config: I/O settings for reading (default: the process-wide configuration).
        backend: the file seam (default: real files; see :mod:`fastpersist.storage.faults`).

    Example::

        ckpts = fastpersist.open(["/nvme0/run1", "/nvme1/run1"])
        live = [info.step for info in ckpts.list() if info.committed and not info.abandoned]
        state = ckpts.load("latest", map_location="cpu")
    """

    def __init__(self, roots: Roots, *, config: IOConfig | None = None, backend: FileBackend | None = None) -> None:
        self.roots = root_list(roots)
        self._config = config
        self.backend = backend or FileBackend()

    @property
    def config(self) -> IOConfig:
        return self._config or get_config()

    def latest_step(self) -> int | None:
        """The most recently committed step (see :mod:`fastpersist.timeline`), or None."""
        return catalog.read_latest(self.roots[0])

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every checkpoint in the first root, committed or not, by step."""
        root = self.roots[0]
        out: builtins.list[CheckpointInfo] = []
        manifests: dict[int, mf.Manifest] = {}
        for e in catalog.scan(root, self.backend):
            try:
                if e.committed:
                    manifests[e.step] = catalog.read_manifest(e.path, self.backend)
            except CheckpointError as err:
                logger.warning("%s", err)
            m = manifests.get(e.step)
            out.append(CheckpointInfo(e.step, e.path, m is not None) if m is None else
                       CheckpointInfo(e.step, e.path, True, False, m.nbytes, len(m.files), m.created, m.world_size,
                                      tuple(sorted(m.objects)), False, m.sequence))
        dead = timeline.abandoned_steps([timeline.Commit(s, m.sequence, m.created) for s, m in manifests.items()])
        latest = catalog.read_latest(root, self.backend)
        return [dataclasses.replace(i, latest=i.step == latest, abandoned=i.step in dead) if i.committed else i
                for i in out]

    def manifest(self, step: int | str = "latest") -> mf.Manifest:
        s = resolve_step(self.roots[0], step)
        return catalog.read_manifest(os.path.join(self.roots[0], catalog.step_dir(s)), self.backend)

    def metadata(self, step: int | str = "latest") -> dict[str, Any]:
        """The ``metadata`` passed to ``save()`` for ``step``."""
        return dict(self.manifest(step).user)

    def _dirs(self, step: int | str) -> tuple[builtins.list[str], mf.Manifest]:
        manifest = self.manifest(step)
        name = catalog.step_dir(manifest.step)
        return [os.path.join(r, name) for r in self.roots], manifest

    def verify(self, step: int | str = "latest", *,
               progress: Callable[[int], None] | None = None) -> builtins.list[objverify.Problem]:
        """Read every byte of ``step`` and check every checksum; the problems found (empty: OK).

        ``progress``, if given, is called with the byte count of each piece of data hashed.
        A checkpoint of a job on several nodes is checked where its copies lie in these roots;
        bytes with no copy here are one problem, naming them.
        """
        dirs, manifest = self._dirs(step)
        problems: builtins.list[objverify.Problem] = []
        if manifest.nodes:
            choose = present_in(dirs, manifest, self.backend)
            local, missing = copies.localize(manifest, choose)
            if missing:
                problems.append(objverify.Problem(dirs[0], "copies", None, copies.describe_missing(manifest, missing)
                                                  + " have no copy under these roots (not checked)"))
            manifest = _without(local, lambda e: choose(e) is not None)
        return problems + objverify.verify(dirs, manifest, backend=self.backend, progress=progress)[0]

    def load(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
             keys: Iterable[str] | None = None, map_location: Any = None, weights_only: bool = True,
             verify: bool | None = None) -> Any:
        """Load the state of ``step`` (default: the latest commit), at any world size.

        Sharded tensors (DTensors at save time) are resharded: a DTensor found at the same key
        in ``into`` is filled in place, each rank reading only the bytes its local shard
        overlaps, whatever its mesh and placements; anywhere else the whole tensor is built
        (at world size 1, no process group needed).

        Args:
            step: a step number or ``"latest"``.
            into: a dict of live objects (modules, optimizers, dicts...) restored in place from
                the entries of the same keys, through ``load_state_dict``.
            keys: load only these tensors (their key paths, as ``fastpersist inspect`` lists
                them, e.g. ``"model.layers.0.weight"``), reading only their bytes; returns a
                dict from key to tensor (whole tensors). Not with ``into``.
            map_location: as in ``torch.load`` (for sharded tensors built whole: a device).
            weights_only: use torch's restricted unpickler (the default); ``False`` only for
                checkpoints you trust.
            verify: check every checksum (default: the configuration's, on).

        Returns:
            The loaded state (or, with ``keys``, a dict of tensors).

        Raises:
            CheckpointNotFoundError: no such (committed) checkpoint.
            CheckpointReadError: the checkpoint is damaged, or cannot be read or rebuilt, or a
                tensor in ``into`` has another shape or dtype than the saved one (nothing is
                read then).
        """
        check_keys(keys, into)
        dirs, manifest = self._dirs(step)
        return load_from(dirs, manifest, into, keys, map_location, weights_only, verify, self.config, self.backend)

    def tensors(self, step: int | str = "latest") -> builtins.list[TensorInfo]:
        """Every tensor of the checkpoint's state indexed by key: key, dtype, shape, bytes, and
        whether it is sharded (with its chunk count). Empty for checkpoints written before
        format version 3."""
        return tensor_infos(self.manifest(step))

    def load_rank_state(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, *,
                        rank: int | None = None, map_location: Any = None, weights_only: bool = True,
                        verify: bool | None = None) -> Any:
        """Load the ``rank_state`` that ``rank`` saved (default: this process's rank, or 0)."""
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise TypeError(f"rank must be an integer, got {type(rank).__name__} {rank!r}")
        if rank is not None and rank < 0:
            raise ValueError(f"rank must be non-negative, got {rank}")
        dirs, manifest = self._dirs(step)
        name = mf.rank_object(_current_rank() if rank is None else rank)
        return load_object(dirs, manifest, name, into, map_location, weights_only, verify, self.config,
                           self.backend)

@dataclass(frozen=True)
class TensorInfo:
    """A tensor of a checkpoint (see :meth:`CheckpointView.tensors`)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sharded: bool
    chunks: int = 1
    object: str = mf.REPLICATED


def _without(manifest: mf.Manifest, here: Callable[[mf.ExtentEntry], bool]) -> mf.Manifest:
    """The manifest less the objects and sharded tensors with an extent not ``here`` (for
    verify: what has no copy here is named once, not as unreadable files)."""
    objects = {n: o for n, o in manifest.objects.items()
               if here(o.skeleton) and all(here(e) for s in o.storages for e in s.extents)}
    sharded = tuple(t for t in manifest.sharded if all(here(e) for c in t.chunks for e in c.extents))
    return dataclasses.replace(manifest, objects=objects, sharded=sharded)


def tensor_infos(manifest: mf.Manifest) -> list[TensorInfo]:
    replicated = manifest.objects.get(mf.REPLICATED)
    out = [TensorInfo(t.key, t.dtype, t.shape, t.nbytes, False, 1) for t in (replicated.tensors if replicated else ())]
    out += [TensorInfo(t.key, t.dtype, t.shape, t.nbytes, True, len(t.chunks)) for t in manifest.sharded]
    return out


def list_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """The checkpoints under ``root`` (the first root of a Checkpointer), by step: a thin alias
    of ``fastpersist.open(root).list()``."""
    return CheckpointView(root).list()


def load_checkpoint(path: str | os.PathLike[str], other_roots: Sequence[str | os.PathLike[str]] = (), *,
                    rank: int | None = None, map_location: Any = None, weights_only: bool = True,
                    verify: bool | None = None, config: IOConfig | None = None) -> Any:
    """Load a checkpoint from its directory in the first root, without a Checkpointer: a thin
    alias of ``fastpersist.open(roots).load(step)`` for when the checkpoint's directory is what
    you have (``fastpersist.open`` is the way to list, load and verify).

    ``other_roots`` are the checkpoint's other roots, in order (their directory of the same
    name is used); without them, the roots the manifest recorded at save time are used when the
    checkpoint is still where it was saved. ``rank`` selects a rank's own state instead of the
    replicated one.
    """
    dirs = checkpoint_dirs(os.fspath(path), [os.fspath(r) for r in other_roots])
    manifest = catalog.read_manifest(dirs[0])
    if rank is not None:
        return load_object(dirs, manifest, mf.rank_object(rank), None, map_location, weights_only, verify,
                           config or get_config())
    return load_state(dirs, manifest, None, map_location, weights_only, verify, config or get_config())


def checkpoint_dirs(step_path: str, other_roots: Sequence[str] = (), option: str = "other_roots",
                    backend: FileBackend | None = None) -> list[str]:
    """The directory of checkpoint ``step_path`` (in its first root) in each of its roots.

    ``other_roots`` given: those, in order. Otherwise, for a checkpoint over several roots, the
    root paths its manifest recorded at save time (format version 3), but only if the first root
    is still where it was saved: a checkpoint that was copied or moved must be given its other
    roots (``option`` names how), or the copy would be checked against the original's files.
    Raises :class:`CheckpointNotFoundError` naming what is missing.
    """
    first = os.path.abspath(step_path)
    name = os.path.basename(first.rstrip(os.sep))
    if other_roots:
        return [first] + [os.path.join(os.path.abspath(r), name) for r in other_roots]
    try:
        manifest = catalog.read_manifest(first)
    except CheckpointError:
        return [first]  # the manifest's own problem is reported by whoever reads it
    if manifest.roots <= 1:
        return [first]
    need = f"pass the other {manifest.roots - 1} root(s) with {option}, in order"
    if not manifest.root_paths:
        raise CheckpointNotFoundError(f"{first}: the checkpoint is spread over {manifest.roots} roots and its "
                                      f"manifest (format version {manifest.version}) does not record where; {need}")
    here, saved = os.path.dirname(first.rstrip(os.sep)), manifest.root_paths[0]
    if os.path.realpath(here) != os.path.realpath(saved):
        raise CheckpointNotFoundError(f"{first}: the checkpoint was saved with its first root at {saved}, not "
                                      f"{here} (a copy?); its other roots were recorded for that place: {need}")
    dirs = [first]
    for i, r in enumerate(manifest.root_paths[1:], start=1):
        d = os.path.join(r, name)
        if not (backend or REAL_FILES).is_dir(d):
            raise CheckpointNotFoundError(f"{first}: the checkpoint's root #{i} was {r} when it was saved and {d} "
                                          f"is not there; {need}")
        dirs.append(d)
    return dirs
