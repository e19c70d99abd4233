"""The load engine: a checkpoint's objects and sharded tensors read from its directories.

Given the checkpoint's directories (one per root) and its manifest, these functions read what a
load asks for, with every checksum verified: the replicated state (its sharded tensors
resharded into their destinations), one rank's ``rank_state``, or some tensors by key. They
know nothing of roots, steps or tiers: :class:`~fastpersist.loading.view.CheckpointView` finds
the directories, :mod:`fastpersist.tiers.resolve` chooses the tier. A checkpoint of a job on
several nodes is read from the copies these directories hold (:func:`local_copies`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fastpersist.config import IOConfig
from fastpersist.errors import CheckpointError, CheckpointReadError
from fastpersist.format import copies
from fastpersist.format import manifest as mf
from fastpersist.io.reader import allocate
from fastpersist.loading import reshard
from fastpersist.objects import dtensor
from fastpersist.objects import read as objread
from fastpersist.objects.files import check_unverified
from fastpersist.state import restore_into, to_saveable
from fastpersist.storage.backend import REAL_FILES, FileBackend


def present_in(dirs: Sequence[str], manifest: mf.Manifest,
               backend: FileBackend | None = None) -> Callable[[mf.ExtentEntry], copies.Location | None]:
    """A chooser for :func:`copies.localize`: the first location whose file is under ``dirs``
    (a regular file of at least its listed size, as ``backend`` finds it: default real files)."""
    here: dict[int, bool] = {}
    files = backend or REAL_FILES

    def present(f: int) -> bool:
        if f not in here:
            entry = manifest.files[f]
            try:
                st = files.stat(os.path.join(dirs[entry.root], entry.name), follow=False) \
                    if entry.root < len(dirs) else None
            except OSError:
                st = None
            here[f] = st is not None and stat.S_ISREG(st.st_mode) and st.st_size >= entry.size
        return here[f]

    return lambda e: next((loc for loc in e.locations() if present(loc[0])), None)


def local_copies(dirs: Sequence[str], manifest: mf.Manifest, backend: FileBackend | None = None) -> mf.Manifest:
    """A checkpoint of a job on several nodes, as this node's roots hold it: every extent at
    its copy under ``dirs``; an error naming what has no copy there. Any other checkpoint is
    returned as it is."""
    if not manifest.nodes:
        return manifest
    local, missing = copies.localize(manifest, present_in(dirs, manifest, backend))
    if missing:
        raise CheckpointReadError(
            f"{dirs[0]}: checkpoint step {manifest.step} was saved by a job on {len(manifest.nodes)} nodes and these "
            f"roots do not hold all of it: {copies.describe_missing(manifest, missing)} have no copy here. Load it "
            "inside the job (Checkpointer.load restores from the other nodes), or from the durable tier")
    return local


def _wrap(where: str, manifest: mf.Manifest, what: str, fn: Any) -> Any:
    """Run ``fn``; any failure becomes a CheckpointError naming the checkpoint."""
    try:
        return fn()
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointReadError(f"{where}: cannot read checkpoint step {manifest.step}: "
                                  f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}") from e
    except Exception as e:  # torch's loader: a map_location it cannot honour, a damaged pickle...
        raise CheckpointReadError(f"{where}: cannot {what} of checkpoint step {manifest.step}: "
                                  f"{type(e).__name__}: {e}") from e


def check_keys(keys: Iterable[str] | None, into: Mapping[str, Any] | None) -> None:
    if keys is not None:
        if into is not None:
            raise ValueError("load(keys=...) returns the tensors it reads; it does not take `into`")
        if isinstance(keys, str):
            raise TypeError("keys must be a collection of key paths (a str is one key: pass [key])")


def load_from(dirs: list[str], manifest: mf.Manifest, into: Mapping[str, Any] | None, keys: Iterable[str] | None,
              map_location: Any, weights_only: bool, verify: bool | None, config: IOConfig,
              backend: FileBackend | None = None) -> Any:
    """What :meth:`CheckpointView.load` returns, from the checkpoint's directories and manifest."""
    if keys is not None:
        return load_tensors(dirs, manifest, list(keys), map_location, verify, config, backend)
    return load_state(dirs, manifest, into, map_location, weights_only, verify, config, backend)


