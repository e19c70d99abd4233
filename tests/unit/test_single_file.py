"""fastpersist.save / fastpersist.load: round trips, torch compatibility, bad input."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import zipfile
from collections.abc import Iterator

import pytest
import torch

import fastpersist as fp
from fastpersist.config import IOConfig
from fastpersist.format import torchzip
from fastpersist.io import buffers, writer
from fastpersist.storage.backend import FileBackend

from conftest import fds_under
from helpers import states_equal as _equal


def _decoy(obj: object) -> object:
    """An object of the same structure with different tensor contents."""
    if isinstance(obj, torch.Tensor):
        if obj.numel() == 0:
            return torch.ones(1)
        return torch.full_like(obj, 1) if obj.dtype == torch.bool and not obj.all() else (
            torch.zeros_like(obj) if obj.dtype == torch.bool else obj + 1
        )
    if isinstance(obj, dict):
        return {k: _decoy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_decoy(v) for v in obj)
    return ("decoy", obj)


def roundtrip(obj: object, path: str, config: IOConfig | None = None) -> object:
    """Save a decoy first, check it differs, then save ``obj`` over it and load it back."""
    fp.save(_decoy(obj), path, config=config)
    assert not _equal(fp.load(path, config=config), obj), "the decoy must differ from the source"
    fp.save(obj, path, config=config)
    return fp.load(path, config=config)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.complex64, torch.uint8,
          torch.float64, torch.int64]


def _tensor(dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(n, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_dtypes(tmp_path, small_io, dtype):
    obj = {"t": _tensor(dtype, 1000), "scalar": _tensor(dtype, 1).reshape(()), "empty": _tensor(dtype, 0)}
    assert _equal(roundtrip(obj, str(tmp_path / "x.pt"), small_io), obj)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 65536 * 2 + 3, 700_001])
def test_roundtrip_sizes(tmp_path, small_io, nbytes):
    """Sizes around the 4 KiB block and larger than the 128 KiB staging pool of small_io."""
    assert small_io.pool_bytes < 700_001
    obj = {"t": _tensor(torch.uint8, nbytes), "after": _tensor(torch.float32, 3)}
    assert _equal(roundtrip(obj, str(tmp_path / "x.pt"), small_io), obj)


def test_roundtrip_views_and_shared_storages(tmp_path, small_io):
    base = torch.randn(64, 48)
    obj = {
        "base": base,
        "row": base[3],
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "tail_view": base.view(-1)[1000:],
        "other": torch.arange(10),
    }
    out = roundtrip(obj, str(tmp_path / "x.pt"), small_io)
    assert _equal(out, obj)
    ptr = out["base"].untyped_storage().data_ptr()
    for k in ("row", "transposed", "strided", "tail_view"):
        assert out[k].untyped_storage().data_ptr() == ptr, f"{k} must share the base storage"
    out["base"][3, 0] = 1234.0
    assert out["row"][0] == 1234.0, "views must stay views of one storage"


def test_tied_module_weights(tmp_path, small_io):
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    sd = model.state_dict(keep_vars=False)
    out = roundtrip(sd, str(tmp_path / "m.pt"), small_io)
    assert _equal(out, sd)
    assert out["0.weight"].data_ptr() == out["1.weight"].data_ptr()


def test_nested_containers_and_python_values(tmp_path, small_io):
    obj = {
        "list": [torch.ones(2), {"deep": (torch.zeros(3, dtype=torch.int8), 5)}],
        "tuple": (1, 2.5, "x", None, True),
        "empty_dict": {},
        "empty_list": [],
        "step": 17,
    }
    assert _equal(roundtrip(obj, str(tmp_path / "x.pt"), small_io), obj)


def test_torch_load_reads_fastpersist_files(tmp_path, small_io):
    obj = {"a": torch.randn(1000, 7), "v": torch.randn(1000, 7)[:, 2], "i": torch.arange(5), "s": "text"}
    path = str(tmp_path / "x.pt")
    fp.save(obj, path, config=small_io)
    out = torch.load(path, weights_only=True)
    assert _equal(out, obj)
    fd = os.open(path, os.O_RDONLY)
    try:
        records = torchzip.read_directory(path, fd, os.path.getsize(path))
    finally:
        os.close(fd)
    assert sum(r.name.startswith("data/") for r in records.values()) == 3
    assert all(r.offset % 64 == 0 for r in records.values()), "records start on 64-byte boundaries, as torch's"


def _phase_state() -> dict:
    """Large storages at several 4 KiB phases (torch's allocator gives 64-byte alignment only),
    one at an odd address, small and empty ones, views and sharing."""
    g = torch.Generator().manual_seed(5)
    pad = [torch.empty(k * 64, dtype=torch.uint8) for k in range(1, 6)]  # move the allocator around
    raw = bytearray(40_000 * 4 + 64)
    base = torch.frombuffer(raw, dtype=torch.uint8).data_ptr()
    skew = 1 if (base + 1) % 16 else 2  # an address 16 does not divide
    odd = torch.frombuffer(memoryview(raw)[skew : skew + 40_000 * 4], dtype=torch.uint8)  # keeps raw alive
    assert odd.untyped_storage().data_ptr() % 16
    odd[:] = 7
    obj = {"w": [torch.randn(64, 257, generator=g) for _ in range(6)], "odd": odd,
           "view": torch.randn(100_000, generator=g)[17:], "small": torch.arange(9), "empty": torch.empty(0, 3),
           "half": torch.randn(33, generator=g).half()}
    obj["alias"] = obj["w"][2][5:]
    del pad
    return obj


@pytest.fixture
def phased_io(small_io) -> IOConfig:
    return IOConfig(**{**small_io.__dict__, "single_file_zero_copy": True})


def test_large_storages_start_at_their_memory_s_phase_and_torch_reads_them(tmp_path, phased_io, monkeypatch):
    """The layout contract (docs/FORMAT.md) with single_file_zero_copy: a storage of
    zero_copy_min_bytes or more at a 16-byte aligned address starts where its file offset and
    address are equal modulo 4 KiB (the writer sends its middle straight from memory), one at
    an odd address on a page, every other record on 64 bytes. torch reads the file through all
    its readers."""
    small_io = phased_io
    obj = _phase_state()
    path = str(tmp_path / "p.pt")
    fp.save(obj, path, config=small_io)
    layout = torchzip.layout(obj, phase_from=small_io.zero_copy_min_bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        records = torchzip.read_directory(path, fd, os.path.getsize(path))
    finally:
        os.close(fd)
    assert {s.name: s.offset for s in layout.storages} == {n: r.offset for n, r in records.items()
                                                         if n.startswith("data/") and r.nbytes}
    phases, odd = set(), 0
    for s in layout.storages:
        addr = s.storage.data_ptr()
        if s.nbytes >= small_io.zero_copy_min_bytes and addr % 16 == 0:
            assert s.offset % 4096 == addr % 4096, s.name
            phases.add(addr % 4096)
        elif s.nbytes >= small_io.zero_copy_min_bytes:
            assert s.offset % 4096 == 0, f"{s.name}: a storage at an odd address starts on a page"
            odd += 1
        else:
            assert s.offset % 64 == 0, s.name
    assert len(phases) > 1, f"the state should put large storages at several phases, got {phases}"
    assert odd == 1, "the state holds one large storage at an address 16 does not divide"
    assert ".format_version" not in records and ".storage_alignment" not in records
    assert _equal(torch.load(path, weights_only=True), obj)
    assert _equal(torch.load(path, weights_only=True, mmap=True), obj)
    assert _equal(fp.load(path, config=small_io), obj)
    meta = torch.load(path, map_location="meta", weights_only=True)
    assert meta["w"][0].untyped_storage()._checkpoint_offset == records["data/0"].offset
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")  # torch checks its offsets against the headers
    assert _equal(torch.load(path, weights_only=True), obj)
    with zipfile.ZipFile(path) as z:  # a plain zip reader agrees on every record
        assert {i.filename.split("/", 1)[1]: i.file_size for i in z.infolist()} == \
            {n: r.nbytes for n, r in records.items()}


def test_fastpersist_loads_torch_save_files(tmp_path, small_io):
    obj = {"a": torch.randn(333, 5), "b": torch.arange(7, dtype=torch.int16)}
    path = str(tmp_path / "t.pt")
    torch.save(obj, path)
    assert _equal(fp.load(path, config=small_io), obj)


def test_map_location(tmp_path, small_io):
    path = str(tmp_path / "x.pt")
    fp.save({"a": torch.ones(3)}, path, config=small_io)
    out = fp.load(path, map_location="meta", config=small_io)
    assert out["a"].device.type == "meta"
    out = fp.load(path, map_location=lambda s, loc: s, config=small_io)
    assert torch.equal(out["a"], torch.ones(3))


@contextlib.contextmanager
def _staged_storage_bytes() -> Iterator[dict[str, int]]:
    """Counts, per storage record, the bytes the writer copies on their way to the file (the
    rest of a storage is written straight from its memory), while the ``with`` lasts."""
    staged: dict[str, int] = {}

    class Counting(writer.WriteObserver):
        def copied(self, piece, nbytes):
            if isinstance(piece.tag, str) and piece.tag.startswith("data/"):
                staged[piece.tag] = staged.get(piece.tag, 0) + nbytes

    with writer.observe_writes(Counting()):
        yield staged


def test_large_storages_are_written_from_their_memory(tmp_path, phased_io):
    """With single_file_zero_copy, only the partial pages at a large storage's ends pass
    through the staging pool, at whatever phase torch's allocator put it; small storages are
    staged whole."""
    small_io = phased_io
    obj = _phase_state()
    path = str(tmp_path / "z.pt")
    with _staged_storage_bytes() as staged:
        fp.save(obj, path, config=small_io)
    layout = torchzip.layout(obj, phase_from=small_io.zero_copy_min_bytes)
    for s in layout.storages:
        if s.nbytes >= small_io.zero_copy_min_bytes and s.storage.data_ptr() % 16 == 0:
            assert staged.get(s.name, 0) < 2 * 4096, f"{s.name}: {staged.get(s.name)} of {s.nbytes} bytes copied"
        else:
            assert staged.get(s.name, 0) == s.nbytes, s.name
    assert _equal(fp.load(path, config=small_io), obj)


def test_staged_large_storages_start_on_pages_and_are_staged(tmp_path, small_io):
    """With single_file_zero_copy=False (what the default does once the pool is warm), large
    storages start on page boundaries and go through the pool, but for one whose memory
    happens to start on a page too (torch's allocator does that as often as not), whose phase
    then matches: it is written from its memory."""
    small_io = IOConfig(**{**small_io.__dict__, "single_file_zero_copy": False})
    obj = _phase_state()
    path = str(tmp_path / "d.pt")
    with _staged_storage_bytes() as staged:
        fp.save(obj, path, config=small_io)
    fd = os.open(path, os.O_RDONLY)
    try:
        records = torchzip.read_directory(path, fd, os.path.getsize(path))
    finally:
        os.close(fd)
    layout = torchzip.layout(obj, phase_from=small_io.zero_copy_min_bytes, phased=False)
    assert {s.name: s.offset for s in layout.storages} == {n: r.offset for n, r in records.items()
                                                         if n.startswith("data/") and r.nbytes}
    for s in layout.storages:
        assert s.offset % (4096 if s.nbytes >= small_io.zero_copy_min_bytes else 64) == 0, s.name
        if s.nbytes >= small_io.zero_copy_min_bytes and s.storage.data_ptr() % 4096 == 0:
            assert staged.get(s.name, 0) < 4096, s.name
        else:
            assert staged.get(s.name, 0) == s.nbytes, s.name
    assert _equal(torch.load(path, weights_only=True), obj)
    assert _equal(fp.load(path, config=small_io), obj)


def _large(obj: object, cfg: IOConfig) -> list[torchzip.StorageRecord]:
    """The storages the writer can send from their memory (large, 16-byte aligned)."""
    layout = torchzip.layout(obj, phase_from=cfg.zero_copy_min_bytes)
    return [s for s in layout.storages if s.nbytes >= cfg.zero_copy_min_bytes and s.storage.data_ptr() % 16 == 0]


def test_by_default_a_cold_pool_is_not_touched_and_a_warm_one_is_used(tmp_path, small_io):
    """The default (single_file_zero_copy=None): while the process's staging pool is cold (its
    first save; the kernel took the idle pool's pages back), large storages are written from
    their memory and the pool is made in the background; once it is warm, they are staged. An
    idle pool's pages are lent to the kernel, and a taken page makes the pool cold again."""
    cfg = IOConfig(**{**small_io.__dict__, "chunk_bytes": 76 * 1024, "num_buffers": 3, "single_file_zero_copy": None})
    pool = buffers.shared_pool(cfg.chunk_bytes, cfg.num_buffers)  # this test's own: no other uses its size
    assert not pool.warm
    obj = _phase_state()
    large = _large(obj, cfg)
    assert any(s.storage.data_ptr() % 4096 for s in large)  # one the staged layout would copy

    def save(name: str) -> dict[str, int]:
        with _staged_storage_bytes() as staged:
            fp.save(obj, str(tmp_path / name), config=cfg)
        assert _equal(fp.load(str(tmp_path / name), config=cfg), obj)
        assert _equal(torch.load(str(tmp_path / name), weights_only=True), obj)
        return staged

    first = save("1.pt")
    assert all(first.get(s.name, 0) < 2 * 4096 for s in large), first
    assert pool.wait_prepared(120) and pool.warm
    second = save("2.pt")
    assert all(second.get(s.name, 0) == s.nbytes for s in large if s.storage.data_ptr() % 4096), second

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    buf = pool.acquire()
    try:  # what the kernel does to a lent page when memory runs short: it is gone
        assert libc.madvise(buf.addr, buf.nbytes, 4) == 0, ctypes.get_errno()  # MADV_DONTNEED
    finally:
        pool.release(buf)
    assert not pool.warm
    third = save("3.pt")
    assert all(third.get(s.name, 0) < 2 * 4096 for s in large), third
    assert pool.wait_prepared(120) and pool.warm


def test_a_loaded_storage_keeps_its_phase_so_saving_it_again_is_not_copied(tmp_path, phased_io):
    small_io = phased_io
    path = str(tmp_path / "x.pt")
    fp.save({"w": torch.randn(100_000)}, path, config=small_io)
    loaded = fp.load(path, config=small_io)
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = torchzip.read_directory(path, fd, os.path.getsize(path))["data/0"].offset
    finally:
        os.close(fd)
    assert loaded["w"].data_ptr() % 4096 == offset % 4096
    with _staged_storage_bytes() as staged:
        fp.save(loaded, str(tmp_path / "y.pt"), config=small_io)
    # 400000 bytes are not a whole number of pages: the partial pages at the ends are copied
    assert 0 < staged.get("data/0", 0) < 2 * 4096, f"{staged.get('data/0')} of 400000 bytes copied"
    assert _equal(fp.load(str(tmp_path / "y.pt"), config=small_io), loaded)


def test_refused_direct_io_falls_back_to_buffered(no_direct_fs, small_io, caplog):
    path = os.path.join(no_direct_fs, "x.pt")
    obj = {"a": torch.randn(50_000), "b": torch.arange(3)}
    with caplog.at_level("WARNING", logger="fastpersist"):
        assert _equal(roundtrip(obj, path, small_io), obj)
    assert "O_DIRECT is not available" in caplog.text
    strict = IOConfig(**{**small_io.__dict__, "direct": "on"})
    with pytest.raises(fp.CheckpointWriteError, match="x.pt"):
        fp.save(obj, path, config=strict)
    assert _equal(fp.load(path, config=small_io), obj)


def test_tmpfs(small_io):
    path = os.path.join("/dev/shm", f"fastpersist-test-{os.getpid()}.pt")
    try:
        obj = {"a": torch.randn(50_000), "b": torch.arange(3)}
        assert _equal(roundtrip(obj, path, small_io), obj)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_direct_off(tmp_path, small_io):
    cfg = IOConfig(**{**small_io.__dict__, "direct": "off"})
    obj = {"a": torch.randn(50_000)}
    assert _equal(roundtrip(obj, str(tmp_path / "x.pt"), cfg), obj)


# ----------------------------------------------------------------------------- bad input


def test_missing_file(tmp_path):
    with pytest.raises(fp.CheckpointNotFoundError, match="nope.pt"):
        fp.load(str(tmp_path / "nope.pt"))


def test_not_a_zip(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"this is not a checkpoint" * 100)
    with pytest.raises(fp.CorruptCheckpointError, match="junk.pt"):
        fp.load(str(path))


def test_zip_without_pickle(tmp_path):
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("hello.txt", "hi")
    with pytest.raises(fp.CorruptCheckpointError, match="no data.pkl"):
        fp.load(str(path))


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated_file(tmp_path, small_io, keep):
    path = str(tmp_path / "x.pt")
    fp.save({"a": torch.randn(200_000), "b": torch.randn(10)}, path, config=small_io)
    size = os.path.getsize(path)
    os.truncate(path, int(size * keep))
    with pytest.raises(fp.CorruptCheckpointError, match="x.pt"):
        fp.load(path, config=small_io)


def test_flipped_byte_names_the_record(tmp_path, small_io):
    path = str(tmp_path / "x.pt")
    fp.save({"a": torch.randn(10), "b": torch.randn(100_000)}, path, config=small_io)
    fd = os.open(path, os.O_RDONLY)
    rec = torchzip.read_directory(path, fd, os.path.getsize(path))
    os.close(fd)
    big = max((r for r in rec.values() if r.name.startswith("data/")), key=lambda r: r.nbytes)
    with open(path, "r+b") as f:
        f.seek(big.offset + 12345)
        b = f.read(1)
        f.seek(big.offset + 12345)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(fp.ChecksumMismatchError, match=rf"x\.pt.*{big.name}"):
        fp.load(path, config=small_io)
    out = fp.load(path, verify=False, config=small_io)  # explicit opt-out reads it anyway
    assert out["b"].shape == (100_000,)


def test_flipped_byte_in_pickle(tmp_path, small_io):
    path = str(tmp_path / "x.pt")
    fp.save({"a": torch.randn(10), "name": "abcdefgh"}, path, config=small_io)
    data = bytearray(open(path, "rb").read())
    i = data.index(b"abcdefgh")
    data[i] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(fp.ChecksumMismatchError, match="data.pkl"):
        fp.load(path, config=small_io)


def test_newer_format_version(tmp_path, small_io):
    path = str(tmp_path / "x.pt")
    fp.save({"a": torch.randn(10)}, path, config=small_io)
    data = bytearray(open(path, "rb").read())
    i = data.index(b'"version":1')
    data[i : i + 11] = b'"version":9'
    open(path, "wb").write(bytes(data))
    with pytest.raises(fp.UnsupportedFormatError, match="version 9"):
        fp.load(path, config=small_io)


def test_weights_only_refuses_code(tmp_path, small_io):
    path = str(tmp_path / "x.pt")
    fp.save({"obj": _Custom(3)}, path, config=small_io)
    with pytest.raises(fp.CheckpointReadError, match="weights_only=False"):
        fp.load(path, config=small_io)
    assert fp.load(path, weights_only=False, config=small_io)["obj"].v == 3


class _Custom:
    def __init__(self, v: int) -> None:
        self.v = v


def test_unsaveable_object_leaves_nothing(tmp_path, small_io):
    path = tmp_path / "x.pt"
    with pytest.raises(fp.UnsaveableObjectError):
        fp.save({"f": lambda: 1, "t": torch.ones(2)}, str(path), config=small_io)
    assert os.listdir(tmp_path) == []


def test_missing_directory(tmp_path, small_io):
    path = tmp_path / "no" / "such" / "x.pt"
    with pytest.raises(fp.CheckpointWriteError, match="does not exist"):
        fp.save({"t": torch.ones(2)}, str(path), config=small_io)
    assert not (tmp_path / "no").exists()


def test_read_only_directory(readonly_fs, small_io):
    with pytest.raises(fp.CheckpointWriteError, match="cannot create"):
        fp.save({"t": torch.ones(2)}, os.path.join(readonly_fs, "x.pt"), config=small_io)
    assert os.listdir(readonly_fs) == []
    assert fds_under(readonly_fs) == [], "no file descriptor may leak from a failed save"


def test_full_filesystem_keeps_earlier_file(small_fs, small_io):
    """ENOSPC: an error naming the file, nothing under the final name, the earlier file intact."""
    path = os.path.join(small_fs, "x.pt")
    early = {"t": torch.randn(1000)}
    fp.save(early, path, config=small_io)
    with pytest.raises(fp.CheckpointWriteError, match="x.pt"):
        fp.save({"t": torch.randn(3_000_000)}, path, config=small_io)  # 12 MB into 8 MiB
    assert sorted(os.listdir(small_fs)) == ["x.pt"], "no temporary file may be left behind"
    assert _equal(fp.load(path, config=small_io), early)
    assert fds_under(small_fs) == []


def test_full_filesystem_during_data_writes(small_fs, small_io, monkeypatch):
    """Without preallocation the failure comes from a data write, and is handled the same."""
    import fastpersist.single_file as sf

    monkeypatch.setattr(sf, "preallocate", lambda fd, size: None)
    path = os.path.join(small_fs, "x.pt")
    with pytest.raises(fp.CheckpointWriteError, match="No space left"):
        fp.save({"t": torch.randn(3_000_000)}, path, config=small_io)
    assert os.listdir(small_fs) == []


def test_save_replaces_atomically(tmp_path, small_io):
    path = str(tmp_path / "x.pt")
    fp.save({"v": torch.zeros(10)}, path, config=small_io)
    ino = os.stat(path).st_ino
    fp.save({"v": torch.ones(10)}, path, config=small_io)
    assert os.stat(path).st_ino != ino, "a new file must be renamed over the old one"
    assert torch.equal(fp.load(path)["v"], torch.ones(10))
    assert os.listdir(tmp_path) == ["x.pt"]


def test_the_collector_is_paused_during_a_save_and_running_after_it(tmp_path, small_io):
    """A full pass of the cyclic collector would wait in front of the disk: none runs while a
    save pickles and writes (a pass due then runs after it), and the collector is running again
    after the save, also after one that failed; a caller's disabled collector stays disabled."""
    inside = [False]  # from the save's first file operation (before its pickle) to its last
    passes: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start" and inside[0]:
            passes.append(info["generation"])

    class Watching(FileBackend):
        def is_dir(self, path):
            inside[0] = True
            return super().is_dir(path)

        def fsync_dir(self, path):
            super().fsync_dir(path)
            inside[0] = False

    obj = {"w": [torch.randn(1000) for _ in range(50)], "cycle": []}
    obj["cycle"].append(obj["cycle"])  # a reference cycle pickled too
    threshold = gc.get_threshold()
    gc.callbacks.append(note)
    gc.set_threshold(1)  # a collection at nearly every allocation, if the collector may run
    try:
        fp.save(obj, str(tmp_path / "x.pt"), config=small_io, backend=Watching())
        assert not inside[0]
        assert not passes, f"the collector ran during the save (generations {passes[:5]})"
        assert gc.isenabled()
        with pytest.raises(fp.UnsaveableObjectError):
            fp.save({"f": lambda: None}, str(tmp_path / "y.pt"), config=small_io)
        assert gc.isenabled()
        gc.disable()
        fp.save(obj, str(tmp_path / "z.pt"), config=small_io)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
        gc.callbacks.remove(note)
    out = fp.load(str(tmp_path / "x.pt"), config=small_io, weights_only=False)
    assert out["cycle"][0] is out["cycle"] and _equal(out["w"], obj["w"])
