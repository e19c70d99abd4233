"""fastpersist.dcp: torch.distributed.checkpoint with fastpersist's storage layer, on real
FSDP2-sharded state (fully_shard on a CPU mesh, gloo), resharded at load."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import assert_state_equal, fsdp_mlp, gathered, run_ranks, small_mlp

import fastpersist as fp
from fastpersist.dcp import Reader, Writer, written_by_fastpersist


def _save(rank: int, world: int, roots: list[str], asynchronous: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, opt = fsdp_mlp(world)
    torch.manual_seed(1 + rank)
    m(torch.randn(8, 48)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    if asynchronous:
        dcp.async_save(sd, storage_writer=Writer(roots)).result()
    else:
        dcp.save(sd, storage_writer=Writer(roots))
    return gathered(sd)


def _load(rank: int, world: int, roots: list[str]) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    m, opt = fsdp_mlp(world)
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=Reader(roots))
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    msd, osd = get_state_dict(m, opt)
    return gathered({"model": msd, "optim": osd})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    roots = [str(tmp / "nvme0" / "step-1"), str(tmp / "nvme1" / "step-1")]
    full = run_ranks(tmp, 4, _save, roots, False)[0]
    return tmp, roots, full


def test_save_spreads_every_rank_over_every_root(saved):
    _, roots, full = saved
    names = [sorted(os.listdir(r)) for r in roots]
    assert ".metadata" in names[0] and ".metadata" not in names[1]
    for r, listed in enumerate(names):
        ranks = sorted({n.split("_")[2] for n in listed if n.endswith(".fpdcp")})
        assert ranks == ["0", "1", "2", "3"], (r, listed)
    assert len(full) > 10  # model and optimizer state


@pytest.mark.parametrize("world", [4, 3, 2])
def test_reshard_load_is_exact(saved, world):
    tmp, roots, full = saved
    assert_state_equal(run_ranks(tmp, world, _load, roots)[0], full, layout=False)


def test_load_at_world_size_one_without_a_process_group(saved):
    _, roots, full = saved
    assert not dist.is_initialized()
    m = small_mlp()
    sd = {"model": {k: torch.zeros_like(v) for k, v in m.state_dict().items()}}
    dcp.load(sd, storage_reader=Reader(roots))
    for k, v in sd["model"].items():
        assert torch.equal(v, full[f"model.{k}"]), k


def test_async_save(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    full = run_ranks(tmp_path, 2, _save, roots, True)[0]
    assert_state_equal(run_ranks(tmp_path, 2, _load, roots)[0], full, layout=False)


def _plain_checkpoint(tmp_path) -> tuple[list[str], dict]:
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    sd = {"w": torch.randn(1000, 33), "b": torch.arange(10), "n": 5}
    dcp.save(sd, storage_writer=Writer(roots))
    return roots, sd


def test_flipped_byte_is_caught(tmp_path):
    roots, sd = _plain_checkpoint(tmp_path)
    data = [os.path.join(r, n) for r in roots for n in os.listdir(r) if n.endswith(".fpdcp")]
    big = max(data, key=os.path.getsize)  # holds "w" (132,000 bytes) and little else: flip its middle
    at = os.path.getsize(big) // 2
    with open(big, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    target = {"w": torch.zeros(1000, 33), "b": torch.zeros(10, dtype=torch.int64), "n": 0}
    # DCP wraps storage errors in its CheckpointException (a BaseException), keeping our message
    with pytest.raises(BaseException, match="ChecksumMismatchError.*fails its checksum"):
        dcp.load(target, storage_reader=Reader(roots))


def test_missing_file_and_other_shape(tmp_path):
    roots, sd = _plain_checkpoint(tmp_path)
    with pytest.raises(BaseException, match="(?i)size mismatch"):
        dcp.load({"w": torch.zeros(999, 33)}, storage_reader=Reader(roots))
    for r in roots:
        for n in os.listdir(r):
            if n.endswith(".fpdcp"):
                os.unlink(os.path.join(r, n))
    with pytest.raises(BaseException, match="CorruptCheckpointError.*missing"):
        dcp.load({"w": torch.zeros(1000, 33)}, storage_reader=Reader(roots))


def test_a_checkpoint_of_dcps_own_writer_is_told_apart(tmp_path):
    """What lets an integration (torchtitan's) read DCP's own checkpoints with DCP's reader."""
    roots, _ = _plain_checkpoint(tmp_path)
    assert written_by_fastpersist(roots[0])
    plain = str(tmp_path / "plain")
    dcp.save({"w": torch.ones(10)}, storage_writer=dcp.FileSystemWriter(plain))
    assert not written_by_fastpersist(plain)
    with pytest.raises(BaseException, match="refusing"):  # never unpickled by fastpersist's reader
        dcp.load({"w": torch.zeros(10)}, storage_reader=Reader(plain))
    with pytest.raises(fp.CheckpointNotFoundError):
        written_by_fastpersist(str(tmp_path))


def test_metadata_that_runs_code_is_refused(tmp_path):
    roots, _ = _plain_checkpoint(tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with open(os.path.join(roots[0], ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(BaseException, match="refusing"):
        dcp.load({"w": torch.zeros(1000, 33)}, storage_reader=Reader(roots))
    assert not (tmp_path / "pwned").exists()


def test_saving_again_replaces_atomically(tmp_path):
    roots, _ = _plain_checkpoint(tmp_path)
    sd2 = {"w": torch.ones(1000, 33), "b": torch.arange(10) * 2, "n": 6}
    dcp.save(sd2, storage_writer=Writer(roots))
    files = [n for r in roots for n in os.listdir(r) if n.endswith(".fpdcp")]
    assert len(files) == 2  # the first save's files were removed after the commit
    target = {"w": torch.zeros(1000, 33), "b": torch.zeros(10, dtype=torch.int64), "n": 0}
    dcp.load(target, storage_reader=Reader(roots))
    assert torch.equal(target["w"], sd2["w"]) and torch.equal(target["b"], sd2["b"]) and target["n"] == 6


def _mesh_state(mesh, placements) -> dict:
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(5)
    full = {"a": torch.randn(64, 40, generator=g), "b": torch.randn(36, 100, generator=g)}
    return {k: distribute_tensor(v, mesh, placements) for k, v in full.items()}, full


def _save_2x2(rank: int, world: int, root: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2))
    sd, _ = _mesh_state(mesh, [Replicate(), Shard(0)])
    dcp.save(sd, storage_writer=Writer([root]))
    return sum(os.path.getsize(os.path.join(root, n)) for n in os.listdir(root) if n.endswith(".fpdcp"))


def _load_shard1(rank: int, world: int, root: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    sd, full = _mesh_state(mesh, [Shard(1)])
    sd = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(sd, storage_reader=Reader([root]))
    return all(torch.equal(sd[k].full_tensor(), full[k]) for k in full)


def test_2x2_mesh_replicate_shard_to_1d_shard1(tmp_path):
    root = str(tmp_path / "ck")
    sizes = run_ranks(tmp_path, 4, _save_2x2, root)
    assert sizes[0] >= (64 * 40 + 36 * 100) * 4  # every byte once (replicas deduplicated by DCP's planner)
    assert sizes[0] < 2 * (64 * 40 + 36 * 100) * 4
    assert run_ranks(tmp_path, 2, _load_shard1, root) == [True, True]
