"""fastpersist: checkpoint PyTorch training every iteration without slowing it down."""

from fastpersist.checkpointer import Checkpointer
from fastpersist.config import IOConfig, configure, get_config
from fastpersist.errors import (
    CheckpointerClosedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    ReplicaMismatchError,
    UnsaveableObjectError,
    UnsupportedFormatError,
    UnsupportedTorchError,
    UnsafeFileError,
    UnverifiedCheckpointError,
)
from fastpersist.handle import SaveHandle, SaveMetrics
from fastpersist.single_file import load, save
from fastpersist.state import RNGState
from fastpersist.view import CheckpointInfo, CheckpointView, list_checkpoints, load_checkpoint, open

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointView",
    "CheckpointerClosedError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "Checkpointer",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "IOConfig",
    "RNGState",
    "ReplicaMismatchError",
    "SaveHandle",
    "SaveMetrics",
    "UnsaveableObjectError",
    "UnsupportedFormatError",
    "UnsupportedTorchError",
    "UnsafeFileError",
    "UnverifiedCheckpointError",
    "configure",
    "get_config",
    "list_checkpoints",
    "load",
    "load_checkpoint",
    "open",
    "save",
]
