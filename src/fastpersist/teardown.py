"""Let torch's gloo worker threads finish before the interpreter finalizes.

A gloo worker thread (``pt_gloo_runloop``) completes a collective, wakes the caller, and only
then drops its reference to the collective's work and tensors. When that drop is the last
reference to a tensor whose Python object torch preserved (the Python caller forgot the tensor
first, as ``all_gather_object`` and DCP's plan exchanges do), the worker takes the GIL to free
it. If the interpreter is finalizing by then, CPython 3.11 ends the thread with
``pthread_exit``; the unwinding meets a ``noexcept`` C++ frame and the process aborts (SIGABRT,
"terminate called without an active exception") after the job saved everything. The window
opens when the worker is descheduled between waking the caller and dropping the work (a busy
machine) and the main thread reaches teardown first — or when the worker waits for a GIL the
main thread holds through the last steps before teardown.

This hook runs among the atexit functions, while the interpreter is whole, in every process
that imported fastpersist's distributed or DCP layer (:func:`install`, called on import): it releases the GIL in short sleeps and
reads each gloo worker's scheduler state from ``/proc/self/task`` until every worker has been
off the run queue (sleeping: waiting for work, or for a peer) for :data:`QUIET` observations in
a row, at most :data:`LIMIT_S`. A worker that still holds a finished collective is runnable or
waiting for the GIL, which each sleep hands it; one waiting for new work holds nothing. The
groups themselves are the job's and are left alone (fastpersist never destroys them). Costs a
few milliseconds at exit; nothing where no gloo worker runs or ``/proc`` is absent.
"""

from __future__ import annotations

import atexit
import logging
import os
import time

logger = logging.getLogger(__name__)

WORKER_NAMES = ("pt_gloo_runloop",)
QUIET = 3  # consecutive observations with every worker off the run queue
SLEEP_S = 0.002  # each observation follows a sleep that releases the GIL
LIMIT_S = 2.0

_TASKS = "/proc/self/task"


def gloo_workers() -> list[str]:
    """The thread ids of this process's gloo worker threads (empty without ``/proc``)."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() in WORKER_NAMES:
                    found.append(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _runnable(tids: list[str]) -> list[str]:
    busy = []
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # ended: holds nothing
            continue
        if state == "R":
            busy.append(tid)
    return busy


def drain_gloo_workers(limit_s: float = LIMIT_S) -> bool:
    """Wait (releasing the GIL) until every gloo worker thread has been off the run queue for
    :data:`QUIET` observations in a row; False if ``limit_s`` passed first."""
    tids = gloo_workers()
    if not tids:
        return True
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < QUIET:
        if time.monotonic() > deadline:
            logger.debug("gloo worker threads %s still runnable at exit after %.1f s", tids, limit_s)
            return False
        time.sleep(SLEEP_S)
        quiet = 0 if _runnable(tids) else quiet + 1
    return True


_installed = False


def install() -> None:
    """Register :func:`drain_gloo_workers` as an atexit function (once per process)."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(drain_gloo_workers)
