"""Incremental checkpoints (``Checkpointer(incremental=True)``): unchanged bytes are not
written again, every checkpoint loads exactly, and deleting any checkpoint never loses bytes
another one needs."""

from __future__ import annotations

import copy
import errno
import os
import shutil

import pytest
import torch
from helpers import assert_state_equal, gathered, run_ranks, wait_until

import fastpersist as fp
from fastpersist.checkpointer import Checkpointer
from fastpersist.storage.faults import Fault, FaultyBackend
from fastpersist.saving.extensions.incremental import BLOCK, SAMPLES, Incremental, units_of

MiB = 1 << 20


def lora(seed: int = 0) -> dict:
    """A frozen 'base model' of 16 MiB and a small trainable adapter."""
    g = torch.Generator().manual_seed(seed)
    return {"base": {f"layer{i}": torch.randn(512, 1024, generator=g) for i in range(8)},
            "adapter": torch.zeros(16, 1024)}


def snapshot(state: dict) -> dict:
    return {"base": {k: v.clone() for k, v in state["base"].items()}, "adapter": state["adapter"].clone()}


def step_files(roots: list[str], step: int) -> list[str]:
    return [os.path.join(r, f"step-{step:08d}", n) for r in roots
            for n in sorted(os.listdir(os.path.join(r, f"step-{step:08d}"))) if n.endswith(".bin")]


@pytest.mark.parametrize("mode", ["sync", "snapshot", "overlap"])
def test_frozen_bytes_are_written_once_and_every_step_loads(tmp_path, mode):
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    state = lora()
    seen = {}
    with Checkpointer(roots, mode=mode, incremental=True) as ck:
        for step in range(1, 5):
            state["adapter"] += step
            h = ck.save(step, state)
            h.wait()
            seen[step] = snapshot(state)
            m = h.metrics
            if step == 1:
                assert m.bytes_reused == 0 and m.bytes_written >= 16 * MiB
            else:  # only the adapter's 64 KiB are written
                assert m.bytes_reused == 16 * MiB and m.bytes_written < MiB, (m.bytes_written, m.bytes_reused)
        for step, expected in seen.items():
            assert_state_equal(ck.load(step), expected)
    # the linked files are the same inodes as the first checkpoint's
    first = {os.stat(p).st_ino for p in step_files(roots, 1)}
    assert first & {os.stat(p).st_ino for p in step_files(roots, 4)}
    assert fp.open(roots).verify(4) == []


def test_deleting_earlier_checkpoints_loses_nothing(tmp_path):
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    state = lora()
    with Checkpointer(roots, incremental=True, keep=1, mode="sync") as ck:
        for step in range(1, 4):
            state["adapter"] += 1
            ck.save(step, state).wait()
    assert [i.step for i in fp.open(roots).list()] == [3]  # retention removed steps 1 and 2
    assert fp.open(roots).verify(3) == []
    assert_state_equal(fp.open(roots).load(3), state)
    # a user's `rm -r` of the step it was linked from does not touch it either
    with Checkpointer(roots, incremental=True, mode="sync") as ck:
        ck.save(4, state).wait()
        ck.save(5, state).wait()
    for r in roots:
        shutil.rmtree(os.path.join(r, "step-00000004"))
        shutil.rmtree(os.path.join(r, "step-00000003"))
    assert fp.open(roots).verify(5) == []
    assert_state_equal(fp.open(roots).load(5), state)


def test_a_change_the_samples_miss_is_written(tmp_path):
    """One element changed away from every sampled word: the 128-bit digest sees it."""
    state = lora()
    n = state["base"]["layer2"].nbytes  # one unit
    assert n <= BLOCK
    spots = {int(i * (n - 8) / (SAMPLES - 1)) for i in range(SAMPLES)}
    element = 1001
    assert all(not (s <= element * 4 < s + 8) for s in spots)
    with Checkpointer(str(tmp_path), incremental=True, mode="sync") as ck:
        ck.save(1, state).wait()
        with torch.no_grad():
            state["base"]["layer2"].view(-1)[element] += 1.0
        m = ck.save(2, state).metrics
        assert 0 < m.bytes_written <= 2 * MiB + 64 * 1024  # the one unit holding it, no more
        assert_state_equal(ck.load(2), state)
        # a change only the digest saw: the unit is written unhashed once (backing off), then
        # hashed again, then reused
        assert [ck.save(s, state).metrics.bytes_written >= 2 * MiB for s in (3, 4, 5)] == [True, True, False]
        assert_state_equal(ck.load(5), state)


