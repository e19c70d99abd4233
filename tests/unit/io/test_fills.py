"""The snapshot pipeline: the writer reads arena memory only once save() copied it there
(fastpersist.io.fills), so writes start during the copy and never read bytes not yet copied."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch
import xxhash

import fastpersist as fp
from fastpersist.config import IOConfig
from fastpersist.storage.backend import FileBackend
from fastpersist.io.buffers import BufferPool, aligned_empty, memory_view
from fastpersist.io.fills import Fill, wait_filled
from fastpersist.io import writer
from fastpersist.io.writer import Piece
from fastpersist.objects.write import write_new_file

MIB = 1 << 20


class _Watching(FileBackend):
    """Counts the data writes that reach the file."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[int, int]] = []
        self.first = threading.Event()

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        self.writes.append((offset, nbytes))
        self.first.set()


def _write_in_thread(path: str, arena: torch.Tensor, nbytes: int, backend: FileBackend):
    cfg = IOConfig(chunk_bytes=MIB, num_buffers=2, writer_threads=1, direct="auto")
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["digests"] = write_new_file(path, [Piece(0, nbytes, tag=0, addr=arena.data_ptr())], nbytes, 0,
                                            backend, cfg, BufferPool(MIB, 2))
        except BaseException as e:  # noqa: BLE001 - checked by the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_the_writer_writes_each_part_once_it_is_copied_and_never_before(tmp_path):
    n = 8 * MIB
    arena = aligned_empty(n)
    arena.fill_(0xEE)  # what an arena holds before the copy: the previous snapshot's bytes
    source = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    fill = Fill(arena.data_ptr(), n)
    backend = _Watching()
    try:
        t, out = _write_in_thread(str(tmp_path / "f.bin"), arena, n, backend)
        t.join(timeout=0.5)  # an event the test controls decides, not this: the writer must be waiting
        assert t.is_alive() and not backend.writes, "the writer read the arena before any byte was copied"
        arena[: 2 * MIB].copy_(source[: 2 * MIB])
        fill.advance(2 * MIB)
        assert backend.first.wait(60), "nothing written once the first part was copied"
        assert t.is_alive(), "the writer finished before the copy did"
        assert all(off + nb <= 2 * MIB for off, nb in backend.writes), backend.writes
        arena[2 * MIB :].copy_(source[2 * MIB :])
        fill.complete()
        t.join(60)
    finally:
        fill.close()
    assert "error" not in out, out
    with open(tmp_path / "f.bin", "rb") as f:
        assert f.read() == source.numpy().tobytes()


