"""Checkpointer.reserve: the snapshot memory made ready before the first save that needs it."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch
from helpers import assert_state_equal, blocked, states_equal, wait_until

import fastpersist as fp
from fastpersist.errors import CheckpointerClosedError
from fastpersist.io.buffers import align_up, shared_pool
from fastpersist.saving.arena import Arena

MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _state(seed: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(mib * MiB // 4, generator=g), "small": torch.randn(1000, generator=g), "step": seed}


def test_reserve_faults_the_arena_in_so_the_first_save_copies_into_ready_memory(tmp_path, small_io):
    """Guards against a reservation that only allocates: untouched memory is what makes the
    first save slow, so the pages must be resident (RSS) before the save, and the save must
    copy into them rather than into new memory. Measured in a fresh process: in a long-lived
    one (the suite's), memory freed by earlier tests may already be resident."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.apply(_reserve_in_fresh_memory, (str(tmp_path), small_io))


def _reserve_in_fresh_memory(tmp: str, small_io: fp.IOConfig) -> None:
    state = _state(1, 48)
    need = align_up(state["big"].nbytes) + align_up(state["small"].nbytes)
    # control: without a reservation the first save's copy grows the process by the state's size
    plain = fp.Checkpointer(f"{tmp}/plain", config=small_io)
    before = _rss()
    plain.save(1, state).result()
    assert _rss() - before > 0.9 * need
    plain.close()
    del plain

    ck = fp.Checkpointer(f"{tmp}/reserved", config=small_io)
    before = _rss()
    assert ck.reserve(state).result(timeout=60) == need
    assert ck.snapshot_memory == need
    assert _rss() - before > 0.9 * need  # faulted in, not only allocated
    before = _rss()
    ck.save(2, state).result()
    assert _rss() - before < 0.25 * need  # the save copied into the reserved pages
    assert ck.snapshot_memory == need
    decoy = _state(3, 48)
    assert not states_equal(decoy, state)
    assert_state_equal(ck.load(2), state)
    ck.close()


def test_reserve_sizes_what_save_copies(tmp_path, small_io):
    """In overlap mode the protected optimizer's tensors are written from live memory, so only
    the rest is reserved; in snapshot mode everything is, each distinct storage once."""
    model = torch.nn.Linear(256, 128)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()  # Adam's state exists from here on
    extra = torch.randn(3000)
    state = {"model": model, "optim": opt, "extra": extra, "again": extra[5:]}

    over = fp.Checkpointer(str(tmp_path / "overlap"), mode="overlap", config=small_io)
    over.protect(opt)
    assert over.reserve(state).result(timeout=60) == align_up(extra.nbytes)
    h = over.save(1, state)
    h.result()
    assert h.metrics.bytes_copied == extra.nbytes
    assert over.snapshot_memory == align_up(extra.nbytes)
    over.close()

    snap = fp.Checkpointer(str(tmp_path / "snapshot"), config=small_io)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values()
                                                 if isinstance(v, torch.Tensor)), extra]}
    need = sum(align_up(n) for n in storages.values())
    assert snap.reserve(state).result(timeout=60) == need
    h = snap.save(1, state)
    h.result()
    assert snap.snapshot_memory == need  # the save found the arena big enough
    snap.close()