def test_sparse_row_updates_write_only_their_blocks(tmp_path):
    g = torch.Generator().manual_seed(3)
    table = torch.randn(64 * 1024, 256, generator=g)  # 64 MiB: 16 units
    with Checkpointer(str(tmp_path), incremental=True, mode="sync") as ck:
        ck.save(1, {"emb": table}).wait()
        rows = torch.tensor([5, 6, 40_000])  # rows in units 0 and 9
        with torch.no_grad():
            table[rows] += 0.5
        m = ck.save(2, {"emb": table}).metrics
        assert m.bytes_written == 2 * BLOCK and m.bytes_reused == 14 * BLOCK
        assert_state_equal(ck.load(2), {"emb": table})
        assert fp.open(str(tmp_path)).verify(2) == []


def test_full_training_writes_everything(tmp_path):
    """Every unit changes: nothing is reused, nothing is linked, nothing is hashed after the
    first save (the samples differ)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3 * 1024 * 1024, generator=g)  # 12 MiB
    with Checkpointer(str(tmp_path), incremental=True, mode="sync") as ck:
        for step in range(1, 4):
            w.mul_(0.999).add_(0.001)
            m = ck.save(step, {"w": w}).metrics
            assert m.bytes_reused == 0 and m.bytes_written == w.nbytes
        assert_state_equal(ck.load(3), {"w": w})
    assert not any(os.stat(p).st_nlink > 1 for s in (1, 2, 3) for p in step_files([str(tmp_path)], s))


def test_a_mostly_stale_file_is_not_linked(tmp_path):
    """Reuse is skipped when the unchanged bytes would keep a file mostly of stale bytes."""
    g = torch.Generator().manual_seed(2)
    state = {f"t{i}": torch.randn(BLOCK // 4, generator=g) for i in range(4)}  # 4 units, one file
    with Checkpointer(str(tmp_path), incremental=True, mode="sync") as ck:
        ck.save(1, state).wait()
        for k in ("t0", "t1", "t2"):
            state[k].add_(1.0)
        m = ck.save(2, state).metrics
        assert m.bytes_reused == 0 and m.bytes_written == 4 * BLOCK
        assert_state_equal(ck.load(2), state)


def test_a_link_that_fails_is_written_instead(tmp_path):
    backend = FaultyBackend()
    state = lora()
    with Checkpointer(str(tmp_path), incremental=True, mode="sync", backend=backend) as ck:
        ck.save(1, state).wait()
        backend.arm([Fault("link", errno.EIO, at=0)])
        state["adapter"] += 1
        m = ck.save(2, state).metrics
        assert backend.fired and m.bytes_reused == 0 and m.bytes_written >= 16 * MiB
        assert_state_equal(ck.load(2), state)
        backend.arm([])
        state["adapter"] += 1
        assert ck.save(3, state).metrics.bytes_reused == 16 * MiB
        assert_state_equal(ck.load(3), state)


def test_a_filesystem_without_hard_links_turns_incremental_off(tmp_path, caplog):
    """EXDEV/EPERM from link(): every later save writes everything (never the linking rank alone
    writing the reused bytes save after save), and says so once."""
    backend = FaultyBackend()
    state = lora()
    with Checkpointer(str(tmp_path), incremental=True, mode="sync", backend=backend) as ck:
        ck.save(1, state).wait()
        backend.arm([Fault("link", errno.EXDEV, at=0)])
        with caplog.at_level("WARNING", logger="fastpersist"):
            for step in (2, 3, 4):
                state["adapter"] += 1
                m = ck.save(step, state).metrics
                assert m.bytes_reused == 0 and m.bytes_written >= 16 * MiB
                assert (m.probe_s == 0.0) == (step > 2)  # nothing hashed once off
        assert len(backend.fired) == 1  # no link tried after the refusal
        assert sum("incremental checkpoints are off" in r.message for r in caplog.records) == 1
        assert_state_equal(ck.load(4), state)


def test_the_last_checkpoint_removed_before_the_next_save(tmp_path):
    state = lora()
    with Checkpointer(str(tmp_path), incremental=True, mode="sync") as ck:
        ck.save(1, state).wait()
        shutil.rmtree(str(tmp_path / "step-00000001"))
        state["adapter"] += 1
        m = ck.save(2, state).metrics
        assert m.bytes_reused == 0 and m.bytes_written >= 16 * MiB
        assert_state_equal(ck.load(2), state)


def test_a_failed_save_is_no_reference(tmp_path):
    backend = FaultyBackend()
    state = lora()
    with Checkpointer(str(tmp_path), incremental=True, mode="sync", backend=backend) as ck:
        ck.save(1, state).wait()
        first = snapshot(state)
        backend.arm([Fault("write", errno.EIO, at=1)])
        with pytest.raises(fp.CheckpointWriteError):
            ck.save(2, state).wait()
        backend.arm([])
        m = ck.save(3, state).metrics  # written in full, then reused again
        assert m.bytes_reused == 0
        state["adapter"] += 1
        assert ck.save(4, state).metrics.bytes_reused == 16 * MiB
        assert_state_equal(ck.load(4), state)
        assert_state_equal(ck.load(1), first)


def test_a_new_structure_is_written_in_full(tmp_path):
    state = lora()
    with Checkpointer(str(tmp_path), incremental=True, mode="sync") as ck:
        ck.save(1, state).wait()
        state["extra"] = torch.ones(10)
        assert ck.save(2, state).metrics.bytes_reused == 0
        m = ck.save(3, state).metrics
        assert m.bytes_reused == m.bytes_total and m.bytes_written == 0  # nothing changed
        assert_state_equal(ck.load(3), state)


def test_a_directory_save_is_no_reference(tmp_path):
    state = lora()
    with Checkpointer(str(tmp_path / "roots"), incremental=True, mode="sync") as ck:
        ck.save(1, state).wait()
        m = ck.save(2, state, directory=str(tmp_path / "named")).metrics
        assert m.bytes_reused == m.bytes_total  # linked from step 1, then moved out of the roots
        assert ck.save(3, state).metrics.bytes_reused == 0
        shutil.rmtree(str(tmp_path / "roots"))
    assert_state_equal(fp.open(str(tmp_path / "named")).load(), state)


def test_arguments(tmp_path):
    with pytest.raises(TypeError, match="incremental"):
        Checkpointer(str(tmp_path), incremental="yes")  # type: ignore[arg-type]
    for bad in (1000, 4096, 65536 + 512):
        with pytest.raises(ValueError, match="unit size"):
            Checkpointer(str(tmp_path), incremental=bad)
    assert not os.listdir(tmp_path)  # refused before anything was created


def test_small_units_follow_scattered_rows(tmp_path):
    g = torch.Generator().manual_seed(4)
    table = torch.randn(16 * 1024, 256, generator=g)  # 16 MiB, 1 KiB rows: 256 units of 64 KiB
    with Checkpointer(str(tmp_path), incremental=64 * 1024, mode="sync") as ck:
        ck.save(1, {"emb": table}).wait()
        rows = torch.tensor([3, 1000, 9000, 16_000])  # four units, far apart
        with torch.no_grad():
            table[rows] *= 2
        m = ck.save(2, {"emb": table}).metrics
        assert m.bytes_written == 4 * 64 * 1024 and m.bytes_reused == table.nbytes - 4 * 64 * 1024
        assert_state_equal(ck.load(2), {"emb": table})
        assert fp.open(str(tmp_path)).verify(2) == []


def test_units_cover_every_byte():
    sizes = [0, 5, BLOCK, BLOCK + 1, 3 * BLOCK - 7]
    units = units_of(sizes)
    for s, size in enumerate(sizes):
        mine = [u for u in units if u.storage == s]
        assert sum(u.nbytes for u in mine) == size and all(u.nbytes <= BLOCK for u in mine)
        assert [u.start for u in mine] == list(range(0, size, BLOCK))
    inc = Incremental(0, 1)
    extents, reused = inc.plan(sizes, set(), 3, "id")
    assert reused == []
    for s, size in enumerate(sizes):  # the extents of each storage tile it, in storage coordinates
        pos = 0
        for e in sorted((e for e in extents if e.storage == s), key=lambda e: e.start):
            assert e.start == pos and e.nbytes > 0
            pos = e.end
        assert pos == size
    kept, _ = inc.plan(sizes, {1, 2}, 3, "id")  # without a reference nothing is reused
    assert sorted((e.storage, e.start, e.nbytes) for e in kept) == sorted((e.storage, e.start, e.nbytes) for e in extents)


def _two_ranks(rank: int, world: int, root: str) -> list[int]:
    g = torch.Generator().manual_seed(7)
    state = {"frozen": torch.randn(6 * 1024 * 1024, generator=g), "live": torch.zeros(1000)}
    reused = []
    with Checkpointer(root, incremental=True, mode="sync") as ck:
        for step in range(1, 4):
            state["live"] += 1
            h = ck.save(step, state)
            h.wait()
            reused.append(h.metrics.bytes_reused)
        assert_state_equal(ck.load(3), state)
    return reused


def test_two_ranks_share_the_probing(tmp_path):
    out = run_ranks(tmp_path, 2, _two_ranks, str(tmp_path / "root"))
    frozen = 24 * MiB
    assert out[0] == [0, frozen, frozen]  # rank 0 links the files
    assert out[1] == [0, 0, 0]
    assert fp.open(str(tmp_path / "root")).verify(3) == []


FAULTS = {
    "ENOSPC during data": [Fault("write", errno.ENOSPC, at=1)],
    "EIO from fsync": [Fault("fsync", errno.EIO, at=1)],
    "manifest rename refused": [Fault("rename", errno.EIO, path_contains="manifest.json")],
    "EIO from every link": [Fault("link", errno.EIO, at=0)],
    "retention cannot delete": [Fault("delete", errno.EACCES, at=0)],
}


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_faults_in_an_incremental_save_lose_nothing(tmp_path, case):
    """A fault while a save links the last checkpoint's files: the earlier checkpoints still
    load, nothing partial is left, and the saves after it are right."""
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    backend = FaultyBackend()
    state = lora()
    expected = {}
    with Checkpointer(roots, incremental=True, keep=2, mode="snapshot", backend=backend) as ck:
        for step in (1, 2):
            state["adapter"] += 1
            ck.save(step, state).wait()
            expected[step] = snapshot(state)
        backend.arm(FAULTS[case])
        state["adapter"] += 1
        try:
            ck.save(3, state).wait()
            expected[3] = snapshot(state)
        except fp.CheckpointWriteError:
            pass
        wait_until(lambda: bool(backend.fired))  # retention deletes in its own thread, after the commit
        backend.arm([])
        for step in (4, 5):
            state["adapter"] += 1
            ck.save(step, state).wait()
            expected[step] = snapshot(state)
    view = fp.open(roots)
    listed = [i.step for i in view.list()]
    assert listed[-2:] == [4, 5]
    for step in listed:
        assert view.verify(step) == [] and step in expected
        assert_state_equal(view.load(step), expected[step])
    for r in roots:
        for name in os.listdir(r):
            if name.startswith("step-"):
                assert os.path.exists(os.path.join(roots[0], name, "manifest.json")), name


def _fsdp_frozen_base(rank: int, world: int, root: str, links_fail_on: int | None = None) -> dict:
    """FSDP2 over 2 ranks: a frozen 256x256 base layer (DTensor shards) and a trained head."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard


    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    m[0].requires_grad_(False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    reused, expected = [], {}
    faults = [Fault("link", errno.EIO, at=0)] if links_fail_on == rank else []
    with Checkpointer(root, incremental=True, mode="snapshot", backend=FaultyBackend(faults)) as ck:
        for step in range(1, 4):
            m(torch.randn(4, 256, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
            h = ck.save(step, {"model": m, "optim": opt})
            h.wait()
            reused.append(h.metrics.bytes_reused)
            expected[step] = gathered({"model": m.state_dict(), "optim": opt.state_dict()})
        for step in (2, 3):
            assert_state_equal(gathered(ck.load(step)), expected[step], layout=False)
    return {"reused": reused, "expected": expected[3]}


def test_fsdp2_frozen_shards_are_reused_and_reshard(tmp_path):
    root = str(tmp_path / "root")
    out = run_ranks(tmp_path, 2, _fsdp_frozen_base, root)
    for r in out:  # each rank links its own file holding its frozen shards, from the second save on
        assert r["reused"][0] == 0 and r["reused"][1] >= 128 * 256 * 4 and r["reused"][2] == r["reused"][1]
    assert fp.open(root).verify(3) == []
    whole = fp.open(root).load(3)  # one process: the DTensors come back whole
    flat = {k: v for k, v in out[0]["expected"].items()}
    assert_state_equal(gathered(whole), flat, layout=False)


def test_fsdp2_shards_whose_links_fail_are_written_by_their_holder(tmp_path):
    root = str(tmp_path / "root")
    out = run_ranks(tmp_path, 2, _fsdp_frozen_base, root, 1)
    assert out[0]["reused"][1] >= 128 * 256 * 4 and out[1]["reused"] == [0, 0, 0]
    assert fp.open(root).verify(3) == []
    assert_state_equal(gathered(fp.open(root).load(3)), out[0]["expected"], layout=False)


def _mixed(rank: int, world: int, root: str) -> str:
    with Checkpointer(root, incremental=rank == 0, mode="sync") as ck:
        try:
            ck.save(1, {"w": torch.ones(10)}).wait()
        except fp.CheckpointWriteError as e:
            return str(e)
    return "saved"


def test_ranks_that_disagree_on_incremental_are_refused(tmp_path):
    out = run_ranks(tmp_path, 2, _mixed, str(tmp_path / "root"))
    assert all("disagree on incremental=" in m for m in out), out
    assert fp.open(str(tmp_path / "root")).list() == []


def test_a_manifest_readers_would_refuse_is_never_committed(tmp_path, monkeypatch):
    import fastpersist.format.manifest as mf

    g = torch.Generator().manual_seed(5)
    state = {"emb": torch.randn(4 * 1024 * 1024, generator=g)}  # 16 MiB: 256 units of 64 KiB
    with Checkpointer(str(tmp_path), incremental=64 * 1024, mode="sync") as ck:
        ck.save(1, {"w": torch.ones(10)}).wait()
        monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 16 * 1024)
        with pytest.raises(fp.CheckpointWriteError, match="manifest would be .* bytes, and readers accept at most"):
            ck.save(2, state).wait()
        monkeypatch.undo()
        assert [i.step for i in ck.list()] == [1]
        assert_state_equal(ck.load(1), {"w": torch.ones(10)})


def test_a_very_large_state_gets_larger_units(monkeypatch):
    import fastpersist.saving.extensions.incremental as inc_mod

    monkeypatch.setattr(inc_mod, "MAX_UNITS", 64)
    inc = Incremental(0, 1, 64 * 1024)
    units = inc.units([64 * MiB])
    assert len(units) <= 64 and all(u.nbytes == MiB for u in units)
    extents, _ = inc.plan([64 * MiB], set(), 2, "id")
    assert sum(e.nbytes for e in extents) == 64 * MiB


def test_every_holder_must_find_a_chunk_unchanged():
    from fastpersist.objects import dtensor
    from fastpersist.saving.extensions.incremental import Reference
    from fastpersist.objects.write import PlacedExtent

    meta = dtensor.ChunkMeta(("w",), "float32", (64, 64), (0, 0), (64, 64))
    key = (meta.path, meta.offsets, meta.sizes)
    layout = dtensor.assign([[meta], [meta]])  # held by ranks 0 and 1 (a replicated shard)
    def reference(writer: int) -> Reference:
        return Reference("step-00000001", (), {(0, "f.bin"): (meta.nbytes, writer)}, [],
                          {key: [((0, "f.bin"), PlacedExtent(0, 0, meta.nbytes, 0, 7))]})

    inc = Incremental(0, 2, reference=reference(1))
    assert inc.plan_chunks(layout, [{key}, set()], "id")[1] == []  # rank 1 saw a change
    new_layout, reused = inc.plan_chunks(layout, [{key}, {key}], "id")
    assert [(r.rank, r.source) for r in reused] == [(1, "f.bin")] and new_layout.pieces == []
    inc = Incremental(0, 2, reference=reference(3))  # written by a rank that no longer holds it:
    assert inc.plan_chunks(layout, [{key}, {key}], "id")[1] == []  # written again, never linked


def test_overlap_mode_writes_guarded_tensors_from_live_memory_exactly(tmp_path):
    """A protected optimizer's tensors are written from live memory (not copied) while the
    next steps run; the frozen base is reused, the adapter and its state are written."""
    torch.manual_seed(0)
    base = torch.nn.Linear(1024, 1024)  # 4 MiB, frozen
    base.requires_grad_(False)
    adapter = torch.nn.Linear(1024, 16)
    opt = torch.optim.AdamW(adapter.parameters(), lr=1e-2)
    seen = {}
    with Checkpointer(str(tmp_path), incremental=True, mode="overlap") as ck:
        ck.protect(opt)
        handles = []
        for step in range(1, 5):
            adapter(base(torch.randn(8, 1024))).sum().backward()
            opt.step()
            opt.zero_grad()
            handles.append(ck.save(step, {"base": base.state_dict(), "adapter": adapter, "optim": opt}))
            seen[step] = {"base": {k: v.clone() for k, v in base.state_dict().items()},
                          "adapter": {k: v.clone() for k, v in adapter.state_dict().items()},
                          "optim": copy.deepcopy(opt.state_dict())}
        for h in handles:
            h.wait()
        assert handles[-1].metrics.bytes_reused >= base.weight.nbytes
        for step, expected in seen.items():
            assert_state_equal(gathered(ck.load(step)), gathered(expected), layout=False)


def test_units_whose_changes_the_samples_miss_are_hashed_less_and_less(tmp_path, monkeypatch):
    """Sparse updates the samples never see: every save would hash every unit for nothing;
    after m such changes in a row a unit is written unhashed for 2^m - 1 saves. When the
    updates stop, the units are reused again."""
    import fastpersist.saving.extensions.incremental as inc_mod

    hashed: list[int] = []
    real = inc_mod.xxhash

    class Counting:  # xxhash, counting the units hashed per save
        @staticmethod
        def xxh3_128_intdigest(data):
            hashed[-1] += 1
            return real.xxh3_128_intdigest(data)

    monkeypatch.setattr(inc_mod, "xxhash", Counting)
    table = torch.zeros(4 * BLOCK // 4)  # 4 units
    reused = []
    with Checkpointer(str(tmp_path), incremental=True, mode="sync") as ck:
        for step in range(1, 31):
            if step <= 10:  # one element per unit, far from every sampled word
                table.view(4, -1)[:, 1001] += 1.0
            hashed.append(0)
            reused.append(ck.save(step, {"emb": table}).metrics.bytes_reused)
        assert_state_equal(ck.load(10), {"emb": table})
        assert_state_equal(ck.load(30), {"emb": table})
    assert hashed[:10] == [4, 4, 0, 4, 4, 0, 0, 0, 4, 4]
    assert reused[:12] == [0] * 12 and reused[-1] == 4 * BLOCK
    assert sum(hashed[10:]) < 4 * 20  # still backing off after the updates stopped
