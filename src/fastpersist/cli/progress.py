"""Progress bars for long commands: bytes done, rate, time left, on stderr.

Shown only when stderr is a terminal and ``--quiet`` was not given; otherwise every call is a
no-op, so output piped into a file or another program never holds a bar. The library itself
stays silent: it offers ``progress`` callbacks (bytes done, by increments) and the file seam,
and this module turns either into a tqdm bar.
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType
from typing import Any, TextIO

from fastpersist.storage.backend import FileBackend


def wanted(quiet: bool, stream: TextIO | None = None) -> bool:
    """Whether to show progress: not ``--quiet`` and the stream (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    if quiet:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class Progress:
    """A counter of bytes (or of ``unit``); call it with increments (thread-safe). A bar only if
    ``enabled``: done, total, rate and time left."""

    def __init__(self, total: int | None, desc: str, *, enabled: bool, stream: TextIO | None = None,
                 unit: str = "B") -> None:
        self.done = 0
        self._lock = threading.Lock()
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm  # imported only when a bar is shown

            scaled = {"unit": "iB", "unit_scale": True, "unit_divisor": 1024} if unit == "B" else {"unit": unit}
            self._bar = tqdm(total=total or None, desc=desc, **scaled,
                             file=sys.stderr if stream is None else stream, leave=False, dynamic_ncols=True,
                             mininterval=0.2)

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self._bar is not None:
                self._bar.update(nbytes)

    def describe(self, desc: str) -> None:
        """Name what is being done now (shown before the bar)."""
        with self._lock:
            if self._bar is not None:
                self._bar.set_description_str(desc)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class ProgressBackend(FileBackend):
    """Real files, counting the bytes of each read and write request into ``progress``.

    For the paths that offer no callback of their own (a sharded load, a single-file save):
    the file seam sees every request, by byte count.
    """

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self._progress = progress

    def before_read(self, path: str, offset: int | None, nbytes: int | None) -> None:
        if offset is not None and nbytes:  # offset None: the file is being opened
            self._progress(nbytes)

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        self._progress(nbytes)
