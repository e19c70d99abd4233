"""Checkpoints saved into a directory the caller names: ``save(step, state, directory=X)``.

Frameworks name their checkpoints by path (Lightning's ``epoch=0-step=5.ckpt``, a ``last.ckpt``
replaced at every save), while a Checkpointer names them by step under fixed roots. A save with
``directory=X`` is written and committed under the roots as any other (every rank writes its
share, checksums, manifest last), then, still in the save's job and before its handle
completes, rank 0 moves the committed step directory out of the root:

1. ``root/step-N`` is renamed into ``X.fp-partial/`` (same filesystem: a rename, no copy), and
   ``X.fp-partial/latest`` names it: ``X.fp-partial`` is now a one-root checkpoint root;
2. ``X.fp-partial`` takes ``X``'s place in one atomic exchange (``renameat2(RENAME_EXCHANGE)``),
   so ``X`` names the old checkpoint or the new one at every instant, never nothing; the old
   one, now under ``X.fp-partial``, is removed. Where the filesystem cannot exchange, ``X`` is
   renamed to ``X.fp-old`` first; a crash between the two renames is undone by the next
   publish of ``X`` or read of it (:func:`recover`).

So ``X`` is a self-contained checkpoint root holding one committed checkpoint, read by
``fastpersist.open(X)``, ``load_checkpoint``, the command line and :func:`load_directory`.
A crash before the exchange leaves ``X`` as it was, and the new checkpoint at most in
``X.fp-partial`` (removed by the next publish of ``X``). The handle completes when ``X`` is the
new checkpoint, on every rank (one collective after the commit).

Limits, refused at ``save()`` on every rank alike: one root (the step directory must be one
directory), one node (or roots every node shares), no durable tier (the step leaves the roots
the drain reads). ``X`` must be on the roots' filesystem (a rename; otherwise the save fails
naming both paths, and the checkpoint stays committed under the roots).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os

from fastpersist.storage import catalog
from fastpersist.errors import CheckpointNotFoundError, CheckpointWriteError
from fastpersist.storage.backend import REAL_FILES as _REAL_FILES
from fastpersist.storage.backend import FileBackend

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".fp-partial"
OLD_SUFFIX = ".fp-old"


def publish_step(root: str, step: int, directory: str, backend: FileBackend) -> None:
    """Move the committed checkpoint ``step`` out of ``root`` into ``directory`` (see the module).

    Raises:
        CheckpointWriteError: the move failed (naming the paths and the cause); the checkpoint
            then stays committed under ``root`` (or, after a failure past the move, in
            ``directory.fp-partial``) and ``directory`` is unchanged. Or, past the exchange, the
            fsync of ``directory``'s folder failed: ``directory`` holds the new checkpoint, the
            one it replaced is kept in ``directory.fp-partial`` (a power loss may bring back
            the previous names), and the error says so.
    """
    name = catalog.step_dir(step)
    partial = directory + PARTIAL_SUFFIX
    try:
        recover(directory, backend)
        _check_replaceable(directory, backend)
        remove_path(partial, backend)
        backend.makedirs(partial)
        backend.replace(os.path.join(root, name), os.path.join(partial, name))
    except OSError as e:
        with contextlib.suppress(OSError):
            remove_path(partial, backend)
        hint = (" (the directory must be on the roots' filesystem: the checkpoint is renamed, not copied)"
                if e.errno == errno.EXDEV else "")
        raise CheckpointWriteError(f"checkpoint step {step} is committed under {root} but could not be moved into "
                                   f"{directory}: {e.strerror or e}{hint}") from e
    try:
        catalog.point_latest(partial, step, backend)
        backend.fsync_dir(root)
        old = swap_in(partial, directory, backend)
    except OSError as e:
        raise CheckpointWriteError(f"checkpoint step {step}: publishing {partial} as {directory} failed: "
                                   f"{_cause(e)}; {partial} holds the committed checkpoint") from e
    parent = os.path.dirname(os.path.abspath(directory))
    try:
        backend.fsync_dir(parent)  # the new name is durable: only now may the old checkpoint go
    except OSError as e:
        kept = f"; the checkpoint it replaced is kept in {old}" if old is not None else ""
        raise CheckpointWriteError(f"checkpoint step {step} is published as {directory}, but its folder {parent} "
                                   f"could not be fsync'd ({_cause(e)}): after a power loss the name may still show "
                                   f"the previous checkpoint{kept}") from e
    if old is not None:  # published: removing what it replaced is best effort
        try:
            remove_path(old, backend)
        except OSError as e:
            logger.warning("checkpoint step %d is published as %s; the checkpoint it replaced could not be removed "
                           "from %s: %s", step, directory, old, e.strerror or e)


def _cause(e: OSError) -> str:
    """An OSError's reason, and the path it concerns when it names one."""
    reason = e.strerror or str(e)
    return f"{reason} ({e.filename})" if e.filename and str(e.filename) not in reason else reason