def load_state(dirs: list[str], manifest: mf.Manifest, into: Mapping[str, Any] | None, map_location: Any,
               weights_only: bool, verify: bool | None, config: IOConfig, backend: FileBackend | None = None) -> Any:
    """The replicated state with the sharded tensors in place, restored into ``into``."""
    manifest = local_copies(dirs, manifest, backend)
    obj = load_object(dirs, manifest, mf.REPLICATED, None, map_location, weights_only, verify, config, backend)
    if manifest.sharded:
        do_verify = config.verify if verify is None else verify
        obj = _wrap(dirs[0], manifest, "place the sharded tensors",
                    lambda: place_sharded(dirs, manifest, obj, into, map_location, do_verify, config, backend))
    if into is not None:
        restore_into(obj, into, dirs[0])
    return obj


def place_sharded(dirs: list[str], manifest: mf.Manifest, obj: Any, into: Mapping[str, Any] | None,
                  map_location: Any, verify: bool, config: IOConfig, backend: FileBackend | None) -> Any:
    """Read the sharded tensors into their destinations and put them at their keys in ``obj``.

    With ``into``, only the tensors under its keys are read (the others stay ``None``): a
    DTensor there is filled in place (its local shard only), a plain tensor of the full shape
    too, anything else gets the whole tensor. Every destination is checked (global shape, dtype)
    before any byte is read. A load that fails while reading (a checksum, an I/O error) may
    leave those destinations partly overwritten; the error says so."""
    import torch

    dests = to_saveable(into) if into is not None else None
    targets: list[reshard.Target] = []
    values: dict[tuple[str | int, ...], Any] = {}  # destinations filled in place: themselves
    for e in manifest.sharded:
        if into is not None and e.path[0] not in into:
            continue
        t = dtensor.get_path(dests, e.path) if dests is not None else None
        if isinstance(t, torch.Tensor) and (tuple(t.shape) != e.shape or t.dtype != getattr(torch, e.dtype)):
            raise CheckpointReadError(
                f"{dirs[0]}: sharded tensor {e.key!r} of checkpoint step {manifest.step} is {e.dtype} of shape "
                f"{list(e.shape)}, the destination is {str(t.dtype).removeprefix('torch.')} of shape "
                f"{list(t.shape)}; nothing was loaded")
        if dtensor.is_dtensor(t):
            chunks = t.__create_chunk_list__()  # type: ignore[union-attr]
            if len(chunks) != 1:
                raise CheckpointReadError(f"{dirs[0]}: the destination of sharded tensor {e.key!r} is a DTensor "
                                          f"whose local tensor holds {len(chunks)} chunks; it cannot be filled")
            local = dtensor.local(t)  # type: ignore[arg-type]
            targets.append(reshard.Target(e, local, tuple(int(x) for x in chunks[0].offsets)))
            values[e.path] = t
        elif isinstance(t, torch.Tensor) and t.device.type == "cpu":
            targets.append(reshard.Target(e, t, (0,) * len(e.shape)))
            values[e.path] = t
        else:
            targets.append(reshard.Target(e))  # the whole tensor, allocated once the files are checked
    try:
        reshard.read_sharded(dirs, manifest, targets, verify=verify, config=config, backend=backend)
    except CheckpointError as err:
        if values:
            raise type(err)(f"{err}; the tensors of `into` that were being filled may be partly overwritten: "
                            "load them again (from this or another checkpoint)") from err
        raise
    for target in targets:  # the whole tensors built here
        full = target.dest
        if target.entry.path not in values and full is not None:
            values[target.entry.path] = full.to(map_location) if isinstance(map_location, (str, torch.device)) \
                else full
    return dtensor.put_paths(obj, values, dirs[0])


