"""The exceptions fastpersist raises.

Every error derives from :class:`CheckpointError`, so ``except fastpersist.CheckpointError``
catches all of them; each message names the file (and the record or key) and the cause.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by fastpersist."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (full disk, read-only directory, I/O error...).

    Nothing committed before is touched: the final name is only ever replaced by a complete,
    fsync'd file.
    """


class UnsaveableObjectError(CheckpointWriteError):
    """The object cannot be serialized (it is not picklable by torch.save's rules)."""


class CheckpointReadError(CheckpointError):
    """A checkpoint could not be read."""


class CheckpointNotFoundError(CheckpointReadError, FileNotFoundError):
    """The checkpoint file or directory does not exist."""


class CorruptCheckpointError(CheckpointReadError):
    """The checkpoint is truncated, damaged, or not a checkpoint at all."""


class ChecksumMismatchError(CorruptCheckpointError):
    """Bytes read back do not match the checksum recorded when they were written."""


class UnsupportedFormatError(CheckpointReadError):
    """The checkpoint was written in a newer format version than this fastpersist reads."""


class UnsafeFileError(CorruptCheckpointError):
    """A file of a checkpoint is not a plain regular file: a symbolic link inside a checkpoint
    directory, a FIFO, a device, a socket or a directory. fastpersist never reads through one."""


class UnverifiedCheckpointError(CheckpointReadError):
    """Verification was asked for, but the checkpoint carries no checksums to verify against
    (its checksum record is missing and its zip headers hold no CRC-32s). Load it with
    ``verify=False`` only if you accept unverified bytes."""
