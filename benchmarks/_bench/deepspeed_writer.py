"""DeepSpeed's FastPersist writer (``deepspeed.io.FastFileWriter``) as a benchmark contender.

What DeepSpeed's ``FastCheckpointEngine`` does per file, set up as its engine sets it up once:
an aio handle with DeepSpeed's defaults (1 MiB blocks, queue depth 8, overlapped events, one
intra-op thread) and a 64 MiB double I/O buffer, zeroed when the engine starts; then each save is
``torch.save(obj, FastFileWriter(path, ...))``, whose close fsyncs the file. The I/O buffer is
pinned where a GPU is present; on this CPU-only machine it is plain memory, as DeepSpeed's CPU
accelerator leaves it.

DeepSpeed's CPU accelerator has no build of its ``UtilsBuilder`` op (the writer only needs its
``cast_to_byte_tensor``), so the generic builder, which compiles on a CPU, is put in its place.
Both ops build with ninja on first use (libaio-dev for the aio op; minutes, then cached).
"""

from __future__ import annotations

import os
from typing import Any

IO_BUFFER_BYTES = 64 << 20


def available() -> str | None:
    """None if DeepSpeed's writer can run here, else why not."""
    try:
        import deepspeed.io  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not measured
        return f"deepspeed not importable ({type(e).__name__}: {e})"
    return None


class Writer:
    """DeepSpeed's checkpoint writer, set up once (an engine's start), saving files."""

    def __init__(self) -> None:
        import torch
        import deepspeed.io.fast_file_writer as ffw
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.ops.op_builder.utils import UtilsBuilder

        ffw.UtilsBuilder = UtilsBuilder  # the generic build (see the module's docstring)
        self._ffw = ffw
        self._buffer = torch.empty(IO_BUFFER_BYTES, dtype=torch.uint8)
        if torch.cuda.is_available():
            self._buffer = self._buffer.pin_memory()
        self._buffer.zero_()
        self._handle = AsyncIOBuilder().load(verbose=False).aio_handle(
            block_size=1 << 20, queue_depth=8, single_submit=False, overlap_events=True, intra_op_parallelism=1)

    def save(self, obj: Any, path: str) -> None:
        import torch

        config = self._ffw.FastFileWriterConfig(dnvme_handle=self._handle, pinned_tensor=self._buffer,
                                                double_buffer=True)
        writer = self._ffw.FastFileWriter(path, config)
        torch.save(obj, writer)
        writer.close()  # drains the buffer, fsyncs and closes the file


def silence() -> None:
    """DeepSpeed logs at INFO and its writer prints every file's sizes: keep the table clean."""
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    os.environ.setdefault("DS_BUILD_OPS", "0")
