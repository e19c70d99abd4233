"""Atomic, durable publication of files: the naming and the checks (the steps run through
the file backend, see storage/backend.py and catalog.write_atomic).

A file becomes visible under its final name only once all its bytes are on stable storage:
write under a temporary name in the same directory, fsync the file, rename over the final name,
fsync the directory. A crash at any instant leaves either the old file or the new one, never a
mix, and never a half-written file under the final name.
"""

from __future__ import annotations

import os
import secrets

from fastpersist.errors import CheckpointWriteError
from fastpersist.storage.backend import REAL_FILES, FileBackend

TEMP_MARKER = ".fastpersist-tmp"


def temp_path_for(path: str) -> str:
    """A fresh temporary name beside ``path`` (same directory, so rename is atomic)."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{TEMP_MARKER}-{os.getpid()}-{secrets.token_hex(4)}")


def check_directory(path: str, backend: FileBackend | None = None) -> str:
    """The absolute directory ``path`` would be written in; raises if it cannot be."""
    files = backend or REAL_FILES
    d = os.path.dirname(os.path.abspath(path))
    if not files.is_dir(d):
        what = "is a file, not a directory" if files.exists(d) else "does not exist"
        raise CheckpointWriteError(f"cannot save {path}: {d} {what}")
    if files.is_dir(path):
        raise CheckpointWriteError(f"cannot save {path}: it is a directory")
    return d
