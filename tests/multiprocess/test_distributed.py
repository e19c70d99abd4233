"""Real multi-process runs: spawned ranks on torch.distributed with gloo.

Ranks build the same replicated state from a seed and a per-rank state from seed + rank, so
the parent can check what every rank saved and loaded, bit for bit.
"""

from __future__ import annotations

import errno
import json
import os
import traceback

import pytest
from helpers import states_equal as _equal
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastpersist as fp
from fastpersist.checkpointer import Checkpointer, load_checkpoint
from fastpersist.storage.backend import FileBackend


def replicated(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(200_000, generator=g),
        "b": torch.randn(4097, generator=g).to(torch.bfloat16),
        "tiny": [torch.randn(3, generator=g) for _ in range(50)],
        "empty": torch.empty(0, dtype=torch.int8),
        "step": seed,
    }


def per_rank(seed: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return {"shard": torch.randn(10_000 + 4097 * rank, generator=g), "rank": rank}


class FailOnRank(FileBackend):
    """Fails every data write on one rank with EIO."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        if dist.get_rank() == self.rank:
            raise OSError(errno.EIO, f"injected EIO on rank {self.rank}")


def _worker(rank: int, world: int, init: str, roots: list[str], task: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        if task == "save":
            ck = Checkpointer(roots)
            stats = ck.save(4, replicated(4), rank_state=per_rank(4, rank)).wait()
            # load at the same world size, every rank, right after
            if not _equal(ck.load(4), replicated(4)) or not _equal(ck.load_rank_state(4), per_rank(4, rank)):
                raise RuntimeError(f"rank {rank}: loaded state differs")
            with open(os.path.join(out, f"stats{rank}.json"), "w") as f:
                json.dump({"written": stats.bytes_written, "total": stats.bytes_total}, f)
        elif task == "load":
            ck = Checkpointer(roots)
            if not _equal(ck.load("latest"), replicated(4)):
                raise RuntimeError(f"rank {rank} of {world}: replicated state differs")
            if not _equal(ck.load_rank_state(4, rank=rank % 4), per_rank(4, rank % 4)):
                raise RuntimeError(f"rank {rank} of {world}: per-rank state differs")
        elif task == "fail":
            ck = Checkpointer(roots, backend=FailOnRank(2))
            try:
                ck.save(9, replicated(9)).wait()
            except fp.CheckpointWriteError as e:
                message = str(e)
            else:
                message = "no error"
            with open(os.path.join(out, f"error{rank}.txt"), "w") as f:
                f.write(message)
        elif task == "node":
            ck = Checkpointer(roots, writers="node")
            stats = ck.save(11, replicated(11)).wait()
            with open(os.path.join(out, f"stats{rank}.json"), "w") as f:
                json.dump({"written": stats.bytes_written, "total": stats.bytes_total}, f)
    except BaseException:
        with open(os.path.join(out, f"crash{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _run(tmp_path, world: int, roots: list[str], task: str) -> str:
    out = tmp_path / f"out-{task}-{world}"
    out.mkdir(exist_ok=True)
    init = f"file://{tmp_path}/rendezvous-{task}-{world}"
    mp.start_processes(_worker, args=(world, init, roots, task, str(out)), nprocs=world,
                       start_method="spawn", join=True)
    return str(out)


@pytest.fixture(scope="module")
def four_rank_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    roots = [str(tmp / "nvme0"), str(tmp / "nvme1")]
    out = _run(tmp, 4, roots, "save")
    return tmp, roots, out


def test_save_at_four_ranks_balanced(four_rank_checkpoint):
    _, roots, out = four_rank_checkpoint
    stats = [json.load(open(os.path.join(out, f"stats{r}.json"))) for r in range(4)]
    total = stats[0]["total"]
    own = [per_rank(4, r)["shard"].nbytes for r in range(4)]  # each rank's own state
    shares = [s["written"] - o for s, o in zip(stats, own)]  # replicated bytes each rank wrote
    ideal = (total - sum(own)) / 4
    assert all(abs(x - ideal) <= 2 * 4096 for x in shares), shares
    assert not os.path.exists(os.path.join(roots[1], "latest"))


def test_load_at_world_size_one(four_rank_checkpoint):
    _, roots, _ = four_rank_checkpoint
    ck = Checkpointer(roots)
    assert ck.latest_step() == 4
    assert _equal(ck.load(), replicated(4))
    for r in range(4):
        assert _equal(ck.load_rank_state(rank=r), per_rank(4, r))
    step = os.path.join(roots[0], "step-00000004")
    assert _equal(load_checkpoint(step, roots[1:]), replicated(4))


@pytest.mark.parametrize("world", [2, 3])
def test_load_at_other_world_sizes(four_rank_checkpoint, world):
    tmp, roots, _ = four_rank_checkpoint
    _run(tmp, world, roots, "load")


def test_failure_on_rank_two_raises_everywhere(tmp_path):
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    with Checkpointer(roots) as first:  # world size 1: the previous checkpoint
        first.save(8, replicated(8)).wait()
    out = _run(tmp_path, 4, roots, "fail")
    for r in range(4):
        msg = open(os.path.join(out, f"error{r}.txt")).read()
        assert "failed on rank 2:" in msg and "injected EIO on rank 2" in msg, (r, msg)
    assert not os.path.exists(os.path.join(roots[0], "step-00000009", "manifest.json"))
    leftovers = [n for root in roots if os.path.isdir(os.path.join(root, "step-00000009"))
                 for n in os.listdir(os.path.join(root, "step-00000009"))]
    assert leftovers == []  # every rank removed what it wrote
    ck = Checkpointer(roots)
    assert ck.latest_step() == 8 and _equal(ck.load(), replicated(8))
    ck.save(10, replicated(10)).wait()  # the next writer removes any directory left
    assert not os.path.exists(os.path.join(roots[0], "step-00000009"))


def test_one_writer_per_node(tmp_path):
    roots = [str(tmp_path / "r0")]
    out = _run(tmp_path, 2, roots, "node")
    written = [json.load(open(os.path.join(out, f"stats{r}.json")))["written"] for r in range(2)]
    assert written[1] == 0 and written[0] > 0  # one host: rank 0 writes everything
    assert _equal(Checkpointer(roots).load(11), replicated(11))