def swap_in(partial: str, path: str, backend: FileBackend) -> str | None:
    """Make ``partial`` (a directory) take ``path``'s place atomically; returns where the old
    ``path`` now is (to remove), or None if there was none. The caller fsyncs ``path``'s
    folder (the new name is durable only then)."""
    if backend.exists(path) and exchange_supported() and backend.exchange(partial, path):
        return partial  # the old checkpoint, now under the partial name
    old = None
    if backend.exists(path):
        old = path + OLD_SUFFIX
        remove_path(old, backend)
        backend.replace(path, old)
    backend.replace(partial, path)  # a crash before this leaves path.fp-old alone: see recover()
    return old


def _check_replaceable(path: str, backend: FileBackend) -> None:
    """Refuse to replace a directory that is not a published checkpoint (a mistaken path)."""
    if not backend.is_dir(path, follow=False) or not backend.listdir(path):
        return  # nothing, a file (a framework's single-file checkpoint of the same name) or empty
    if catalog.read_latest(path, backend) is None:
        raise OSError(errno.EEXIST, f"{path} exists and is not a checkpoint published by fastpersist; "
                      "not replaced (remove it, or save into another directory)")


def recover(path: str, backend: FileBackend | None = None) -> None:
    """Undo a crash between the two renames of a publish without exchange: ``path`` missing
    and ``path.fp-old`` present means ``path.fp-old`` is the last published checkpoint. Only
    the publisher (rank 0, holding the roots' lock) renames; readers use
    :func:`directory_checkpoint`, which reads ``path.fp-old`` in place."""
    files = backend or _REAL_FILES
    old = path + OLD_SUFFIX
    if not files.exists(path) and files.is_dir(old):
        logger.warning("%s was being replaced when a process died; restoring the previous checkpoint from %s",
                       path, old)
        files.replace(old, path)
        files.fsync_dir(os.path.dirname(os.path.abspath(path)))


def sweep(folder: str, backend: FileBackend | None = None) -> None:
    """Clean what crashed publishes left in ``folder`` (the publisher, before its first save):
    a ``X.fp-partial`` (removed), a ``X.fp-old`` beside ``X`` (removed) or alone (put back)."""
    files = backend or _REAL_FILES
    try:
        names = files.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        path = os.path.join(folder, name)
        try:
            if name.endswith(PARTIAL_SUFFIX):
                remove_path(path, backend)
            elif name.endswith(OLD_SUFFIX):
                target = path[:-len(OLD_SUFFIX)]
                if files.exists(target):
                    remove_path(path, backend)
                else:
                    recover(target, backend)
        except OSError as e:
            logger.warning("could not clean %s left by an interrupted publish: %s", path, e.strerror or e)


def remove_published(path: str, backend: FileBackend | None = None) -> None:
    """Remove the checkpoint published as ``path`` and what an interrupted publish of it left."""
    for p in (path, path + PARTIAL_SUFFIX, path + OLD_SUFFIX):
        remove_path(p, backend)


def remove_path(path: str, backend: FileBackend | None = None) -> None:
    """Remove a checkpoint file, directory or link; nothing if it does not exist. Raises the
    first failure."""
    files = backend or _REAL_FILES
    if files.is_dir(path, follow=False):
        files.rmtree(path, _raise)
    elif files.exists(path):
        files.unlink(path)


def _raise(_path: str, error: OSError) -> None:
    raise error


def directory_checkpoint(path: str, backend: FileBackend | None = None) -> str:
    """The step directory of the checkpoint published as ``path`` (its most recent commit);
    read-only: after a crash between the two renames of a publish without exchange, the
    checkpoint is read where it is, in ``path.fp-old``.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed fastpersist checkpoint.
    """
    files = backend or _REAL_FILES
    for where in (path, path + OLD_SUFFIX):
        step = catalog.read_latest(where, files) if files.is_dir(where) else None
        if step is not None:
            return os.path.join(where, catalog.step_dir(step))
        if files.exists(path):
            break
    raise CheckpointNotFoundError(f"{path} holds no committed fastpersist checkpoint")


def exchange_supported() -> bool:
    """Whether publishes swap directories in one ``renameat2(RENAME_EXCHANGE)``; the
    environment variable ``FASTPERSIST_NO_RENAME_EXCHANGE=1`` turns it off (a filesystem that
    claims it and misbehaves), leaving the two-rename path."""
    return os.environ.get("FASTPERSIST_NO_RENAME_EXCHANGE", "") not in ("1", "true", "yes")
