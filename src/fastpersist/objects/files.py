"""What reading and verifying an object share: naming and opening a checkpoint's files, and
the checks both run.

Each check raises a :class:`~fastpersist.CheckpointError` naming the file; a load stops at the
first, ``verify`` reports every one and goes on. Symbolic links: a checkpoint's files are opened
with O_NOFOLLOW (their names are plain names, so no component inside a checkpoint directory can
be a link) and must be regular files; the directories the caller names (roots, the checkpoint's
directory) are the caller's and may be links.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

from fastpersist.errors import (
    CheckpointNotFoundError,
    CheckpointReadError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    UnverifiedCheckpointError,
)
from fastpersist.format import manifest as mf
from fastpersist.format import references, skeleton
from fastpersist.storage.backend import REAL_FILES as _REAL_FILES
from fastpersist.storage.backend import FileBackend
from fastpersist.io.buffers import memory_view
from fastpersist.io.files import DirectFile, file_size
from fastpersist.io.reader import Landed


# Storages in the read buffer start on this boundary (enough for any dtype).
ELEMENT_ALIGN = 64


def file_path(dirs: Sequence[str], manifest: mf.Manifest, index: int) -> str:
    f = manifest.files[index]
    if f.root >= len(dirs):
        raise CheckpointReadError(
            f"{manifest_path(dirs)}: the checkpoint's file {f.name!r} is on root #{f.root}, but only "
            f"{len(dirs)} roots were given: pass every root the checkpoint was written to"
        )
    return os.path.join(dirs[f.root], f.name)


def manifest_path(dirs: Sequence[str]) -> str:
    return os.path.join(dirs[0], mf.MANIFEST_NAME)


def check_unverified(dirs: Sequence[str], manifest: mf.Manifest) -> None:
    """A version-1 manifest has no checksum of its own: under verification it is refused."""
    if manifest.version < 2:
        raise UnverifiedCheckpointError(
            f"{manifest_path(dirs)} is format version {manifest.version}, whose manifest carries no checksum of "
            "its own, so its content cannot be verified; load it with verify=False, or load and save it again"
        )


def open_file(dirs: Sequence[str], manifest: mf.Manifest, index: int, direct: str,
              backend: FileBackend | None = None) -> DirectFile:
    """Open file ``index`` of the checkpoint: a regular file, not a link, at least its listed size."""
    file = open_listed(dirs, manifest, index, direct, backend)
    try:
        check_size(file, manifest, index)
    except BaseException:
        file.close()
        raise
    return file


def open_listed(dirs: Sequence[str], manifest: mf.Manifest, index: int, direct: str,
                 backend: FileBackend | None = None) -> DirectFile:
    path = file_path(dirs, manifest, index)
    try:
        return (backend or _REAL_FILES).open_read(path, direct)
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint lists it, the directory lacks it") from e


def check_size(file: DirectFile, manifest: mf.Manifest, index: int) -> None:
    have, want = file_size(file.fd), manifest.files[index].size
    if have < want:
        raise CorruptCheckpointError(f"{file.path} is truncated: {have} bytes, the manifest says {want}")


def read_skeleton(path: str, file: DirectFile, manifest: mf.Manifest, name: str, verify: bool) -> dict[str, bytes]:
    """The skeleton records of object ``name``, bounded, checksummed, strictly decoded, and bound
    to the object's storages (every reference names a listed storage of exactly its size)."""
    entry = manifest.objects[name]
    size = entry.skeleton.nbytes
    if size > skeleton.MAX_SKELETON_BYTES:
        raise CorruptCheckpointError(f"{path}: the skeleton of object {name!r} is listed as {size} bytes, more "
                                     f"than a skeleton may be ({skeleton.MAX_SKELETON_BYTES})")
    if file_size(file.fd) != size:
        raise CorruptCheckpointError(f"{path}: the skeleton file is {file_size(file.fd)} bytes, the manifest "
                                     f"says {size}")
    raw = file.read_exact(entry.skeleton.offset, size)
    if verify and xxhash.xxh3_64_intdigest(raw) != entry.skeleton.checksum:
        raise ChecksumMismatchError(f"{path}: the skeleton of object {name!r} fails its checksum; the file is corrupt")
    small = skeleton.decode(path, raw)
    problems = references.binding_problems(small["data.pkl"], {s.key: s.nbytes for s in entry.storages})
    if problems:
        raise CorruptCheckpointError(f"{path}: object {name!r}: {problems[0]}"
                                     + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return small


def extent_problem(dirs: Sequence[str], manifest: mf.Manifest, name: str, s: mf.StorageEntry,
                   e: mf.ExtentEntry, got: int) -> str | None:
    """What is wrong with one extent whose bytes hash to ``got`` (None if nothing)."""
    if got == e.checksum:
        return None
    return (f"{file_path(dirs, manifest, e.file)}: object {name!r} {storage_name(manifest, name, s.key)} bytes "
            f"{e.start}..{e.start + e.nbytes} (file offset {e.offset}) fail their checksum "
            f"(stored {e.checksum:016x}, read {got:016x})")


def storage_name(manifest: mf.Manifest, name: str, key: str) -> str:
    """``storage '3' (tensor 'model.w')``: a storage with the key paths of the tensors it holds."""
    obj = manifest.objects.get(name)
    keys = [t.key for t in obj.tensors if t.storage == key] if obj is not None else []
    if not keys:
        return f"storage {key!r}"
    more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
    return f"storage {key!r} (tensor {keys[0]!r}{more})"


def needed_files(manifest: mf.Manifest, names: Sequence[str], sharded: bool = False) -> list[int]:
    return sorted({e.file for n in names for s in manifest.objects[n].storages for e in s.extents}
                  | {manifest.objects[n].skeleton.file for n in names}
                  | ({e.file for t in manifest.sharded for c in t.chunks for e in c.extents} if sharded else set()))


def check_in_memory(work: Sequence[tuple[int, mf.ExtentEntry, Callable[[int], str]]], threads: int,
                    landed: Landed | None = None) -> None:
    """Hash every extent where it was read to (address, extent, message for a digest that does
    not match), in ``threads`` threads; raise one ChecksumMismatchError naming the first problem
    (by message) and how many more there are.

    With ``landed`` (reads still running), each extent is hashed once its bytes have landed, in
    the order given (the order they are expected to land); a stop of the reads ends the check
    with :class:`ReadsStopped`. Without, largest first.
    """
    bad: list[str] = []
    lock = threading.Lock()

    def check(item: tuple[int, mf.ExtentEntry, Callable[[int], str]]) -> None:
        at, e, message = item
        if landed is not None:
            landed.wait(at, e.nbytes)
        got = xxhash.xxh3_64_intdigest(memory_view(at, e.nbytes))
        if got != e.checksum:
            with lock:
                bad.append(message(got))

    order = list(work) if landed is not None else sorted(work, key=lambda w: -w[1].nbytes)
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="fastpersist-verify") as ex:
        list(ex.map(check, order))
    if bad:
        bad.sort()
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ChecksumMismatchError(f"{bad[0]}{more}; the checkpoint is corrupt")
