"""Verifying a checkpoint: every check a load runs, on every object and sharded tensor, and
every byte the manifest lists hashed, reporting each problem instead of stopping at the first
(``fastpersist verify``, :meth:`fastpersist.CheckpointView.verify`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from fastpersist.errors import CheckpointError
from fastpersist.format import manifest as mf
from fastpersist.format import skeleton
from fastpersist.storage.backend import FileBackend
from fastpersist.io.files import DirectFile, file_size
from fastpersist.objects.files import (
    check_size,
    check_unverified,
    file_path,
    manifest_path,
    needed_files,
    open_listed,
    read_skeleton,
    storage_name,
)

@dataclass(frozen=True)
class Problem:
    """One thing wrong in a checkpoint, as ``fastpersist verify`` reports it."""

    path: str
    what: str  # "object 'replicated' storage '3' bytes 0..4096" or "file"
    offset: int | None
    message: str

    def __str__(self) -> str:
        at = f" at offset {self.offset}" if self.offset is not None else ""
        return f"{self.path}: {self.what}{at}: {self.message}"


def verify(dirs: Sequence[str], manifest: mf.Manifest, chunk: int = 16 << 20,
           backend: FileBackend | None = None,
           progress: Callable[[int], None] | None = None) -> tuple[list[Problem], int]:
    """Run every check :func:`read_object` runs, on every object, and read every byte the
    manifest lists; never stops at the first problem and never raises. Returns the problems
    and the number of bytes verified.

    The checks are load's own (the functions above); what load would build, verify builds on
    the meta device with the weights-only unpickler, so a skeleton that load refuses by default
    is a problem here too. Data is hashed in ``chunk`` pieces, so memory stays bounded;
    ``progress``, if given, is called with the byte count of each piece hashed.
    """
    problems: list[Problem] = []
    where = manifest_path(dirs)
    _collect(problems, where, "manifest", lambda: check_unverified(dirs, manifest))
    files: dict[int, DirectFile] = {}
    try:
        for i in needed_files(manifest, list(manifest.objects), sharded=True):
            path = _collect(problems, manifest.files[i].name, "file", lambda i=i: file_path(dirs, manifest, i))
            file = path and _collect(problems, path, "file", lambda i=i: open_listed(dirs, manifest, i, "off", backend))
            if file:  # a truncated file stays open: what it still holds is checked, the rest named
                files[i] = file
                _collect(problems, path, "file", lambda i=i, file=file: check_size(file, manifest, i))
        checked = 0
        for name, obj in sorted(manifest.objects.items()):
            checked += _verify_object(problems, dirs, manifest, name, obj, files, chunk, progress)
        for t in manifest.sharded:
            for c in t.chunks:
                checked += _verify_extents(problems, dirs, manifest, files, chunk, c.extents,
                                           f"sharded tensor {t.key!r} chunk at {list(c.offsets)}", progress)
    finally:
        for file in files.values():
            file.close()
    return problems, checked


def _collect(problems: list[Problem], path: str, what: str, step: Any) -> Any:
    """Run one check; a CheckpointError (or an OS error) becomes a Problem."""
    try:
        return step()
    except CheckpointError as e:
        problems.append(Problem(path, what, None, _without_path(str(e), path)))
    except OSError as e:
        problems.append(Problem(path, what, None, f"{e.strerror or e}"))
    return None


def _without_path(message: str, path: str) -> str:
    """``"<path> is truncated: ..."`` -> ``"truncated: ..."`` (the Problem names the path)."""
    if not message.startswith(path):
        return message
    rest = message[len(path):].lstrip(":").strip()
    return rest[3:] if rest.startswith("is ") else rest


def _verify_object(problems: list[Problem], dirs: Sequence[str], manifest: mf.Manifest, name: str,
                   obj: mf.ObjectEntry, files: dict[int, DirectFile], chunk: int,
                   progress: Callable[[int], None] | None = None) -> int:
    sk = obj.skeleton.file
    if sk in files:
        path = file_path(dirs, manifest, sk)

        def skeleton_check() -> None:
            small = read_skeleton(path, files[sk], manifest, name, True)
            offsets = {f"data/{s.key}": 0 for s in obj.storages}
            skeleton.rebuild(path, skeleton.ArchiveView(small, offsets), None, "meta", True)

        _collect(problems, path, f"object {name!r} skeleton", skeleton_check)
    checked = obj.skeleton.nbytes
    for s in obj.storages:
        checked += _verify_extents(problems, dirs, manifest, files, chunk, s.extents,
                                   f"object {name!r} {storage_name(manifest, name, s.key)}", progress)
    return checked


def _verify_extents(problems: list[Problem], dirs: Sequence[str], manifest: mf.Manifest,
                    files: dict[int, DirectFile], chunk: int, extents: Sequence[mf.ExtentEntry], owner: str,
                    progress: Callable[[int], None] | None = None) -> int:
    checked = 0
    for e in extents:
        if e.file not in files:
            continue  # the file's problem is already reported
        path = file_path(dirs, manifest, e.file)
        what = f"{owner} bytes {e.start}..{e.start + e.nbytes}"
        if e.offset + e.nbytes > file_size(files[e.file].fd):
            problems.append(Problem(path, what, e.offset, "lies beyond the end of the file"))
            continue
        got = _collect(problems, path, what,
                       lambda e=e, path=path: _hash_range(files[e.file], path, e, chunk, progress))
        if got is None:
            continue
        checked += e.nbytes
        if got != e.checksum:
            problems.append(Problem(path, what, e.offset, f"checksum mismatch (stored {e.checksum:016x}, "
                                                          f"read {got:016x})"))
    return checked


def _hash_range(file: DirectFile, path: str, e: mf.ExtentEntry, chunk: int,
                progress: Callable[[int], None] | None = None) -> int:
    h = xxhash.xxh3_64()
    done = 0
    while done < e.nbytes:
        n = min(chunk, e.nbytes - done)
        h.update(file.read_exact(e.offset + done, n))
        done += n
        if progress is not None:
            progress(n)
    return h.intdigest()
