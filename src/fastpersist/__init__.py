"""fastpersist: checkpoint PyTorch training every iteration without slowing it down.

The names below are imported on first use (PEP 562), so ``import fastpersist`` and the
command line's ``--help`` and ``--version`` do not import torch; ``fastpersist.Checkpointer``
and the rest behave exactly as if imported eagerly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fastpersist.config import IOConfig, configure, get_config
from fastpersist.options import Durable, Nodes, Retention
from fastpersist.errors import (
    CheckpointerClosedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    DistributedCheckpointError,
    ReplicaMismatchError,
    UnsaveableObjectError,
    UnsupportedFormatError,
    UnsupportedTorchError,
    UnsafeFileError,
    UnverifiedCheckpointError,
)

if TYPE_CHECKING:
    from fastpersist.checkpointer import Checkpointer
    from fastpersist.dist import Comm, GlooComm, LocalComm
    from fastpersist.storage.backend import FileBackend
    from fastpersist.saving.handle import SaveHandle, SaveMetrics
    from fastpersist.single_file import load, save
    from fastpersist.state import RNGState
    from fastpersist.loading.view import CheckpointInfo, CheckpointView, list_checkpoints, load_checkpoint
    from fastpersist.tiers.resolve import open

__version__ = "0.1.0"

# The names that need torch, and the module each comes from.
_LAZY = {
    "Checkpointer": "fastpersist.checkpointer",
    # extension points: the file seam and the coordination seam (as DCP exports its own)
    "FileBackend": "fastpersist.storage.backend",
    "Comm": "fastpersist.dist",
    "GlooComm": "fastpersist.dist",
    "LocalComm": "fastpersist.dist",
    "SaveHandle": "fastpersist.saving.handle",
    "SaveMetrics": "fastpersist.saving.handle",
    "load": "fastpersist.single_file",
    "save": "fastpersist.single_file",
    "RNGState": "fastpersist.state",
    "CheckpointInfo": "fastpersist.loading.view",
    "CheckpointView": "fastpersist.loading.view",
    "list_checkpoints": "fastpersist.loading.view",
    "load_checkpoint": "fastpersist.loading.view",
    "open": "fastpersist.tiers.resolve",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastpersist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointView",
    "CheckpointerClosedError",
    "Comm",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "Checkpointer",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "DistributedCheckpointError",
    "Durable",
    "FileBackend",
    "GlooComm",
    "IOConfig",
    "LocalComm",
    "Nodes",
    "RNGState",
    "ReplicaMismatchError",
    "Retention",
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
