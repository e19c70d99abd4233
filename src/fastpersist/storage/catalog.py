"""Where checkpoints live in their roots, which are committed, and the ``latest`` pointer.

Every root holds one directory per checkpoint, ``step-<step, 8+ digits>``, with that checkpoint's
files on that root. The first root also holds the checkpoint's ``manifest.json`` and the
``latest`` pointer. A checkpoint is committed exactly when its manifest exists: the manifest is
written last (temporary name, fsync, rename, directory fsync). A directory without a manifest
is an incomplete save (in progress, or left by a crash) and is never listed as loadable.

``latest`` is a small text file naming the newest committed checkpoint's directory, replaced
atomically after each commit. Readers trust it only if it names a committed checkpoint whose
manifest is the newest; otherwise the most recent commit by its sequence is latest (not the
highest step: see :mod:`fastpersist.timeline`), so a crash between the manifest's rename and
the pointer's update loses nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from fastpersist import timeline
from fastpersist.storage.atomic import TEMP_MARKER, temp_path_for
from fastpersist.errors import CheckpointError, CheckpointNotFoundError
from fastpersist.format import manifest as mf
from fastpersist.storage.backend import REAL_FILES as _REAL_FILES
from fastpersist.storage.backend import FileBackend

logger = logging.getLogger(__name__)

LATEST = "latest"
_STEP_DIR = re.compile(r"step-([0-9]{8,20})", re.ASCII)  # always fullmatch: no trailing newline
MAX_LATEST_BYTES = 4096  # `latest` holds one directory name
TEMP_SUFFIX = TEMP_MARKER  # in the name of every temporary file fastpersist writes


def step_dir(step: int) -> str:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"a checkpoint step must be a non-negative integer, got {step!r}")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Entry:
    """A checkpoint directory found in the first root."""

    step: int
    path: str  # its directory in the first root
    committed: bool




def scan(root: str, backend: FileBackend | None = None) -> list[Entry]:
    """Every checkpoint directory in ``root``, by step."""
    files = backend or _REAL_FILES
    try:
        names = files.listdir(root)
    except FileNotFoundError:
        return []
    except NotADirectoryError as e:
        raise CheckpointNotFoundError(f"{root} is a file, not a checkpoint root directory") from e
    out = []
    for name in names:
        step = parse_step_dir(name)
        path = os.path.join(root, name)
        # a step directory that is a link is not a checkpoint of this root (links inside a root
        # are never followed). "committed" stays "a manifest entry exists", whatever its kind, so
        # that clean-up never deletes a directory holding one; reading it checks the kind.
        if step is not None and files.is_dir(path, follow=False):
            out.append(Entry(step, path, files.exists(os.path.join(path, mf.MANIFEST_NAME))))
    return sorted(out, key=lambda e: e.step)


def _is_regular(path: str, files: FileBackend) -> bool:
    """Whether ``path`` is a regular file itself (not through a link)."""
    try:
        return stat.S_ISREG(files.stat(path, follow=False).st_mode)
    except OSError:
        return False


def read_manifest(step_path: str, backend: FileBackend | None = None) -> mf.Manifest:
    """The parsed manifest of the checkpoint in ``step_path`` (its directory in the first root).

    The manifest must be a regular file, not a link, at most ``MAX_MANIFEST_BYTES``; it is
    checked against its own checksum and parsed strictly (:func:`manifest.parse`).
    """
    path = os.path.join(step_path, mf.MANIFEST_NAME)
    files = backend or _REAL_FILES
    if files.exists(step_path) and not files.is_dir(step_path):
        raise CheckpointNotFoundError(f"no checkpoint at {step_path}: it is a file, not a checkpoint directory")
    try:
        raw = files.read_small(path, mf.MAX_MANIFEST_BYTES, "manifest")
    except CheckpointNotFoundError as e:
        if files.is_dir(step_path):
            raise CheckpointNotFoundError(
                f"{step_path} holds no committed checkpoint (no {mf.MANIFEST_NAME}: the save did not "
                "finish, or this is not a fastpersist checkpoint directory)"
            ) from e
        raise CheckpointNotFoundError(f"no checkpoint at {step_path}: the directory does not exist") from e
    return mf.parse(path, raw)


def _manifest_mtime(step_path: str, files: FileBackend) -> int | None:
    try:
        return files.stat(os.path.join(step_path, mf.MANIFEST_NAME)).st_mtime_ns
    except OSError:
        return None


def commits(root: str, entries: Sequence[Entry] | None = None, *,
            backend: FileBackend | None = None) -> list[timeline.Commit]:
    """The committed checkpoints among ``entries`` (default: all in ``root``), with their
    commit order; damaged manifests are skipped with a warning."""
    out = []
    for e in entries if entries is not None else scan(root, backend):
        if not e.committed:
            continue
        try:
            m = read_manifest(e.path, backend)
        except CheckpointError as err:
            logger.warning("%s", err)
            continue
        out.append(timeline.Commit(e.step, m.sequence, m.created))
    return out


def _read_hint(root: str, backend: FileBackend | None) -> int | None:
    """The step the ``latest`` pointer names, if it is a small regular file naming one."""
    path = os.path.join(root, LATEST)
    try:
        raw = (backend or _REAL_FILES).read_small(path, MAX_LATEST_BYTES, "latest pointer")
        return parse_step_dir(raw.decode("ascii").strip())
    except CheckpointNotFoundError:
        return None
    except (CheckpointError, UnicodeDecodeError) as e:  # damaged: fall back, but say so
        logger.warning("ignoring %s: %s", path, e)
        return None


def read_latest(root: str, backend: FileBackend | None = None) -> int | None:
    """The most recently committed step (not the largest: see :mod:`fastpersist.timeline`).

    ``latest`` names it after every commit; a crash between a commit and the pointer's update
    leaves it one behind, so it is trusted only if it names a committed checkpoint whose
    manifest is at least as new as every other one (one stat per checkpoint); otherwise the
    manifests decide by their commit sequence. The pointer is read without blocking and only
    if it is a small regular file; a checkpoint counts only if its manifest is a regular file.
    """
    files = backend or _REAL_FILES
    found = scan(root, files)  # first: a root that is a file is named as such
    hint = _read_hint(root, files)
    entries = [e for e in found if e.committed and _is_regular(os.path.join(e.path, mf.MANIFEST_NAME), files)]
    by_step = {e.step: e for e in entries}
    if hint is not None and hint in by_step:
        hint_time = _manifest_mtime(by_step[hint].path, files)
        newer = [e for e in entries
                 if e.step != hint and (hint_time is None or (_manifest_mtime(e.path, files) or 0) >= hint_time)]
        if not newer:
            return hint
        entries = newer + [by_step[hint]]
    return timeline.latest(commits(root, entries, backend=backend))


def point_latest(root: str, step: int, backend: FileBackend) -> None:
    """Point ``latest`` at ``step``, just committed. A failure is logged, never raised: the
    commit stands, and readers find the most recent commit by its sequence."""
    try:
        write_atomic(root, LATEST, f"{step_dir(step)}\n".encode(), backend)
        backend.event("after-latest")
    except OSError as e:
        latest = os.path.join(root, LATEST)
        logger.warning("checkpoint step %d is committed but %s could not be updated: %s", step, latest, e)
        try:  # a stale pointer must not win a tie of manifest times: remove it (best effort)
            backend.unlink(latest)
        except OSError:
            pass


def write_atomic(directory: str, name: str, data: bytes, backend: FileBackend, events: bool = False) -> None:
    """Write ``directory/name`` durably and atomically: temp name, fsync, rename, fsync dir.

    With ``events``, the backend hears "after-manifest-temp" and "after-rename".
    """
    final = os.path.join(directory, name)
    temp = temp_path_for(final)
    try:
        backend.write_small(temp, data, 0)
        if events:
            backend.event("after-manifest-temp")
        backend.replace(temp, final)
        if events:
            backend.event("after-rename")
    except BaseException:
        with contextlib.suppress(OSError):  # keep the original error
            if backend.exists(temp):
                backend.unlink(temp)
        raise
    backend.fsync_dir(directory)


def remove_checkpoint(roots: Sequence[str], step: int, backend: FileBackend) -> bool:
    """Delete a checkpoint: first its manifest (so it stops being loadable), then its files.

    Best effort: a failure is logged, never raised. Returns False if the manifest could not be
    removed (the checkpoint is then untouched and still loadable)."""
    name = step_dir(step)
    first = os.path.join(roots[0], name)
    manifest = os.path.join(first, mf.MANIFEST_NAME)
    try:
        if backend.exists(manifest):
            backend.unlink(manifest)
            backend.fsync_dir(first)
    except OSError as e:
        logger.warning("could not delete checkpoint step %d (%s: %s); it stays committed", step, manifest,
                       e.strerror or e)
        return False
    for root in roots:
        d = os.path.join(root, name)
        try:
            if backend.exists(d):
                backend.rmtree(d, lambda p, e: logger.warning("could not remove %s: %s", p, e.strerror or e))
        except OSError as e:  # no longer committed: what is left is cleaned at the next start
            logger.warning("could not remove %s: %s", d, e.strerror or e)
    return True


def remove_files(roots: Sequence[str], step: int, prefix: str, backend: FileBackend,
                 keep: set[tuple[int, str]] | None = None, prune: bool = False) -> None:
    """Remove files of one checkpoint whose name starts with ``prefix`` (best effort); with
    ``prune``, also the checkpoint's directories that are left empty."""
    name = step_dir(step)
    for i, root in enumerate(roots):
        d = os.path.join(root, name)
        try:
            names = backend.listdir(d)
        except OSError:
            continue
        for f in names:
            if f.startswith(prefix) and f != mf.MANIFEST_NAME and (keep is None or (i, f) not in keep):
                try:
                    backend.unlink(os.path.join(d, f))
                except FileNotFoundError:
                    pass  # another rank of the same node removed it first
                except OSError as e:
                    logger.warning("could not remove %s: %s", os.path.join(d, f), e.strerror or e)
        if prune:
            try:
                backend.rmdir(d)  # only succeeds when empty: never removes another writer's files
            except OSError:
                pass


