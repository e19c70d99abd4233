"""Atomic, durable publication of files.

A file becomes visible under its final name only once all its bytes are on stable storage:
write under a temporary name in the same directory, fsync the file, rename over the final name,
fsync the directory. A crash at any instant leaves either the old file or the new one, never a
mix, and never a half-written file under the final name.
"""

from __future__ import annotations

import errno
import os
import secrets

from fastpersist.errors import CheckpointWriteError
from fastpersist.io.files import fsync_dir

TEMP_MARKER = ".fastpersist-tmp"


def temp_path_for(path: str) -> str:
    """A fresh temporary name beside ``path`` (same directory, so rename is atomic)."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{TEMP_MARKER}-{os.getpid()}-{secrets.token_hex(4)}")


def check_directory(path: str) -> str:
    """The absolute directory ``path`` would be written in; raises if it cannot be."""
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise CheckpointWriteError(f"cannot save {path}: directory {d} does not exist")
    if os.path.isdir(path):
        raise CheckpointWriteError(f"cannot save {path}: it is a directory")
    return d


def publish(temp: str, final: str) -> None:
    """Rename the fsync'd ``temp`` over ``final`` and make the rename durable."""
    try:
        os.replace(temp, final)
        fsync_dir(os.path.dirname(os.path.abspath(final)))
    except OSError as e:
        raise CheckpointWriteError(f"cannot publish {final}: {e.strerror or e}") from e


def discard(temp: str) -> None:
    """Remove a temporary file after a failed write (a missing file is fine)."""
    try:
        os.unlink(temp)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise
