"""Run one reader call in a child process with a memory limit and a timeout, and classify it.

Children are forked from a *forkserver* that has torch and fastpersist imported once, so a case
costs a fork, not an interpreter start. In the child, ``RLIMIT_AS`` is set to the address space
it already has plus ``memory_bytes``; the parent kills it after ``timeout_s``. The outcome is:

- ``value``: the call returned (its result, which must be picklable and small);
- ``checkpoint_error``: it raised a ``fastpersist.CheckpointError`` (type and message kept);
- ``oom``: it raised ``MemoryError``, or a CheckpointError saying it could not allocate;
- ``other``: any other exception (type and message kept);
- ``hang``: it ran past the timeout and was killed;
- ``crash``: it died (a signal, an exit) without reporting.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import resource
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_ctx: Any = None


def _context() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(["torch", "fastpersist", "fastpersist.cli.checkpoints", "fuzz.cases"])
    return _ctx


@dataclass(frozen=True)
class Outcome:
    kind: str
    value: Any = None
    error_type: str = ""
    message: str = ""

    def __str__(self) -> str:
        detail = f" {self.error_type}: {self.message[:300]}" if self.error_type else ""
        return f"{self.kind}{detail}"


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _caused_by_memory(e: BaseException) -> bool:
    """Whether a MemoryError is anywhere in ``e``'s chain (a wrapper must not hide one)."""
    seen = 0
    cur: BaseException | None = e
    while cur is not None and seen < 20:
        if isinstance(cur, MemoryError):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


def _child(conn: multiprocessing.connection.Connection, memory_bytes: int, fn: Callable[..., Any],
           args: tuple[Any, ...]) -> None:
    limit = _vm_size() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from fastpersist import CheckpointError

    try:
        result: tuple[Any, ...] = ("value", fn(*args), "", "")
    except MemoryError as e:
        result = ("oom", None, "MemoryError", str(e))
    except CheckpointError as e:
        kind = "oom" if "cannot allocate" in str(e) or _caused_by_memory(e) else "checkpoint_error"
        result = (kind, None, type(e).__name__, str(e))
    except BaseException as e:  # noqa: BLE001 - classified, not handled
        result = ("other", None, type(e).__name__, f"{e}\n{traceback.format_exc()[-1500:]}")
    conn.send(result)
    conn.close()
    os._exit(0)


def run_isolated(fn: Callable[..., Any], *args: Any, timeout_s: float = 20.0,
                 memory_bytes: int = 1 << 30) -> Outcome:
    """Run ``fn(*args)`` in a fresh child (``fn`` must be importable by name) and classify it."""
    ctx = _context()
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, memory_bytes, fn, args), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            child.kill()
            child.join()
            return Outcome("hang", message=f"no answer after {timeout_s} s")
        try:
            kind, value, error_type, message = receive.recv()
        except (EOFError, OSError):
            child.join()
            return Outcome("crash", message=f"exit code {child.exitcode}")
    finally:
        receive.close()
    child.join(timeout_s)
    if child.exitcode is None:
        child.kill()
        child.join()
    return Outcome(kind, value, error_type, message)