def clean_incomplete(roots: Sequence[str], backend: FileBackend, keep: set[int] | None = None) -> list[str]:
    """Remove what a crashed run left: checkpoint directories without a committed manifest
    (in every root) and temporary files of interrupted atomic writes. Returns what was removed.
    Steps in ``keep`` (committed on another node: their files here may be its copies) stay.

    Only call this when no save of this job can be running (the Checkpointer does it under the
    root lock, before its first save). Failures are logged, never raised.
    """
    removed: list[str] = []

    def warn(path: str, e: OSError) -> None:
        logger.warning("could not remove %s: %s", path, e.strerror or e)

    try:
        committed = {e.step for e in scan(roots[0], backend) if e.committed} | (keep or set())
    except OSError as e:  # best effort: leftovers stay until a later start can list the root
        warn(roots[0], e)
        return removed
    for root in roots:
        try:
            names = backend.listdir(root)
        except OSError:
            continue
        for name in names:
            path = os.path.join(root, name)
            step = parse_step_dir(name)
            try:
                if step is not None and step not in committed and backend.is_dir(path):
                    backend.rmtree(path, warn)
                    removed.append(path)
                elif step is not None and backend.is_dir(path):
                    for f in backend.listdir(path):
                        if TEMP_SUFFIX in f:
                            backend.unlink(os.path.join(path, f))
                            removed.append(os.path.join(path, f))
                elif TEMP_SUFFIX in name:  # a temporary file, or a durable fetch's staging directory
                    if backend.is_dir(path, follow=False):
                        backend.rmtree(path, warn)
                    else:
                        backend.unlink(path)
                    removed.append(path)
            except OSError as e:
                warn(path, e)
    if removed:
        logger.info("removed %d leftovers of an interrupted run: %s", len(removed), ", ".join(removed[:5]))
    return removed