def test_hashing_waits_for_the_copy_and_the_digests_stay_exact(tmp_path):
    """A pipelined write hashes nothing while save()'s copy runs (both would share the CPU);
    once the copy is over it catches up, and every digest is the digest of the piece's bytes:
    a small record, small pieces of the arena (staged) and a large one (written from memory)."""
    n = 6 * MIB
    arena = aligned_empty(n)
    arena.fill_(0xEE)
    source = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    header = b"fastpersist" * 300  # 3300 bytes, staged from a bytes object
    small = [(4096 + k * 5000, 5000) for k in range(3)]  # arena bytes written through the pool
    big_at = 5 * MIB  # a page-aligned part of the arena, written straight from it
    pieces = [Piece(0, len(header), data=header, tag="header")]
    pieces += [Piece(off, nb, tag=f"small{k}", addr=arena.data_ptr() + off) for k, (off, nb) in enumerate(small)]
    pieces.append(Piece(big_at, 5 * MIB, tag="big", addr=arena.data_ptr() + MIB))  # to the arena's end
    size = big_at + 5 * MIB
    fill = Fill(arena.data_ptr(), n)
    hashed_while_copying: list[str] = []
    hashed: set[str] = set()

    class Watching(writer.WriteObserver):
        def hashed(self, tag, nbytes):
            hashed.add(tag)
            if fill.copying():
                hashed_while_copying.append(tag)

    cfg = IOConfig(chunk_bytes=MIB, num_buffers=2, writer_threads=1, direct="auto", zero_copy_min_bytes=MIB)
    backend = _Watching()
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["digests"] = write_new_file(str(tmp_path / "f.bin"), pieces, size, 0, backend, cfg, BufferPool(MIB, 2))
        except BaseException as e:  # noqa: BLE001 - checked by the test
            out["error"] = e

    t = threading.Thread(target=run)
    with writer.observe_writes(Watching()):
        t.start()
        try:
            for k in range(n // MIB):  # the copy, front to back, while the writer writes what landed
                arena[k * MIB : (k + 1) * MIB].copy_(source[k * MIB : (k + 1) * MIB])
                fill.advance((k + 1) * MIB)
                if k == 0:
                    assert backend.first.wait(60), "nothing written once the first part was copied"
            fill.complete()
            t.join(60)
        finally:
            fill.close()
    assert "error" not in out, out
    assert hashed == {p.tag for p in pieces}, "the observer missed hashing: this test would check nothing"
    assert hashed_while_copying == [], f"hashed while the copy ran: {hashed_while_copying}"
    want = {"header": xxhash.xxh3_64_intdigest(header), "big": xxhash.xxh3_64_intdigest(source[MIB:].numpy())}
    for k, (off, nb) in enumerate(small):
        want[f"small{k}"] = xxhash.xxh3_64_intdigest(source[off : off + nb].numpy())
    assert out["digests"] == want


def test_a_failed_copy_fails_the_write_naming_the_cause(tmp_path):
    n = 4 * MIB
    arena = aligned_empty(n)
    fill = Fill(arena.data_ptr(), n)
    try:
        t, out = _write_in_thread(str(tmp_path / "f.bin"), arena, n, FileBackend())
        fill.advance(MIB)
        fill.fail(MemoryError("the copy ran out of memory"))
        t.join(60)
        assert isinstance(out.get("error"), fp.CheckpointWriteError)
        assert "snapshot copy failed" in str(out["error"]) and "ran out of memory" in str(out["error"])
        # the bytes that were copied are still readable; the ones that were not raise until the job ends
        wait_filled(arena.data_ptr(), MIB)
        with pytest.raises(fp.CheckpointWriteError):
            memory_view(arena.data_ptr() + MIB, MIB)
    finally:
        fill.close()
    memory_view(arena.data_ptr() + MIB, MIB)  # closed: no longer a fill


def test_memory_outside_every_fill_is_read_at_once():
    """A fill that has copied nothing yet holds back readers of its own bytes only: memory
    elsewhere, just past its end or just before its start, is read at once (a reader that
    waited here would wait for ever: the test's timeout reports it)."""
    arena = aligned_empty(MIB)
    other = aligned_empty(MIB)
    fill = Fill(arena.data_ptr(), MIB)
    try:
        outside = [(other.data_ptr(), MIB), (arena.data_ptr() + MIB, 10), (arena.data_ptr() - 10, 10)]
        assert fill.copying() and fill.covers(arena.data_ptr() + MIB - 1, 1)
        assert not any(fill.covers(addr, n) for addr, n in outside)
        assert len(memory_view(other.data_ptr(), MIB)) == MIB
        for addr, n in outside:
            wait_filled(addr, n)
    finally:
        fill.close()


@pytest.mark.parametrize("mode,pipeline", [("snapshot", "on"), ("snapshot", "off"), ("overlap", "on")])
def test_state_changed_after_save_returns_is_not_in_the_checkpoint(tmp_path, mode, pipeline):
    """save() returns once its copies are made (the writes may still be running): changing the
    state then leaves the checkpoint as it was at the call."""
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode=mode, config=IOConfig(snapshot_pipeline=pipeline))
    w = torch.randn(6 * MIB // 4, generator=torch.Generator().manual_seed(2))
    b = torch.randn(3 * MIB // 4 + 17, generator=torch.Generator().manual_seed(3))
    expected = {"w": w.clone(), "b": b.clone(), "step": 1}
    h = ck.save(1, {"w": w, "b": b, "step": 1})
    w.add_(1.0)
    b.zero_()
    h.result()
    got = ck.load()
    ck.close()
    assert torch.equal(got["w"], expected["w"]) and torch.equal(got["b"], expected["b"])
    assert os.path.isdir(tmp_path / "ck")


class _Gated(FileBackend):
    """Holds every data write until ``gate`` is set."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        if not self.gate.wait(120):
            raise TimeoutError("the test never opened the gate")


class _OnRecord(logging.Handler):
    def __init__(self, prefix: str, event: threading.Event) -> None:
        super().__init__(logging.DEBUG)
        self.prefix, self.event = prefix, event

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.prefix):
            self.event.set()


@pytest.mark.parametrize("pipeline,expected", [("on", (True, True)), ("off", (False, False)), ("auto", (False, True))])
def test_the_pipeline_setting_decides_which_saves_overlap_their_copy(tmp_path, pipeline, expected):
    """"auto" pipelines a save that had to wait for the previous one (saves come faster than the
    disk takes them) and copies a save first when nothing is in flight."""
    gate, waiting = threading.Event(), threading.Event()
    handler = _OnRecord("checkpoint step 2 waits for room", waiting)
    log = logging.getLogger("fastpersist.saving.driver")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    opener = threading.Thread(target=lambda: (waiting.wait(120), gate.set()), daemon=True)
    opener.start()
    ck = fp.Checkpointer(str(tmp_path / "ck"), backend=_Gated(gate), config=IOConfig(snapshot_pipeline=pipeline))
    try:
        states = [{"w": torch.full((MIB,), float(i)), "step": i} for i in (1, 2)]
        h1 = ck.save(1, states[0])  # its writes wait for the gate, which opens once save 2 waits
        h2 = ck.save(2, states[1])
        h2.result(60)
        assert (h1.metrics.pipelined, h2.metrics.pipelined) == expected
        assert h2.metrics.waited_for_previous and not h1.metrics.waited_for_previous
        assert torch.equal(ck.load(1)["w"], states[0]["w"]) and torch.equal(ck.load(2)["w"], states[1]["w"])
    finally:
        gate.set()
        ck.close()
        log.removeHandler(handler)
        log.setLevel(level)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(MIB, generator=g), "b": torch.randn(MIB // 2 + 3, generator=g), "step": seed}


def _failing_copy(monkeypatch, error: BaseException, at: int, ranks: tuple[int, ...] = (0,), rank: int = 0) -> None:
    """torch's copy (which the project cannot make fail for real) raises ``error`` at its
    ``at``-th call, in save()'s snapshot copy, in small batches so that a state takes several."""
    from fastpersist import torch_internals
    from fastpersist.saving import capture

    real = torch_internals.copy_many
    calls = []

    def copy_many(dsts, srcs):
        calls.append(1)
        if rank in ranks and len(calls) == at:
            raise error
        real(dsts, srcs)

    monkeypatch.setattr(capture, "COPY_STEP", 256 << 10)
    monkeypatch.setattr(torch_internals, "copy_many", copy_many)


@pytest.mark.parametrize("error,at", [(KeyboardInterrupt(), 1), (MemoryError("the copy ran out of memory"), 3)],
                         ids=["interrupted-before-any-byte", "failed-half-way"])
def test_a_copy_that_fails_in_save_is_raised_once_commits_nothing_and_hangs_nothing(tmp_path, monkeypatch, error, at):
    """Interrupted before its first byte or failed half-way, a pipelined copy: save() raises it,
    the writer does not wait for bytes that will never come (close() returns), nothing of the
    step is committed, the failure is not raised a second time, and the next save works."""
    from fastpersist.io import fills

    ck = fp.Checkpointer(str(tmp_path / "ck"), config=IOConfig(snapshot_pipeline="on"))
    try:
        ck.save(1, _state(1)).result(60)
        with monkeypatch.context() as m:
            _failing_copy(m, error, at)
            with pytest.raises(type(error)):
                ck.save(2, _state(2))
        ck.wait(timeout=60)  # ends (the job failed instead of waiting) and raises nothing again
        assert [c.step for c in ck.list()] == [1] and ck.load()["step"] == 1
        assert fills.registered() == 0, "a fill stayed registered after its job ended"
        h = ck.save(3, _state(3))
        h.result(60)
        got = ck.load(3)
        assert torch.equal(got["a"], _state(3)["a"]) and torch.equal(got["b"], _state(3)["b"])
    finally:
        ck.close()


def _two_ranks_one_copy_fails(rank: int, world: int, root: str) -> list:
    import pytest as _pytest

    mp = _pytest.MonkeyPatch()
    ck = fp.Checkpointer(root, check_replicated=False,
                         config=IOConfig(snapshot_pipeline="on"))
    try:
        ck.save(1, _state(1)).result(120)
        _failing_copy(mp, MemoryError("rank 0's copy failed"), at=22, rank=rank)  # of 25 batches: rank 1's share
        raised = None
        try:
            ck.save(2, _state(2)).result(120)
        except MemoryError as e:
            raised = repr(e)
        except fp.CheckpointError as e:
            raised = type(e).__name__
        mp.undo()
        ck.wait(timeout=120)
        return [raised, [c.step for c in ck.list()]]
    finally:
        mp.undo()
        ck.close()


def test_a_copy_that_fails_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    """Rank 0's copy fails in its last batch, whose bytes rank 0 may never read itself (without
    the replica check a rank writes only its share): the save still fails on both ranks, and
    nothing of it is committed."""
    from helpers import run_ranks

    root = str(tmp_path / "roots")
    results = run_ranks(tmp_path, 2, _two_ranks_one_copy_fails, root)
    assert results[0][0] is not None and "rank 0's copy failed" in results[0][0]
    assert results[1][0] == "DistributedCheckpointError", results  # rank 0's failure, raised on rank 1
    assert results[0][1] == [1] and results[1][1] == [1], results
