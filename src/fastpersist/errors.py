"""The exceptions fastpersist raises.

Every error derives from :class:`CheckpointError`, so ``except fastpersist.CheckpointError``
catches all of them; each message names the file (and the record or key) and the cause.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class of every error raised by fastpersist."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (full disk, read-only directory, I/O error...).

    Nothing committed before is touched: the final name is only ever replaced by a complete,
    fsync'd file.
    """


class UnsaveableObjectError(CheckpointWriteError):
    """The object cannot be serialized (it is not picklable by torch.save's rules)."""


class DistributedCheckpointError(CheckpointWriteError):
    """A step of the save protocol failed on one or more ranks; raised on every rank.

    ``failures`` maps each failing rank to its formatted traceback.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures

    def __reduce__(self) -> tuple[Any, ...]:  # pickles whole (it crosses from the save process)
        return type(self), (self.args[0], self.failures), self.__dict__

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)


class ReplicaMismatchError(CheckpointWriteError):
    """The ``state`` passed as replicated holds different values on different ranks.

    Raised on every rank before anything is committed. ``key`` names the first differing
    tensor (its path in the state, or the storage's index), ``ranks`` the ranks that disagree
    with the lowest rank.
    """

    def __init__(self, message: str, key: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.key = key
        self.ranks = ranks

    def __reduce__(self) -> tuple[Any, ...]:  # pickles whole (it crosses from the save process)
        return type(self), (self.args[0], self.key, self.ranks), self.__dict__


class CheckpointerClosedError(CheckpointError):
    """The Checkpointer was closed; it takes no more saves."""


class CheckpointReadError(CheckpointError):
    """A checkpoint could not be read."""


class CheckpointNotFoundError(CheckpointReadError, FileNotFoundError):
    """The checkpoint file or directory does not exist."""


class IncompleteCheckpointError(CheckpointReadError):
    """A checkpoint of a job on several nodes has bytes that no node of the job holds (a node
    lost with more copies than the redundancy covered); the message names them."""


class CorruptCheckpointError(CheckpointReadError):
    """The checkpoint is truncated, damaged, or not a checkpoint at all."""


class ChecksumMismatchError(CorruptCheckpointError):
    """Bytes read back do not match the checksum recorded when they were written."""


class UnsupportedFormatError(CheckpointReadError):
    """The checkpoint was written in a newer format version than this fastpersist reads."""


class UnsupportedTorchError(CheckpointError):
    """torch's serialization internals differ from what this fastpersist was tested with."""


class UnsafeFileError(CorruptCheckpointError):
    """A file of a checkpoint is not a plain regular file: a symbolic link inside a checkpoint
    directory, a FIFO, a device, a socket or a directory. fastpersist never reads through one."""


class UnverifiedCheckpointError(CheckpointReadError):
    """Verification was asked for, but the checkpoint carries no checksums to verify against
    (its checksum record is missing and its zip headers hold no CRC-32s). Load it with
    ``verify=False`` only if you accept unverified bytes."""