def test_reserve_reserves_nothing_in_sync_mode_or_over_the_budget(tmp_path, small_io, caplog):
    state = _state(1, 1)
    sync = fp.Checkpointer(str(tmp_path / "sync"), mode="sync", config=small_io)
    assert sync.reserve(state).result() == 0
    assert sync.snapshot_memory == 0
    sync.close()
    small = fp.Checkpointer(str(tmp_path / "small"), snapshot_bytes=MiB // 2, config=small_io)
    with caplog.at_level(logging.INFO, logger="fastpersist.saving.stage"):
        assert small.reserve(state).result() == 0
    assert "exceeds snapshot_bytes" in caplog.text
    assert small.snapshot_memory == 0
    small.save(1, state)  # written from live memory, as reserve() said
    assert_state_equal(small.load(1), state)
    small.close()


def test_reserve_by_size_and_its_arguments(tmp_path, small_io):
    ck = fp.Checkpointer(str(tmp_path), config=small_io)
    assert ck.reserve(nbytes=MiB + 1).result(timeout=60) == align_up(MiB + 1)
    assert ck.reserve(nbytes=1000).result() == align_up(MiB + 1)  # never shrinks
    with pytest.raises(TypeError, match="not both"):
        ck.reserve(_state(1, 1), nbytes=10)
    with pytest.raises(TypeError, match="not both"):
        ck.reserve()
    with pytest.raises(ValueError, match="nbytes must be at least 0"):
        ck.reserve(nbytes=-1)
    with pytest.raises(TypeError, match="nbytes must be an integer"):
        ck.reserve(nbytes=True)
    ck.close()
    with pytest.raises(CheckpointerClosedError, match="reserve"):
        ck.reserve(nbytes=10)


def test_a_reservation_waits_for_the_arena_and_a_save_waits_for_the_reservation():
    """The arena has one holder at a time: a reservation asked for while a snapshot holds it
    grows it only once it is given back, and a snapshot that comes during the reservation gets
    the grown arena after it."""
    arena = Arena(64 * MiB)
    first = arena.take(MiB)
    assert first.numel() == MiB
    reserved = arena.reserve(8 * MiB)
    assert not reserved.done()
    got: list[torch.Tensor] = []
    taker = threading.Thread(target=lambda: got.append(arena.take(2 * MiB)))
    taker.start()
    wait_until(lambda: blocked(taker))
    assert not got and arena.allocated == MiB
    arena.give_back()
    assert reserved.result(timeout=60) == 8 * MiB
    taker.join(timeout=60)
    assert got and got[0].numel() == 8 * MiB  # the reservation's memory, not a new one
    arena.give_back()
    arena.join()


@pytest.mark.parametrize("mode", ["sync", "snapshot"])
def test_reserve_makes_the_staging_buffers_ready_in_every_mode(tmp_path, mode):
    """The first write of a process allocates its staging buffers: reserve() makes every
    buffer of every root's pool ahead of it, in sync mode too (where there is no arena)."""
    count = 3 if mode == "sync" else 5  # pools of their own (a pool is process-wide, by size and count)
    cfg = fp.IOConfig(chunk_bytes=68 * 1024, num_buffers=count)
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    ck = fp.Checkpointer(roots, mode=mode, config=cfg)
    lane = dataclasses.replace(cfg, chunk_bytes=MiB)  # two roots: two lanes of chunk_bytes / 2, at least 1 MiB
    pools = [shared_pool(lane.chunk_bytes, cfg.num_buffers, k) for k in range(2)]
    assert [p.created for p in pools] == [0, 0]
    ck.reserve(_state(1, 1)).result(timeout=60)
    assert [p.created for p in pools] == [count, count]
    ck.save(1, _state(1, 1)).result()
    assert [p.created for p in pools] == [count, count]
    ck.close()
    # control: these are the pools a save writes through (without a reservation it makes them)
    cfg = dataclasses.replace(cfg, num_buffers=count + 1)
    plain = fp.Checkpointer([str(tmp_path / "c"), str(tmp_path / "d")], mode=mode, config=cfg)
    pools = [shared_pool(lane.chunk_bytes, cfg.num_buffers, k) for k in range(2)]
    plain.save(1, _state(1, 1)).result()
    assert all(p.created > 0 for p in pools)
    plain.close()


def test_close_leaves_no_reservation_thread(tmp_path, small_io):
    ck = fp.Checkpointer(str(tmp_path), config=small_io)
    ck.reserve(nbytes=32 * MiB)
    ck.close()
    assert not [t for t in threading.enumerate() if t.name == "fastpersist-reserve"]


def test_a_reservation_holding_the_arena_is_not_a_save_in_flight():
    """``snapshot_pipeline="auto"`` pipelines a save when an earlier snapshot still holds the
    arena (saves come faster than the disk takes them); a reservation holding it is not that,
    and a save taken during it waits, then gets the reserved memory."""
    entered, release = threading.Event(), threading.Event()

    class HeldArena(Arena):
        def _grow(self, nbytes: int, touch: bool) -> torch.Tensor:
            if touch:  # the reservation's own growth
                entered.set()
                release.wait(60)
            return super()._grow(nbytes, touch)

    arena = HeldArena(16 * MiB)
    reserved = arena.reserve(4 * MiB)
    assert entered.wait(60)
    assert not arena.busy
    got: list[torch.Tensor] = []
    taker = threading.Thread(target=lambda: got.append(arena.take(MiB)))
    taker.start()
    wait_until(lambda: blocked(taker))
    release.set()
    assert reserved.result(timeout=60) == 4 * MiB
    taker.join(timeout=60)
    assert got and got[0].numel() == 4 * MiB
    assert arena.busy  # now a snapshot holds it
    arena.give_back()
    arena.join()


def test_close_waits_for_every_reservation_under_way(tmp_path, small_io):
    """Guards against joining only the newest reservation: a second, smaller one finished
    first while the first still faulted memory in after close()."""
    ck = fp.Checkpointer(str(tmp_path), config=small_io)
    first = ck.reserve(nbytes=64 * MiB)
    ck.reserve(nbytes=0)
    ck.close()
    assert first.done()
    assert not [t for t in threading.enumerate() if t.name == "fastpersist-reserve"]


def test_a_failed_reservation_is_logged_and_the_arena_stays_usable(caplog):
    def fail() -> None:
        raise MemoryError("no memory for the staging buffers")

    arena = Arena(16 * MiB)
    with caplog.at_level(logging.WARNING, logger="fastpersist.saving.stage"):
        reserved = arena.reserve(2 * MiB, then=fail)
        with pytest.raises(MemoryError, match="staging buffers"):
            reserved.result(timeout=60)
        arena.join()
    assert "reserving 2097152 bytes of snapshot memory failed (MemoryError" in caplog.text
    assert not arena.busy
    assert arena.take(3 * MiB, timeout=10).numel() == 3 * MiB
    arena.give_back()


def test_a_reservation_whose_thread_cannot_start_leaves_the_line(monkeypatch):
    """Guards against a turn left in line by a reservation that never ran: every later claim
    would wait for it forever (every save, and close())."""
    arena = Arena(16 * MiB)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            arena.reserve(2 * MiB)
    assert arena.take(MiB, timeout=10).numel() == MiB
    arena.give_back()


def test_a_claim_that_times_out_behind_a_reservation_leaves_the_line():
    arena = Arena(16 * MiB)
    arena.take(MiB)  # a snapshot holds the arena
    reserved = arena.reserve(4 * MiB)  # in line behind it
    with pytest.raises(TimeoutError, match="still in use"):
        arena.take(MiB, timeout=0.2)
    arena.give_back()
    assert reserved.result(timeout=60) == 4 * MiB
    assert arena.take(MiB, timeout=10).numel() == 4 * MiB
    arena.give_back()
    arena.join()
