"""Checking a Checkpointer's roots before anything is written.

Two roots that are one directory (the same path twice, a symlink or a bind mount to it) or
one inside the other would make a save's own files collide: the post-commit cleanup of one
root deletes the data of the other, leaving a manifest that points at nothing. So roots are
checked when the Checkpointer is built, and nothing is created then: a root that does not exist
yet must be creatable (its nearest existing ancestor a writable directory), and is created by
the first save.

These checks query the file system directly (``os.stat``, ``os.path``, ``os.access``), not
through the Checkpointer's :class:`~fastpersist.storage.backend.FileBackend`: they run while
the Checkpointer is being built, on the paths the caller gave (before any checkpoint file is
opened, created or read), and they compare directories by identity (device, inode), which a
backend that fails or delays operations has nothing to add to. They are the one allowed
exception to "every file operation goes through the backend" in storage/ (see
tests/unit/storage/test_storage_seam.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from fastpersist.errors import CheckpointWriteError


def _nearest_existing(path: str) -> str:
    p = path
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _check_usable(path: str) -> None:
    """The root exists as a writable directory, or can be created as one."""
    if os.path.lexists(path):
        if not os.path.isdir(path):
            what = "a file" if os.path.isfile(path) else "not a directory"
            raise CheckpointWriteError(f"checkpoint root {path} is {what}; a root must be a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise CheckpointWriteError(f"checkpoint root {path} is not writable (permissions or a read-only "
                                       "filesystem); to only read checkpoints, use fastpersist.open()")
        return
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        raise CheckpointWriteError(f"checkpoint root {path} cannot be created: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise CheckpointWriteError(f"checkpoint root {path} cannot be created: {base} is not writable "
                                   "(permissions or a read-only filesystem)")


def _key(path: str) -> tuple[int, int, str]:
    """Where ``path`` is, independent of how it is named: the (device, inode) of its nearest
    existing ancestor (itself when it exists) and the rest of the path below it. Two names of
    one directory (a symlink, a bind mount) get the same key even before it exists."""
    base = _nearest_existing(path)
    try:
        st = os.stat(base)
    except OSError:
        return (-1, -1, os.path.realpath(path))
    rest = os.path.relpath(path, base)
    return (st.st_dev, st.st_ino, "" if rest == "." else rest)


def _inside(inner: str, outer: str) -> bool:
    return inner != outer and os.path.commonpath([inner, outer]) == outer


def _nested(a: tuple[int, int, str], b: tuple[int, int, str]) -> bool:
    """Whether ``b`` lies inside ``a`` (same base, a's rest a proper prefix of b's)."""
    if a[:2] != b[:2] or a[2] == b[2]:
        return False
    return a[2] == "" or b[2].startswith(a[2] + os.sep)


def check_roots(paths: Sequence[str]) -> list[str]:
    """The roots as absolute paths; raises if two are one directory or nested, or if one
    cannot be used (``ValueError`` for the former, :class:`CheckpointWriteError` for the latter)."""
    roots = [os.path.abspath(os.fspath(p)) for p in paths]
    real = [os.path.realpath(r) for r in roots]
    keys = [_key(r) for r in roots]
    for i in range(len(roots)):
        for j in range(i + 1, len(roots)):
            a, b = roots[i], roots[j]
            if real[i] == real[j] or keys[i] == keys[j]:
                raise ValueError(f"roots[{i}] {a} and roots[{j}] {b} are the same directory; every root "
                                 "must be a distinct directory (ideally one per SSD)")
            for outer, inner, ko, ki, ro, ri in ((a, b, keys[i], keys[j], real[i], real[j]),
                                                 (b, a, keys[j], keys[i], real[j], real[i])):
                if _inside(ri, ro) or _nested(ko, ki):
                    raise ValueError(f"checkpoint root {inner} lies inside another root, {outer}; roots must "
                                     "not contain each other")
    for r in roots:
        _check_usable(r)
    return roots