def load_tensors(dirs: list[str], manifest: mf.Manifest, keys: list[str], map_location: Any, verify: bool | None,
                 config: IOConfig, backend: FileBackend | None = None) -> dict[str, Any]:
    """The tensors named by ``keys`` (whole), reading only their bytes."""
    import torch

    manifest = local_copies(dirs, manifest, backend)
    where = dirs[0]
    if manifest.version < 3:
        raise CheckpointReadError(f"{where}: checkpoint step {manifest.step} was written in format version "
                                  f"{manifest.version}, before tensors were indexed by key: load it whole")
    do_verify = config.verify if verify is None else verify
    if do_verify:
        check_unverified(dirs, manifest)
    replicated = manifest.objects[mf.REPLICATED]
    index: dict[str, list[mf.TensorEntry | mf.ShardedEntry]] = {}
    entries: list[mf.TensorEntry | mf.ShardedEntry] = [*replicated.tensors, *manifest.sharded]
    for entry in entries:
        index.setdefault(entry.key, []).append(entry)
    missing = [k for k in keys if k not in index]
    if missing:
        some = ", ".join(sorted(index)[:8])
        raise CheckpointReadError(f"{where}: checkpoint step {manifest.step} has no tensor {missing[0]!r}"
                                  f"{f' (and {len(missing) - 1} more missing)' if len(missing) > 1 else ''}; "
                                  f"it has {len(index)} tensors: {some}{', ...' if len(index) > 8 else ''}")
    for k in keys:
        if len(index[k]) > 1:
            raise CheckpointReadError(f"{where}: key {k!r} names {len(index[k])} tensors of checkpoint step "
                                      f"{manifest.step} (key paths {[list(e.path) for e in index[k]]}): their "
                                      "dotted names collide; load the state whole")
    storages = {s.key: s for s in replicated.storages}
    targets: dict[str, reshard.Target] = {}
    views: dict[str, tuple[int, mf.TensorEntry]] = {}
    for k in keys:
        entry = index[k][0]
        if isinstance(entry, mf.ShardedEntry):
            targets[k] = reshard.Target(entry)
            continue
        # a view of a replicated storage: read the bytes it spans, as a 1-D chunk of bytes
        item = mf.DTYPE_SIZES[entry.dtype]
        st = storages[entry.storage]
        lo = entry.offset * item
        span = (entry.offset + sum((n - 1) * s for n, s in zip(entry.shape, entry.stride)) + 1) * item - lo \
            if all(entry.shape) else 0
        views[k] = (span, entry)
        if span:
            blob = mf.ShardedEntry(entry.path, "uint8", (st.nbytes,), (mf.ChunkEntry((0,), (st.nbytes,), st.extents),))
            targets[k] = reshard.Target(blob, offsets=(lo,), size=(span,), make=_bytes_maker(where, span))
    _wrap(where, manifest, "read tensors", lambda: reshard.read_sharded(
        dirs, manifest, list(targets.values()), verify=do_verify, config=config, backend=backend))
    out: dict[str, Any] = {}
    for k in keys:
        if k not in views:
            out[k] = targets[k].dest
            continue
        span, entry = views[k]
        dtype = getattr(torch, entry.dtype)
        raw = targets[k].dest if span else None
        if raw is None:
            out[k] = torch.empty(entry.shape, dtype=dtype)
            continue
        typed = raw.view(dtype)
        out[k] = typed.as_strided(entry.shape, entry.stride, typed.storage_offset())
    if isinstance(map_location, (str, torch.device)):
        out = {k: v.to(map_location) for k, v in out.items()}
    return out


def _bytes_maker(where: str, nbytes: int) -> Any:
    return lambda: allocate(where, nbytes)[:nbytes]


def load_object(dirs: list[str], manifest: mf.Manifest, name: str, into: Mapping[str, Any] | None,
                map_location: Any, weights_only: bool, verify: bool | None, config: IOConfig,
                backend: FileBackend | None = None) -> Any:
    """Read one object of a checkpoint; every failure is a :class:`CheckpointError`."""
    manifest = local_copies(dirs, manifest, backend)
    do_verify = config.verify if verify is None else verify
    where = dirs[0]
    obj = _wrap(where, manifest, f"rebuild object {name!r}", lambda: objread.read_object(
        dirs, manifest, name, map_location=map_location, weights_only=weights_only, verify=do_verify, config=config,
        backend=backend))
    if into is not None:
        restore_into(obj, into, where)
    return obj
