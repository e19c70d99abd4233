"""fastpersist: checkpoint PyTorch training every iteration without slowing it down."""

from fastpersist.checkpointer import Checkpointer, CheckpointInfo, list_checkpoints, load_checkpoint
from fastpersist.config import IOConfig, configure, get_config
from fastpersist.dist import DistributedCheckpointError
from fastpersist.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    UnsaveableObjectError,
    UnsupportedFormatError,
)
from fastpersist.handle import SaveHandle, SaveMetrics
from fastpersist.single_file import load, save
from fastpersist.state import RNGState

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "Checkpointer",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "IOConfig",
    "RNGState",
    "SaveHandle",
    "SaveMetrics",
    "UnsaveableObjectError",
    "UnsupportedFormatError",
    "configure",
    "get_config",
    "list_checkpoints",
    "load",
    "load_checkpoint",
    "save",
]
