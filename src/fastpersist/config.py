"""Tuning knobs of the I/O engine, and the one place where environment variables are read.

Every knob has a default measured on the project's reference machine (see docs/DESIGN.md) and an
environment variable that overrides it::

    FASTPERSIST_CHUNK_MB      size of one staging buffer and of one write request (MiB)
    FASTPERSIST_BUFFERS       staging buffers in the pool (pool = BUFFERS x CHUNK_MB)
    FASTPERSIST_WRITERS       write requests in flight (writer threads)
    FASTPERSIST_READERS       read requests in flight (reader threads)
    FASTPERSIST_READ_CHUNK_MB size of one read request (MiB)
    FASTPERSIST_READ_FILES    files of a checkpoint read at once by a load (each with READERS)
    FASTPERSIST_DIRECT        auto | on | off   (O_DIRECT; auto falls back to buffered I/O)
    FASTPERSIST_VERIFY        1 | 0             (verify checksums on load by default)
    FASTPERSIST_SINGLE_ZERO_COPY auto | 1 | 0   (fastpersist.save writes large tensors from their memory)
    FASTPERSIST_DRAIN_NICE    0..19             (the durable tier's drain thread's CPU niceness)
    FASTPERSIST_PIPELINE      auto | on | off   (a snapshot's copy pipelined with its writes)
    FASTPERSIST_SWITCH_US     microseconds      (the interpreter's switch interval during
                                                 background saves; 0, the default, leaves it)

:func:`configure` changes the process-wide defaults and doubles as a context manager that
restores the previous ones.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from fastpersist.errors import CheckpointError

MiB = 1 << 20

_DIRECT_MODES = ("auto", "on", "off")
_PIPELINE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class IOConfig:
    """Settings of the write and read engine.

    ``direct``: ``"auto"`` uses O_DIRECT where the filesystem accepts it and falls back to
    buffered I/O (logged once) where it does not; ``"on"`` makes a refusal an error; ``"off"``
    never uses O_DIRECT.

    ``snapshot_pipeline`` (the background modes' snapshot, docs/DESIGN.md "The snapshot
    pipeline"): ``"on"`` queues the save before its copy into the snapshot arena, and the writer
    writes each part of the arena as soon as it holds its copy: the commit comes sooner, but the
    copy shares the CPU and memory bandwidth with the writer, so ``save()`` blocks longer on a
    machine with few cores. ``"off"`` copies everything, then queues. ``"auto"`` pipelines a
    save that had to wait for the previous snapshot's writes (saves come faster than the disk
    takes them, so the time to commit is what holds training back) and copies first otherwise.
    """

    chunk_bytes: int = 32 * MiB
    num_buffers: int = 4
    writer_threads: int = 2
    reader_threads: int = 4
    read_chunk_bytes: int = 16 * MiB
    # A load reads this many files of a checkpoint side by side, each with reader_threads
    # requests in flight. One at a time measured best: on 2026-12-02 (0.5 GiB written by 4
    # ranks, cold cache, against a single-file load) 1 file 0.93, 2 files 0.96, 4 files 0.92; on
    # 2026-12-05 (1 GiB over 2 roots, 10 alternating pairs, cold cache and memory, checksums and
    # rebuild overlapped with the reads) 2 at once took 1.16x as long as 1 (docs/DESIGN.md).
    read_files_at_once: int = 1
    direct: str = "auto"
    verify: bool = True
    # A CPU storage whose memory is aligned for O_DIRECT is written straight from its memory,
    # without a copy through the pool, when it is at least this large.
    zero_copy_min_bytes: int = 1 * MiB
    # fastpersist.save: place each storage of zero_copy_min_bytes or more at its memory's 4 KiB
    # phase, so its middle is written from the tensor without a copy (True), or copy everything
    # through the staging pool (False). None (the default): from the tensors while the process's
    # staging pool is not warm (its first save, or after the kernel took the idle pool's pages
    # back), through the pool once it is. Measured here (docs/BENCHMARKS.md, "The single file
    # against the device"): a first save wrote 0.90 of raw from the tensors against 0.85 staged,
    # where the pool's first touch is paid inside the save; a later one 1.12 against 1.22 staged.
    single_file_zero_copy: bool | None = None
    # The niceness of the durable tier's drain thread (Linux, per thread): its CPU share against
    # training's threads. 0 drains at training's priority; 19 only when the CPU is otherwise idle.
    drain_nice: int = 10
    # The niceness of the save process (Checkpointer(engine="process"); Linux): its CPU share
    # against training's threads when they compete for the same cores.
    save_process_nice: int = 0
    snapshot_pipeline: str = "auto"
    # While a save runs in the background, the interpreter's switch interval is at most this
    # (microseconds; 0, the default, leaves it alone): the training thread then waits at most
    # this long for the GIL when the save thread runs Python (fastpersist.saving.gil). Off by default:
    # measured, it did not lower overlap mode's cost (docs/BENCHMARKS.md).
    switch_interval_us: int = 0

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096:
            raise CheckpointError(
                f"chunk_bytes must be a positive multiple of 4096, got {self.chunk_bytes}"
            )
        if self.read_chunk_bytes <= 0 or self.read_chunk_bytes % 4096:
            raise CheckpointError(
                f"read_chunk_bytes must be a positive multiple of 4096, got {self.read_chunk_bytes}"
            )
        for name in ("num_buffers", "writer_threads", "reader_threads", "read_files_at_once"):
            if getattr(self, name) < 1:
                raise CheckpointError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.switch_interval_us <= 100_000:
            raise CheckpointError(f"switch_interval_us must be in 0..100000, got {self.switch_interval_us}")
        for name in ("drain_nice", "save_process_nice"):
            if not 0 <= getattr(self, name) <= 19:
                raise CheckpointError(f"{name} must be in 0..19, got {getattr(self, name)}")
        if self.direct not in _DIRECT_MODES:
            raise CheckpointError(f"direct must be one of {_DIRECT_MODES}, got {self.direct!r}")
        if self.snapshot_pipeline not in _PIPELINE_MODES:
            raise CheckpointError(f"snapshot_pipeline must be one of {_PIPELINE_MODES}, got {self.snapshot_pipeline!r}")

    @property
    def pool_bytes(self) -> int:
        """Host memory the staging pool may hold."""
        return self.chunk_bytes * self.num_buffers


def _env_overrides(env: Mapping[str, str]) -> dict[str, object]:
    ints = {
        "FASTPERSIST_CHUNK_MB": ("chunk_bytes", MiB),
        "FASTPERSIST_BUFFERS": ("num_buffers", 1),
        "FASTPERSIST_WRITERS": ("writer_threads", 1),
        "FASTPERSIST_READERS": ("reader_threads", 1),
        "FASTPERSIST_READ_CHUNK_MB": ("read_chunk_bytes", MiB),
        "FASTPERSIST_READ_FILES": ("read_files_at_once", 1),
        "FASTPERSIST_DRAIN_NICE": ("drain_nice", 1),
        "FASTPERSIST_SAVE_NICE": ("save_process_nice", 1),
        "FASTPERSIST_SWITCH_US": ("switch_interval_us", 1),
    }
    out: dict[str, object] = {}
    for var, (field, scale) in ints.items():
        if var in env:
            try:
                out[field] = int(env[var]) * scale
            except ValueError:
                raise CheckpointError(f"{var} must be an integer, got {env[var]!r}") from None
    if "FASTPERSIST_DIRECT" in env:
        out["direct"] = env["FASTPERSIST_DIRECT"].strip().lower()
    if "FASTPERSIST_PIPELINE" in env:
        out["snapshot_pipeline"] = env["FASTPERSIST_PIPELINE"].strip().lower()
    if "FASTPERSIST_SINGLE_ZERO_COPY" in env:
        word = env["FASTPERSIST_SINGLE_ZERO_COPY"].strip().lower()
        out["single_file_zero_copy"] = None if word == "auto" else word not in ("0", "false", "no", "off")
    if "FASTPERSIST_VERIFY" in env:
        out["verify"] = env["FASTPERSIST_VERIFY"].strip().lower() not in ("0", "false", "no", "off")
    return out


def config_from_env(env: Mapping[str, str] | None = None) -> IOConfig:
    """The default configuration with the environment's overrides applied."""
    return IOConfig(**_env_overrides(os.environ if env is None else env))  # type: ignore[arg-type]


_current: IOConfig | None = None


def get_config() -> IOConfig:
    """The process-wide configuration (environment read once, on first use)."""
    global _current
    if _current is None:
        _current = config_from_env()
    return _current


class _Configured:
    """Returned by :func:`configure`: already applied; as a context manager it restores."""

    def __init__(self, previous: IOConfig) -> None:
        self._previous = previous

    def __enter__(self) -> IOConfig:
        return get_config()

    def __exit__(self, *exc: object) -> None:
        global _current
        _current = self._previous


def configure(**changes: object) -> _Configured:
    """Change the process-wide defaults; ``with configure(...):`` restores them on exit."""
    global _current
    previous = get_config()
    _current = dataclasses.replace(previous, **changes)  # type: ignore[arg-type]
    return _Configured(previous)
