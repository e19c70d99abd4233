"""The test layer every test file builds on: state builders, one strict equality, one
multi-rank runner, and a backend that holds writes open until the test releases them.

Import it as ``from helpers import ...``: ``tests/support`` is on the path (pyproject's pytest
``pythonpath``; spawned ranks inherit it). ``SUPPORT`` is this folder (the child programs, the
fixtures), ``REPO`` the checkout.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastpersist.storage.backend import FileBackend
from fastpersist.tiers.durable.store import DirStore

SUPPORT = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(SUPPORT))

# ---------------------------------------------------------------------------------------------
# states


def tensor(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(*shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(*shape, generator=g, dtype=dtype)
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return torch.randn(*shape, generator=g).to(dtype)


def odd_state(seed: int) -> dict[str, Any]:
    """Odd sizes, dtypes, a view, a non-contiguous tensor, a tied (shared) storage, empties."""
    big = tensor(seed, 300_001)
    tied = tensor(seed + 1, 4097)
    return {
        "big": big,
        "view": big[1000:5000],
        "t": tensor(seed + 2, 64, 33).t(),
        "tied_a": tied,
        "tied_b": tied,
        "bf16": tensor(seed + 3, 4095, dtype=torch.bfloat16),
        "int8": tensor(seed + 4, 199, dtype=torch.int8),
        "bool": tensor(seed + 5, 17, dtype=torch.bool),
        "complex": tensor(seed + 6, 5, dtype=torch.complex64),
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, dtype=torch.int16),
        "nested": {"list": [tensor(seed + 7, 3), 1, "x"], "none": None, "tuple": (seed, 2.5)},
        "step": seed,
    }


def replicated(seed: int, nbytes: int = 800_000) -> dict[str, Any]:
    """A replicated state (the same on every rank for the same seed) of about ``nbytes``."""
    return {
        "model": {"w": tensor(seed, nbytes // 4 - 4097), "b": tensor(seed + 1, 4097, dtype=torch.bfloat16)},
        "tiny": [tensor(seed + 2 + i, 3) for i in range(20)],
        "step": seed,
    }


def per_rank(seed: int, rank: int) -> dict[str, Any]:
    return {"shard": tensor(seed * 100 + rank, 10_000 + 4097 * rank), "rank": rank}


# ---------------------------------------------------------------------------------------------
# equality


def _layout_difference(a: torch.Tensor, b: torch.Tensor, seen: dict[int, int]) -> str | None:
    if a.numel() and a.stride() != b.stride():
        return f"stride {a.stride()} vs {b.stride()}"
    if a.storage_offset() != b.storage_offset():
        return f"storage offset {a.storage_offset()} vs {b.storage_offset()}"
    if a.untyped_storage().nbytes() != b.untyped_storage().nbytes():
        return f"storage of {a.untyped_storage().nbytes()} vs {b.untyped_storage().nbytes()} bytes"
    sa, sb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    if a.untyped_storage().nbytes() and seen.setdefault(sa, sb) != sb:
        return "storage sharing differs (shares a storage in one state, not in the other)"
    return None


def _differ(a: Any, b: Any, path: str, seen: dict[int, int] | None) -> str | None:
    """``seen`` maps storages of ``a`` to those of ``b``; None: the layout is not compared."""
    if type(a) is not type(b) and not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if type(a) is not type(b):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        for what in ("dtype", "shape", "requires_grad", "device"):
            if getattr(a, what) != getattr(b, what):
                return f"{path}: {what} {getattr(a, what)} vs {getattr(b, what)}"
        if seen is not None:
            layout = _layout_difference(a, b, seen)
            if layout:
                return f"{path}: {layout}"
        ab = a.detach().cpu().contiguous().view(-1).view(torch.uint8) if a.numel() else a.detach().cpu()
        bb = b.detach().cpu().contiguous().view(-1).view(torch.uint8) if b.numel() else b.detach().cpu()
        if not torch.equal(ab, bb):  # bitwise: NaNs and -0.0 count
            return f"{path}: values differ"
        return None
    if isinstance(a, dict):
        if list(a.keys()) != list(b.keys()):
            return f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            d = _differ(a[k], b[k], f"{path}[{k!r}]", seen)
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _differ(x, y, f"{path}[{i}]", seen)
            if d:
                return d
        return None
    if isinstance(a, float):  # bitwise: -0.0 is not 0.0, NaN equals NaN
        return None if struct.pack("<d", a) == struct.pack("<d", b) else f"{path}: {a!r} vs {b!r}"
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy arrays and scalars
        import numpy as np

        same = a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        return None if same else f"{path}: arrays differ"
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def state_difference(a: Any, b: Any, *, layout: bool = True) -> str | None:
    """None if ``a`` and ``b`` are equal: same structure, types and dict key order, tensors bit
    for bit (NaNs and -0.0 count) with the same dtype, shape, device and requires_grad; else
    where they differ.

    ``layout`` (the default) also compares how tensors lie in memory: stride, storage offset,
    storage size and storage sharing (a view or a tied weight must come back as one). Pass
    ``layout=False`` for tensors rebuilt whole (gathered from shards, moved between devices),
    whose layout is not what the test checks."""
    fwd = _differ(a, b, "state", {} if layout else None)
    if fwd or not layout:
        return fwd
    return _differ(b, a, "state", {})  # sharing must hold both ways


def assert_state_equal(a: Any, b: Any, *, layout: bool = True) -> None:
    diff = state_difference(a, b, layout=layout)
    if diff is not None:
        raise AssertionError(diff)


def states_equal(a: Any, b: Any, *, layout: bool = True) -> bool:
    return state_difference(a, b, layout=layout) is None


# ---------------------------------------------------------------------------------------------
# ranks


def leave(status: int = 0) -> None:
    """End a test's job process once it has reported: flush and exit without interpreter
    teardown. torch keeps a gloo group alive past ``destroy_process_group()`` once DTensor
    collectives ran on it (FSDP2, ``full_tensor``; measured: its worker threads survive), and
    a gloo worker that releases a collective's tensors while the interpreter is finalizing
    aborts the process (SIGABRT) after everything was saved and checked. That abort is
    torch's, in the job's own groups; fastpersist's own groups are closed before teardown, and
    ``test_clean_exit.py`` checks fastpersist's jobs exit cleanly through a real teardown.

    Everything an exit runs before the teardown still runs: threading's exit hooks (where the
    Checkpointer finishes the saves in flight) and the join of non-daemon threads, then the
    atexit functions."""
    import atexit
    import threading as _threading

    shutdown = getattr(_threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _rank_main(rank: int, world: int, init: str, out: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a crash or a hang shows every thread's stack in the test's output
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result: tuple[bool, Any] = (True, fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = (False, traceback.format_exc())
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    leave()


def run_ranks(tmp_path: Any, world: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes on a gloo process group;
    return each rank's result, or raise with the failing ranks' tracebacks. ``fn`` must be a
    module-level function (spawn pickles it by name). Ranks still running after ``timeout``
    seconds (a hang) are killed and the test fails."""
    import tempfile
    import time

    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix="ranks-", dir=str(tmp_path))
    init = f"file://{out}/rendezvous"
    ctx = mp.start_processes(_rank_main, args=(world, init, out, fn, args), nprocs=world, start_method="spawn",
                             join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"ranks still running after {timeout} s: a hang")
    results = []
    failures = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.pkl"), "rb") as f:
            ok, value = pickle.load(f)
        if not ok:
            failures.append(f"--- rank {r} ---\n{value}")
        results.append(value)
    if failures:
        raise AssertionError("rank(s) failed:\n" + "\n".join(failures))
    return results


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a job's rendezvous, MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# backends


