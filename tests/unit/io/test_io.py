"""The I/O engine on its own: pieces to bytes, zero-copy, fallback, failures, the reader."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash

from fastpersist.config import IOConfig
from fastpersist.errors import CheckpointWriteError, CorruptCheckpointError
from fastpersist.io.buffers import ALIGN, BufferPool, aligned_empty
from fastpersist.io.files import DirectFile
from fastpersist.io.reader import ReadRequest, read_into
from fastpersist.io.writer import Piece, WriterThreads, write_pieces

from conftest import fds_under, supports_direct

KiB = 1024


def _bytes_tensor(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _write(path: str, pieces: list[Piece], cfg: IOConfig, pool: BufferPool | None = None) -> dict:
    pool = pool or BufferPool(cfg.chunk_bytes, cfg.num_buffers, pin=False)
    f = DirectFile(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, cfg.direct)
    try:
        return write_pieces(f, pieces, cfg, pool)
    finally:
        f.close()


def test_pieces_with_gaps_become_exact_bytes(tmp_path, small_io):
    a = _bytes_tensor(100_000, 1)
    b = _bytes_tensor(5, 2)
    pieces = [
        Piece(0, 10, data=b"0123456789"),
        Piece(4096, a.numel(), tensor=a, tag="a"),
        Piece(200_003, 5, tensor=b, tag="b"),
        Piece(300_000, 3, data=b"end", tag="end"),
    ]
    path = str(tmp_path / "f")
    digests = _write(path, pieces, small_io)
    raw = open(path, "rb").read()
    expected = bytearray(300_003)
    expected[0:10] = b"0123456789"
    expected[4096 : 4096 + a.numel()] = a.numpy().tobytes()
    expected[200_003:200_008] = b.numpy().tobytes()
    expected[300_000:] = b"end"
    assert raw == bytes(expected)
    assert digests == {
        "a": xxhash.xxh3_64_intdigest(a.numpy().tobytes()),
        "b": xxhash.xxh3_64_intdigest(b.numpy().tobytes()),
        "end": xxhash.xxh3_64_intdigest(b"end"),
    }


def test_zero_copy_from_aligned_memory(tmp_path, small_io):
    if not supports_direct(str(tmp_path)):
        pytest.skip("needs a filesystem with O_DIRECT")
    src = aligned_empty(300_001, pin=False)
    src.copy_(_bytes_tensor(300_001, 3))
    assert src.data_ptr() % ALIGN == 0
    pool = BufferPool(small_io.chunk_bytes, small_io.num_buffers, pin=False)
    path = str(tmp_path / "f")
    digests = _write(path, [Piece(8192, src.numel(), tensor=src, tag="x")], small_io, pool)
    assert open(path, "rb").read()[8192:] == src.numpy().tobytes()
    assert digests["x"] == xxhash.xxh3_64_intdigest(src.numpy().tobytes())
    # 300_001 bytes = 73 aligned pages written from the tensor; only the first 8 KiB of zeros
    # went through the pool, and the 1-byte tail through the buffered descriptor.
    assert pool.created == 1


def test_overlapping_pieces_are_refused(tmp_path, small_io):
    with pytest.raises(ValueError, match="overlap"):
        _write(str(tmp_path / "f"), [Piece(0, 10, data=b"x" * 10), Piece(5, 10, data=b"y" * 10)], small_io)


def test_two_pieces_with_one_tag_are_refused(tmp_path, small_io):
    """A tag names one piece's digest; a small piece is hashed in one call, so two pieces under
    one tag would silently get the digest of only one of them."""
    with pytest.raises(ValueError, match="same tag"):
        _write(str(tmp_path / "f"), [Piece(0, 10, data=b"x" * 10, tag=1), Piece(64, 10, data=b"y" * 10, tag=1)],
               small_io)


def test_pool_memory_stays_bounded(tmp_path, small_io):
    """However much is written, the pool never holds more than num_buffers buffers."""
    pool = BufferPool(small_io.chunk_bytes, small_io.num_buffers, pin=False)
    t = _bytes_tensor(5_000_000, 4)
    _write(str(tmp_path / "f"), [Piece(0, t.numel(), tensor=t)], small_io, pool)
    assert pool.created <= small_io.num_buffers
    assert os.path.getsize(tmp_path / "f") == t.numel()


def test_a_pool_is_warm_once_every_buffer_is_in_memory_and_lending_keeps_its_bytes_usable(small_io):
    """``warm`` holds once every buffer is made and resident (``mincore``); lent pages
    (``MADV_FREE``) stay in place while memory is plentiful, and a buffer whose pages the kernel
    dropped (here: ``MADV_DONTNEED``, what reclaim does to a lent page) makes the pool cold
    until :meth:`prepare` faults it in again."""
    pool = BufferPool(small_io.chunk_bytes, 3, pin=False)
    assert not pool.warm
    buf = pool.acquire()
    assert not pool.warm  # one of three made
    pool.release(buf)
    pool.prepare()
    assert pool.warm and pool.created == 3
    pool.lend_idle()
    assert pool.warm  # lent, not taken: nothing short of memory takes them
    bufs = [pool.acquire() for _ in range(3)]
    for i, b in enumerate(bufs):  # lent pages are written and read like any others
        ctypes.memset(b.addr, i + 1, b.nbytes)
        assert bytes(b.view[:8]) == bytes([i + 1]) * 8 and bytes(b.view[-8:]) == bytes([i + 1]) * 8
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(bufs[1].addr, bufs[1].nbytes, 4) == 0, ctypes.get_errno()  # MADV_DONTNEED
    for b in bufs:
        pool.release(b)
    assert not pool.warm
    pool.prepare_in_background()
    assert pool.wait_prepared(60)
    assert pool.warm and pool.created == 3


def test_memory_calls_pass_whole_addresses_whichever_comes_first():
    """The C library is typed once for every call: asking residency first (a pool's ``warm``)
    once left ``madvise`` untyped, so an address past 2^31 went as a C int and populating or
    lending silently failed, or hit the wrong memory. In a fresh process, residency first."""
    code = (
        "from fastpersist.io import buffers\n"
        "b = buffers.aligned_empty(1 << 20, pin=False)\n"
        "a = b.data_ptr()\n"
        "assert a >= 1 << 31, a\n"
        "assert not buffers.resident(a, 1 << 20)\n"
        "assert buffers.populate(a, 1 << 20)\n"
        "assert buffers.resident(a, 1 << 20)\n"
        "assert buffers.lend(a, 1 << 20)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("caller", ["pool", "save"])
def test_a_process_that_exits_while_its_pool_is_prepared_exits_cleanly(tmp_path, caller):
    """A pool prepared on a thread of its own (``fastpersist.save``'s first save, from the
    tensors, starts one) while the script returns at once: the daemon thread, ended inside
    torch at finalization, aborted the process (exit status 134) after its checkpoint was
    written. The exit now stops the preparation after the buffer in hand and waits for it."""
    path = str(tmp_path / "ck.pt")
    code = {
        "pool": "from fastpersist.io.buffers import BufferPool\n"
                "BufferPool(1 << 20, 64).prepare_in_background()\n",
        "save": "import torch, fastpersist as fp\n"
                "state = {f'w{i}': torch.full((1 << 18,), float(i)) for i in range(8)}\n"
                f"fp.save(state, {path!r}, config=fp.IOConfig(chunk_bytes=4 << 20, num_buffers=64))\n",
    }[caller]
    for _ in range(3):  # it aborted every time; three runs leave no luck in it
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    if caller == "save":
        assert torch.equal(torch.load(path, weights_only=True)["w7"], torch.full((1 << 18,), 7.0))


def test_refused_direct_request_falls_back(tmp_path, small_io, caplog):
    """A request the filesystem rejects with EINVAL (here: a real unaligned O_DIRECT write) is
    retried through the buffered descriptor, and O_DIRECT is dropped for the file."""
    if not supports_direct(str(tmp_path)):
        pytest.skip("needs a filesystem with O_DIRECT")
    path = str(tmp_path / "f")
    f = DirectFile(path, os.O_WRONLY | os.O_CREAT, "auto")
    pool = BufferPool(small_io.chunk_bytes, 1, pin=False)
    try:
        assert f.is_direct
        writers = WriterThreads(f, pool, 1)
        with caplog.at_level(logging.WARNING, logger="fastpersist"):
            writers.submit(memoryview(b"abc"), 1, None)  # unaligned offset, length and memory
            writers.join()
        assert not f.is_direct
    finally:
        f.close()
    assert open(path, "rb").read() == b"\0abc"


def test_enospc_names_the_file_and_returns_buffers(small_fs, small_io):
    pool = BufferPool(small_io.chunk_bytes, small_io.num_buffers, pin=False)
    t = _bytes_tensor(12_000_000, 5)
    path = os.path.join(small_fs, "big")
    with pytest.raises(CheckpointWriteError, match=r"big.*No space left"):
        _write(path, [Piece(0, 100, data=b"h" * 100), Piece(4096, t.numel(), tensor=t)], small_io, pool)
    assert fds_under(small_fs) == []
    got = [pool.acquire(timeout=1) for _ in range(pool.created)]
    assert len(got) == pool.created, "every staging buffer must return to the pool after a failure"


def _writer_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("fastpersist-writer-")}


def test_writer_threads_are_kept_between_files(tmp_path, small_io):
    """A file's writes lease threads kept by the process; the next file (and one written after
    a failed file) gets the same threads instead of starting new ones."""
    cfg = dataclasses.replace(small_io, writer_threads=2)
    t = _bytes_tensor(300_000, 7)
    _write(str(tmp_path / "a"), [Piece(0, t.numel(), tensor=t)], cfg)
    first = _writer_threads()
    assert len(first) >= 2, "the threads that wrote the file wait, idle, for the next one"
    for i in range(5):
        _write(str(tmp_path / f"b{i}"), [Piece(0, t.numel(), tensor=t)], cfg)
        assert open(tmp_path / f"b{i}", "rb").read() == t.numpy().tobytes()
    assert _writer_threads() == first


def test_writer_threads_serve_files_written_at_once(tmp_path, small_io):
    """Files written side by side each get threads of their own, and every byte lands."""
    cfg = dataclasses.replace(small_io, writer_threads=2)
    data = [_bytes_tensor(700_000 + i, 10 + i) for i in range(6)]
    with ThreadPoolExecutor(6) as ex:
        list(ex.map(lambda i: _write(str(tmp_path / f"f{i}"), [Piece(i, data[i].numel(), tensor=data[i])], cfg),
                    range(6)))
    for i in range(6):
        assert open(tmp_path / f"f{i}", "rb").read() == bytes(i) + data[i].numpy().tobytes()


def test_a_forked_child_writes_with_threads_of_its_own(tmp_path, small_io):
    """The parent's idle writer threads do not exist in a forked child; its writes start new
    ones instead of waiting for them."""
    t = _bytes_tensor(300_000, 8)
    _write(str(tmp_path / "parent"), [Piece(0, t.numel(), tensor=t)], small_io)
    assert _writer_threads()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the file is right, whatever happens
        code = 1
        try:
            signal.alarm(60)  # a child waiting for its parent's threads would hang: fail it
            _write(str(tmp_path / "child"), [Piece(0, t.numel(), tensor=t)], small_io)
            code = 0 if open(tmp_path / "child", "rb").read() == t.numpy().tobytes() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# ----------------------------------------------------------------------------- reader


@pytest.mark.parametrize("fresh", [False, True])
def test_reader_aligned_and_unaligned(tmp_path, small_io, fresh):
    data = _bytes_tensor(500_003, 6).numpy().tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    aligned = aligned_empty(512 * KiB, pin=False)
    plain = torch.zeros(1000, dtype=torch.uint8)
    f = DirectFile(str(path), os.O_RDONLY, small_io.direct)
    try:
        read_into(f, [
            ReadRequest(0, len(data), aligned.data_ptr(), aligned.numel(), fresh=fresh),
            ReadRequest(12_345, 1000, plain.data_ptr(), 1000),
        ], small_io)
    finally:
        f.close()
    assert aligned[: len(data)].numpy().tobytes() == data
    assert plain.numpy().tobytes() == data[12_345:13_345]


def test_reader_reports_truncation(tmp_path, small_io):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    dest = aligned_empty(64 * KiB, pin=False)
    f = DirectFile(str(path), os.O_RDONLY, small_io.direct)
    try:
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            read_into(f, [ReadRequest(0, 50_000, dest.data_ptr(), dest.numel())], small_io)
    finally:
        f.close()


def test_a_thread_that_cannot_start_strands_no_other(tmp_path, small_io, monkeypatch):
    """A lease that cannot start a thread fails the file before any request; the threads it
    took go back idle, and the next file writes with them (none ends, none new starts)."""
    cfg = dataclasses.replace(small_io, writer_threads=2)
    t = _bytes_tensor(300_000, 9)
    _write(str(tmp_path / "a"), [Piece(0, t.numel(), tensor=t)], cfg)
    before = _writer_threads()
    assert len(before) >= 2, "the threads that wrote the file wait, idle, for the next one"
    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:  # what CPython raises at the thread limit
        if self.name.startswith("fastpersist-writer-"):
            raise RuntimeError("can't start new thread")
        start(self)

    wide = dataclasses.replace(small_io, writer_threads=64)  # more than are kept idle: one must start
    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError, match="can't start"):
            _write(str(tmp_path / "b"), [Piece(0, t.numel(), tensor=t)], wide)
    assert os.path.getsize(tmp_path / "b") == 0, "a request was written after the lease failed"
    assert _writer_threads() == before
    _write(str(tmp_path / "c"), [Piece(0, t.numel(), tensor=t)], cfg)
    assert open(tmp_path / "c", "rb").read() == t.numpy().tobytes()
    assert _writer_threads() == before, "the next file started threads: the idle ones were stranded"


def test_writes_run_at_their_writer_s_niceness(tmp_path, small_io):
    """Threads kept between files are kept apart by CPU niceness: a file written by a nice'd
    thread (the durable drain's) is written by threads at that niceness, and a file written at
    the usual niceness never by those (an unprivileged thread cannot undo its niceness)."""
    t = _bytes_tensor(3_000_000, 11)

    def write_and_watch(name: str) -> set[int]:
        seen: set[int] = set()
        f = DirectFile(str(tmp_path / name), os.O_WRONLY | os.O_CREAT, small_io.direct)
        f.on_write = lambda *_: seen.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        try:
            write_pieces(f, [Piece(0, t.numel(), tensor=t)], small_io,
                         BufferPool(small_io.chunk_bytes, small_io.num_buffers, pin=False))
        finally:
            f.close()
        return seen

    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert write_and_watch("before") == {base}
    nice: list[set[int]] = []

    def niced() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, min(base + 5, 19))  # this thread only (Linux)
        nice.append(write_and_watch("niced"))

    th = threading.Thread(target=niced)
    th.start()
    th.join()
    assert nice == [{min(base + 5, 19)}]
    assert write_and_watch("after") == {base}
