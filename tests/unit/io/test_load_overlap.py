"""Loads rebuild the object and check its checksums while its bytes are still being read
(io/reader.py's Landed and read_then_rebuild), only when rebuilding reads no byte, and report
the errors in the order a sequential load would."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time

import pytest
import torch

import fastpersist
from fastpersist.errors import ChecksumMismatchError, CheckpointReadError, CorruptCheckpointError
from fastpersist.format import references, skeleton
from fastpersist.storage.backend import FileBackend
from fastpersist.io.reader import Landed, ReadsStopped, read_then_rebuild

from helpers import assert_state_equal, blocked, wait_until


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(300, generator=g),
            "p": torch.nn.Parameter(torch.randn(64, generator=g)), "step": 7, "dtype": torch.bfloat16,
            "half": torch.randn(1000, generator=g).to(torch.bfloat16)}


# ---------------------------------------------------------------------------------------- Landed


def test_landed_merges_ranges_in_any_order_and_wakes_a_waiter_once_covered():
    landed = Landed()
    got = []
    waiter = threading.Thread(target=lambda: (landed.wait(100, 300), got.append("covered")))
    waiter.start()
    landed.add(300, 100)
    landed.add(100, 100)
    assert not landed.covered(100, 300)  # 200..300 missing
    wait_until(lambda: blocked(waiter))  # the waiter waits: what landed does not cover its range
    assert got == []
    landed.add(200, 100)
    waiter.join()
    assert got == ["covered"]
    assert landed.covered(150, 200) and not landed.covered(50, 100) and not landed.covered(350, 100)
    landed.add(0, 50)
    landed.add(1000, 10)
    landed.add(40, 60)  # overlaps [0, 50) and ends where [100, 400) starts: one span [0, 400)
    assert landed.covered(0, 400) and landed.covered(1000, 10) and not landed.covered(0, 401)


def test_a_stop_ends_every_wait_with_reads_stopped():
    landed = Landed()
    errors = []

    def wait() -> None:
        try:
            landed.wait(0, 10)
        except ReadsStopped as e:
            errors.append(str(e))

    waiters = [threading.Thread(target=wait) for _ in range(3)]
    for w in waiters:
        w.start()
    landed.stop("reading /x failed")
    for w in waiters:
        w.join(10)
    assert errors == ["reading /x failed"] * 3
    landed.add(0, 10)
    landed.wait(0, 10)  # what landed can still be waited for


# ------------------------------------------------------------------------- read_then_rebuild


def _stage(read_error=None, check_error=None, rebuild_error=None, overlap=True):
    def read(landed):
        landed.add(0, 10)
        if read_error is not None:
            landed.stop("a read failed")
            raise read_error
        landed.add(10, 10)

    def check(landed):
        landed.wait(0, 10)
        if check_error is not None:
            raise check_error
        landed.wait(0, 20)

    def rebuild():
        if rebuild_error is not None:
            raise rebuild_error
        return "object"

    return read, check, rebuild, lambda: overlap


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("errors, wins", [
    ((OSError(errno.EIO, "read"), ValueError("check"), KeyError("rebuild")), OSError),
    ((None, ValueError("check"), KeyError("rebuild")), ValueError),
    ((OSError(errno.EIO, "read"), None, None), OSError),
    ((None, None, KeyError("rebuild")), KeyError),
    ((None, None, None), None),
])
def test_the_errors_keep_the_sequential_order_read_then_checksum_then_rebuild(errors, wins, overlap):
    stage = _stage(*errors, overlap=overlap)
    if wins is None:
        assert read_then_rebuild(*stage) == "object"
        return
    with pytest.raises(wins):
        read_then_rebuild(*stage)


def test_without_overlap_the_rebuild_starts_after_every_read_and_check():
    order = []
    lock = threading.Lock()

    def note(what):
        with lock:
            order.append(what)

    def read(landed):
        for k in range(5):
            landed.add(k * 10, 10)
        note("read")

    def check(landed):
        landed.wait(0, 50)
        note("check")

    out = read_then_rebuild(read, check, lambda: note("rebuild") or "object", lambda: False)
    assert out == "object" and order[-1] == "rebuild" and sorted(order[:2]) == ["check", "read"]


def test_a_check_of_bytes_no_read_covers_fails_instead_of_hanging():
    with pytest.raises(CheckpointReadError, match="without filling"):
        read_then_rebuild(lambda landed: landed.add(0, 10), lambda landed: landed.wait(0, 20), lambda: "object",
                          lambda: True)


def _read_until_stopped(seen: list[str], rebuilt: threading.Event | None = None):
    """Reads that never end by themselves: they land a byte at a time until the load stops
    them (then ``seen`` ends with "stopped"; a load that never stopped them would hang, and the
    test's timeout would report it). With ``rebuilt``, once the object is rebuilt and the load
    waits for its reads, the main thread is interrupted (Ctrl-C)."""
    def read(landed):
        k = 0
        while not landed.stopped and k < _READS_AT_MOST:
            if rebuilt is not None and rebuilt.is_set() and "interrupted" not in seen:
                seen.append("interrupted")
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            landed.add(k, 1)
            k += 1
            time.sleep(0.001)  # a read's pace; the loop ends on the stop, not on time
        seen.append("stopped" if landed.stopped else "never stopped")
    return read


_READS_AT_MOST = 60_000  # a minute at least: the reads end by themselves only if the load never stops them


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in these tests, whatever handler the process had."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_during_the_rebuild_stops_the_reads():
    seen: list[str] = []

    def rebuild():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        read_then_rebuild(_read_until_stopped(seen), lambda landed: None, rebuild, lambda: True)
    assert seen == ["stopped"], "the load returned before its reads ended"


def test_an_interrupt_while_the_load_waits_for_its_reads_stops_them():
    seen: list[str] = []
    rebuilt = threading.Event()
    with pytest.raises(KeyboardInterrupt):
        read_then_rebuild(_read_until_stopped(seen, rebuilt), lambda landed: None,
                          lambda: rebuilt.set() or "object", lambda: True)
    assert seen == ["interrupted", "stopped"], "the load returned before its reads ended"


def test_a_failed_read_of_one_file_is_reported_not_the_stop_it_caused_in_another(tmp_path):
    """Files read side by side (read_files_at_once=2): a failed read of one file stops the other
    file's reads, and the load must report the failure, not the ReadsStopped it caused. The
    other file's first read waits until the failure has happened, so it is under way then
    (an event, not a delay: had the files been read one at a time, it would wait in vain)."""
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    with fastpersist.Checkpointer(roots) as ck:
        ck.save(1, {"w": torch.randn(4 << 20), "v": torch.randn(4 << 20)})
    backend = _FailingDataReads(str(tmp_path / "b"))
    config = fastpersist.IOConfig(read_chunk_bytes=1 << 20, read_files_at_once=2)  # both files side by side
    with pytest.raises(CheckpointReadError, match="injected") as e:
        fastpersist.open(roots, backend=backend, config=config).load(1)
    assert not isinstance(e.value, ReadsStopped) and str(tmp_path / "b") in str(e.value)
    assert backend.held and not backend.alone, "the files were not read side by side"


class _FailingDataReads(FileBackend):
    """Fails the second read request of 1 MiB or more of the files under ``under``; the first
    such request of any other file waits until that failure has happened (``held``), or, if it
    never comes, 60 s (``alone``: the files were not read side by side)."""

    def __init__(self, under: str) -> None:
        super().__init__()
        self.under, self.count, self.lock = under, 0, threading.Lock()
        self.failed = threading.Event()
        self.held = self.alone = False

    def before_read(self, path, offset, nbytes):
        if nbytes is None or nbytes < 1 << 20:
            return
        if path.startswith(self.under):
            with self.lock:
                self.count += 1
                if self.count == 2:
                    self.failed.set()
                    raise OSError(errno.EIO, "injected read fault")
            return
        with self.lock:
            first, self.held = not self.held, True
        if first and not self.failed.wait(60):
            self.alone = True


# ------------------------------------------------------- when the rebuild may overlap the reads


def _skeleton_of(obj, tmp_path) -> tuple[bytes, dict[str, bytes]]:
    path = str(tmp_path / "x.pt")
    torch.save(obj, path)
    import zipfile

    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        prefix = names[0].split("/")[0]
        small = {n[len(prefix) + 1:]: z.read(n) for n in names if "/data/" not in n}
    return small["data.pkl"], small


def test_plain_tensors_parameters_and_values_rebuild_without_reading_bytes(tmp_path):
    raw, small = _skeleton_of({"m": torch.nn.Linear(3, 3).state_dict(), **_state(), "s": slice(1, 2),
                               "set": {1, 2}}, tmp_path)
    assert references.rebuild_reads_no_bytes(raw, small, None)
    assert references.rebuild_reads_no_bytes(raw, small, "cpu")
    assert references.rebuild_reads_no_bytes(raw, small, torch.device("cpu"))


def test_a_rebuild_that_may_read_bytes_is_not_overlapped(tmp_path):
    raw, small = _skeleton_of(_state(), tmp_path)
    assert not references.rebuild_reads_no_bytes(raw, small, "meta")  # a device other than the CPU
    assert not references.rebuild_reads_no_bytes(raw, small, lambda s, _loc: s)  # the caller's code
    assert not references.rebuild_reads_no_bytes(raw, small, {"cpu": "cpu"})
    other = "big" if sys.byteorder == "little" else "little"
    assert not references.rebuild_reads_no_bytes(raw, {**small, "byteorder": other.encode()}, None)  # swapped
    sparse, small_sparse = _skeleton_of({"s": torch.eye(4).to_sparse()}, tmp_path)  # validated after the load
    assert not references.rebuild_reads_no_bytes(sparse, small_sparse, None)
    q, small_q = _skeleton_of({"q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)}, tmp_path)
    assert not references.rebuild_reads_no_bytes(q, small_q, None)
    assert not references.rebuild_reads_no_bytes(b"not a pickle", small, None)
    for reads in (torch.device("cpu"), torch.Size([2])):  # each reads a tensor it is given
        r, sm = _skeleton_of({"x": reads, **_state()}, tmp_path)
        assert not references.rebuild_reads_no_bytes(r, sm, None)


class _ComplexOfATensor:
    """Pickles as ``complex(t)``: unpickling reads the tensor's value."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce__(self):
        return complex, (self.t,)


def test_a_value_computed_from_tensor_bytes_while_unpickling_is_computed_after_the_reads(tmp_path):
    big = torch.zeros(1 << 20)
    big[-1] = 5.0
    path = str(tmp_path / "c.pt")
    fastpersist.save({"big": big, "c": _ComplexOfATensor(big[-1])}, path)
    backend = _HeldReads(limit_s=0.3)  # slow reads: a rebuild run early would see zeros
    out = fastpersist.load(path, weights_only=False, backend=backend)
    assert out["c"] == complex(5.0) and backend.ran_out


# ------------------------------------------------------------------------ loads, end to end


class _HeldReads(FileBackend):
    """Holds every read of tensor data (requests of 1 MiB or more: the directory, small records
    and skeletons are smaller) until ``release`` is set (at most ``limit_s``), and records
    whether a hold ran out."""

    def __init__(self, limit_s: float = 10.0) -> None:
        super().__init__()
        self.release = threading.Event()
        self.ran_out = False
        self.limit_s = limit_s

    def before_read(self, path, offset, nbytes):
        if nbytes is not None and nbytes >= 1 << 20:
            if not self.release.wait(self.limit_s):
                self.ran_out = True


def _released_by_rebuild(monkeypatch, backend: _HeldReads) -> list[str]:
    calls = []
    original = skeleton.rebuild

    def rebuild(*args, **kwargs):
        calls.append("rebuild")
        backend.release.set()  # only a rebuild that runs while the reads wait gets here in time
        return original(*args, **kwargs)

    monkeypatch.setattr(skeleton, "rebuild", rebuild)
    return calls


@pytest.mark.parametrize("kind", ["single file", "checkpoint"])
def test_the_object_is_rebuilt_while_its_bytes_are_being_read(tmp_path, monkeypatch, kind):
    state = _state()
    backend = _HeldReads()
    calls = _released_by_rebuild(monkeypatch, backend)
    if kind == "single file":
        fastpersist.save(state, str(tmp_path / "s.pt"))
        out = fastpersist.load(str(tmp_path / "s.pt"), backend=backend)
    else:
        with fastpersist.Checkpointer([str(tmp_path / "a"), str(tmp_path / "b")]) as ck:
            ck.save(1, state)
        out = fastpersist.open([str(tmp_path / "a"), str(tmp_path / "b")], backend=backend).load(1)
    assert calls == ["rebuild"]
    assert not backend.ran_out, "the reads waited for a rebuild that only ran after them"
    assert_state_equal(out, state)


def test_a_load_moved_to_another_device_rebuilds_after_the_reads(tmp_path, monkeypatch):
    state = _state()
    fastpersist.save(state, str(tmp_path / "s.pt"))
    events = []
    original = skeleton.rebuild
    monkeypatch.setattr(skeleton, "rebuild", lambda *a, **k: events.append("rebuild") or original(*a, **k))
    out = fastpersist.load(str(tmp_path / "s.pt"), map_location=lambda s, _loc: s,
                           progress=lambda n: events.append("read"))
    # map_location is the caller's code, which may read the bytes: every read ends first
    assert events.count("rebuild") == 1 and events[-1] == "rebuild" and "read" in events
    assert_state_equal(out, state)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_flipped_byte_is_named_and_a_failed_read_wins_over_it(tmp_path):
    state = _state()
    path = str(tmp_path / "s.pt")
    fastpersist.save(state, path)
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    _flip(path, info.header_offset + 30 + name_len + extra_len + 1000)
    with pytest.raises(ChecksumMismatchError, match=info.filename.split("/", 1)[1]):
        fastpersist.load(path)
    backend = _FailingDataReads(path)  # a read of tensor data fails, after the flipped bytes were read
    with pytest.raises(CheckpointReadError, match="injected read fault") as e:
        fastpersist.load(path, backend=backend, config=fastpersist.IOConfig(read_chunk_bytes=1 << 20))
    assert not isinstance(e.value, ChecksumMismatchError)


def test_a_checkpoint_with_a_flipped_byte_is_refused_after_an_overlapped_load(tmp_path, monkeypatch):
    state = _state()
    roots = [str(tmp_path / "a")]
    with fastpersist.Checkpointer(roots) as ck:
        ck.save(1, state)
    step = os.path.join(roots[0], "step-00000001")
    data = max((os.path.join(step, f) for f in os.listdir(step) if f.endswith(".bin")), key=os.path.getsize)
    _flip(data, os.path.getsize(data) // 2)
    decided = []
    original = references.rebuild_reads_no_bytes
    monkeypatch.setattr(references, "rebuild_reads_no_bytes", lambda *a: decided.append(original(*a)) or decided[-1])
    with pytest.raises(CorruptCheckpointError, match="fail their checksum"):
        fastpersist.open(roots).load(1)
    assert decided == [True]  # the object was rebuilt while the bytes were read, and still refused
