"""fastpersist: checkpoint PyTorch training every iteration without slowing it down."""

from fastpersist.config import IOConfig, configure, get_config
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
from fastpersist.single_file import load, save

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "IOConfig",
    "UnsaveableObjectError",
    "UnsupportedFormatError",
    "configure",
    "get_config",
    "load",
    "save",
]
