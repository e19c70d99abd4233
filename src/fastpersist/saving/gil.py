"""Sharing the GIL with the training thread while a checkpoint is written in the background.

CPython passes the GIL from a thread that runs Python to one that waits for it only after the
interpreter's switch interval (``sys.setswitchinterval``, 5 ms by default). The training thread
gives up the GIL inside every operator and takes it back after; while the save thread runs
Python (the skeleton's pickle, placement, the manifest), each of those returns can wait up to
a whole interval, so a background save costs training about the time its Python holds the GIL
(docs/benchmarks-history.md, "What overlap mode costs training, and why"). With a shorter interval the
training thread waits at most that long each time, and the save's Python runs while training
is inside its operators.

When ``IOConfig.switch_interval_us`` (``FASTPERSIST_SWITCH_US``) is set (it is 0, off, by
default: measured on the demo's GPT it halved what a thread holding only the GIL costs training
but did not lower what overlap mode's saves cost, docs/BENCHMARKS.md), fastpersist lowers the
interval to it while a Checkpointer writes in the background and puts back
the value it found when the last background save of the process ends, unless someone changed
the interval meanwhile (theirs is kept). A value already lower is kept. The interval is the
interpreter's, shared by every thread of the process.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_users = 0
_found: float | None = None  # the interval before fastpersist lowered it
_set: float | None = None  # the interval fastpersist set


@contextlib.contextmanager
def shared(interval_us: int) -> Iterator[None]:
    """Run the block with the interpreter's switch interval at most ``interval_us``."""
    if interval_us <= 0:
        yield
        return
    _enter(interval_us / 1e6)
    try:
        yield
    finally:
        _exit()


def _enter(interval: float) -> None:
    global _users, _found, _set
    with _lock:
        if _users == 0:
            current = sys.getswitchinterval()
            if interval < current:
                sys.setswitchinterval(interval)
                _found, _set = current, sys.getswitchinterval()
        _users += 1


def _exit() -> None:
    global _users, _found, _set
    with _lock:
        _users -= 1
        if _users == 0 and _set is not None and _found is not None:
            if sys.getswitchinterval() == _set:  # nobody else changed it meanwhile
                sys.setswitchinterval(_found)
            _found = _set = None