class HeldBackend(FileBackend):
    """Real files; writes to paths containing ``hold`` wait until :meth:`release` (an event,
    not a sleep). ``holding`` is set once a write is waiting."""

    def __init__(self, hold: str) -> None:
        self.hold = hold
        self.holding = threading.Event()
        self._released = threading.Event()

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        if self.hold in path and not self._released.is_set():
            self.holding.set()
            if not self._released.wait(60):
                raise TimeoutError("the test never released the held write")

    def release(self) -> None:
        self._released.set()


class HeldStore(DirStore):
    """A real durable directory whose uploads of keys containing ``hold`` wait for release()."""

    def __init__(self, path: str, hold: str = "") -> None:
        super().__init__(path)
        self.hold = hold
        self.holding = threading.Event()
        self.released = threading.Event()

    def put_file(self, key, chunks, size):  # type: ignore[no-untyped-def]
        if self.hold and self.hold in key and not self.released.is_set():
            self.holding.set()
            if not self.released.wait(60):
                raise TimeoutError("the test never released the held upload")
        super().put_file(key, chunks, size)


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for ``condition`` (polled); fail the test if it does not hold within ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def blocked(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in ``threading.Condition.wait`` (where an Event, a Future's
    result and a Queue wait too): its innermost Python frame is that function's.

    A test waits for this state with :func:`wait_until` to know that a thread reached the wait
    it checks, instead of guessing how long getting there takes; a thread that does not block
    never reaches it (and finishes instead). Start looking only once the thread is past the
    waits of its own that came before."""
    frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    return frame is not None and frame.f_code is threading.Condition.wait.__code__


def release_at_exit(release: Callable[[], None]) -> None:
    """Call ``release`` as soon as the interpreter starts exiting, before the exit hooks of the
    Checkpointers built so far finish their saves in flight: threading's exit hooks run
    last-registered first, and a Checkpointer registers one when it is built. A child script
    holds its writes (``HeldBackend``) and passes ``backend.release`` here after building its
    Checkpointer: its save is then certainly in flight when the script ends."""
    threading._register_atexit(release)  # type: ignore[attr-defined]


def file_names(paths: Sequence[str]) -> list[str]:
    """Every file under ``paths``, relative, sorted (to compare what a failure left behind)."""
    out = []
    for p in paths:
        for d, _, files in os.walk(p):
            out += [os.path.relpath(os.path.join(d, f), p) for f in files]
    return sorted(out)


# ---- sharded state (FSDP2 on a CPU mesh) ------------------------------------------------------


def small_mlp() -> Any:
    """A small model whose layer sizes do not divide evenly by 3 or 4 ranks."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 130), torch.nn.ReLU(), torch.nn.Linear(130, 37))


def fsdp_mlp(world: int) -> tuple[Any, Any]:
    """``small_mlp`` sharded with FSDP2 ``fully_shard`` over a 1-D CPU mesh of ``world`` ranks
    (inside a process group), and an AdamW over it."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    m = small_mlp()
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def gathered(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every value of a nested state by dotted key, tensors (DTensors gathered whole) cloned."""
    import torch

    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(gathered(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(gathered(v, f"{prefix}{i}."))
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = (obj.full_tensor() if hasattr(obj, "full_tensor") else obj).detach().clone()
    else:
        out[prefix[:-1]] = obj
    return out
