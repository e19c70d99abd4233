"""Copies across nodes (``node=``, ``redundancy=``, ``FASTPERSIST_NODE``) and the restore
protocol, with nodes simulated on this machine: groups of real gloo ranks, each node with its
own private roots and a backend that refuses every other node's (tests/node_sim.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import fastpersist
from fastpersist import Checkpointer
from fastpersist.errors import CheckpointReadError, CorruptCheckpointError
from fastpersist.format import copies
from fastpersist.format import manifest as mf
from fastpersist.topology import NodeMap, check_redundancy, node_id, redundant_plan
from fastpersist.tiers.nodes.copies import partners, senders
from fastpersist.plan import ALIGN

from helpers import assert_state_equal, per_rank, replicated, run_ranks
from node_sim import checkpointer, roots_of

# ---------------------------------------------------------------------------------------------
# pure parts


@pytest.mark.parametrize("nodes,per_node,roots,copies_", [(2, 1, 1, 2), (2, 2, 2, 2), (4, 1, 2, 2), (4, 2, 1, 3),
                                                           (3, 2, 2, 3), (4, 1, 1, 1)])
def test_redundant_plan_puts_every_byte_on_distinct_nodes_evenly(nodes, per_node, roots, copies_):
    sizes = [1, 4096 * 3 + 7, 0, 100_000, 5, 1 << 20, 12_345]
    slot_nodes = [r // per_node for r in range(nodes * per_node) for _ in range(roots)]
    extents = redundant_plan(sizes, slot_nodes, copies_)
    held: dict[tuple[int, int, int], list[int]] = {}
    for e in extents:
        held.setdefault((e.storage, e.start, e.nbytes), []).append(slot_nodes[e.slot])
    for where, on in held.items():
        assert len(on) == copies_ and len(set(on)) == copies_, (where, on)
    covered: dict[int, list[tuple[int, int]]] = {}
    for storage, start, n in held:
        covered.setdefault(storage, []).append((start, n))
    for s, size in enumerate(sizes):
        spans = sorted(covered.get(s, []))
        assert sum(n for _, n in spans) == size
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    per_node_bytes = [0] * nodes
    for e in extents:
        per_node_bytes[slot_nodes[e.slot]] += e.nbytes
    ideal = sum(sizes) * copies_ / nodes
    assert all(abs(b - ideal) <= 2 * ALIGN * per_node * roots * copies_ for b in per_node_bytes), per_node_bytes


def test_partners_are_on_other_nodes_and_everyone_is_kept_twice():
    nodes = NodeMap.from_ids(["a", "a", "b", "b", "c", "c"])
    for r in range(6):
        ps = partners(nodes, r, 3)
        assert len(ps) == 2 and len({nodes.of_rank[p] for p in ps} | {nodes.of_rank[r]}) == 3
    kept = [k for r in range(6) for k in senders(nodes, r, 2)]
    assert sorted(kept) == list(range(6))


def test_node_ids_and_redundancy_are_checked(monkeypatch):
    monkeypatch.delenv("FASTPERSIST_NODE", raising=False)
    assert node_id(None, "host-1") == "host-1"
    monkeypatch.setenv("FASTPERSIST_NODE", "rack3-n7")
    assert node_id(None, "host-1") == "rack3-n7"
    assert node_id("given", "host-1") == "given"
    with pytest.raises(ValueError, match="FASTPERSIST_NODE"):
        monkeypatch.setenv("FASTPERSIST_NODE", "bad\nid")
        node_id(None, "h")
    two = NodeMap.from_ids(["a", "b"])
    assert check_redundancy(None, two) == 2 and check_redundancy(None, NodeMap.from_ids(["a"])) == 1
    with pytest.raises(ValueError, match=r"redundancy=3 needs 3 nodes, but the job runs on 2"):
        check_redundancy(3, two)


def test_redundancy_beyond_the_nodes_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"redundancy=2 needs 2 nodes, but the job runs on 1"):
        Checkpointer(tmp_path / "r", redundancy=2, node="only")


def _manifest_with_copies() -> mf.Manifest:
    files = (mf.FileEntry(0, "a.bin", 100, 0), mf.FileEntry(0, "b.bin", 100, 1), mf.FileEntry(0, "s0.skel", 4, 0),
             mf.FileEntry(0, "s1.skel", 4, 1))
    ext = mf.ExtentEntry(0, 0, 0, 64, 7, ((1, 32),))
    skel = mf.ExtentEntry(2, 0, 0, 4, 9, ((3, 0),))
    obj = mf.ObjectEntry(skel, (mf.StorageEntry("0", 64, (ext,)),))
    return mf.Manifest(5, "id", 1.0, 2, 1, files, {mf.REPLICATED: obj}, version=4, nodes=("n0", "n1"), node=1)


def test_manifest_version_4_round_trips_and_is_strict():
    m = _manifest_with_copies()
    raw = m.to_json()
    back = mf.parse("m", raw)
    assert back.nodes == ("n0", "n1") and back.node == 1
    assert back.objects[mf.REPLICATED].storages[0].extents[0].copies == ((1, 32),)
    assert back.files[1].node == 1

    def broken(edit):
        doc = json.loads(raw[: raw.rindex(b',"manifest_checksum"')] + b"}")
        edit(doc)
        return mf.seal(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())

    same_node = broken(lambda d: d["files"][1].update(node=0))
    with pytest.raises(CorruptCheckpointError, match="two copies on node #0"):
        mf.parse("m", same_node)
    beyond = broken(lambda d: d["objects"]["replicated"]["storages"][0]["extents"][0].update(copies=[[1, 90]]))
    with pytest.raises(CorruptCheckpointError, match="beyond the end"):
        mf.parse("m", beyond)
    overlap = broken(lambda d: d["objects"]["replicated"]["storages"][0]["extents"][0].update(copies=[[1, 0]]) or
                     d["files"][1].update(size=100) or d["objects"]["replicated"].update(
                         skeleton={"file": 1, "offset": 0, "start": 0, "nbytes": 4, "checksum": "0" * 16}))
    with pytest.raises(CorruptCheckpointError, match="overlaps"):
        mf.parse("m", overlap)
    dup = broken(lambda d: d.update(nodes=["n0", "n0"]))
    with pytest.raises(CorruptCheckpointError, match="distinct node ids"):
        mf.parse("m", dup)
    node_out = broken(lambda d: d["files"][0].update(node=5))
    with pytest.raises(CorruptCheckpointError, match="node index 5"):
        mf.parse("m", node_out)


def test_localize_picks_a_present_copy_and_names_what_has_none():
    m = _manifest_with_copies()
    local, missing = copies.localize(m, lambda e: next((loc for loc in e.locations() if loc[0] in (1, 3)), None))
    e = local.objects[mf.REPLICATED].storages[0].extents[0]
    assert (e.file, e.offset, e.copies) == (1, 32, ())
    assert not missing
    _, missing = copies.localize(m, lambda e: None)
    text = copies.describe_missing(m, missing)
    assert "2 extents" in text and "a.bin (node n0)" in text and "b.bin (node n1)" in text


# ---------------------------------------------------------------------------------------------
# simulated nodes, real gloo ranks

PER_NODE = 2  # ranks per node in the 2-node cases


def _save_steps(rank, world, base, per_node, steps, kw):
    ck = checkpointer(base, rank, per_node, **kw)
    for step in steps:
        ck.save(step, replicated(step), rank_state=per_rank(step, rank))
    ck.close()
    return ck.redundancy


def _load(rank, world, base, per_node, step, expect, names=None, owner=None):
    """Load ``step`` on every rank; check the replicated state, this rank's own state and, with
    ``owner``, that rank's own state too."""
    ck = checkpointer(base, rank, per_node, names)
    try:
        latest = ck.latest_step()
        got = ck.load(step)
        assert_state_equal(got, replicated(expect))
        for who in [rank] + ([owner] if owner is not None else []):
            assert_state_equal(ck.load_rank_state(step, rank=who), per_rank(expect, who))
        return latest
    finally:
        ck.close()


def _load_error(rank, world, base, per_node, step):
    ck = checkpointer(base, rank, per_node)
    try:
        ck.load(step)
    except CheckpointReadError as e:
        return str(e)
    finally:
        ck.close()
    return None


def test_two_nodes_each_hold_everything_and_a_lost_node_is_replaced(tmp_path):
    base = str(tmp_path / "nodes")
    durable = str(tmp_path / "durable")
    assert run_ranks(tmp_path, 4, _save_steps, base, PER_NODE, [0, 1, 2], {"keep": 2, "durable": durable}) == [2] * 4
    # the durable tier holds every node's files (copies included) and loads anywhere (a drain
    # may have skipped a step while another was in flight: its latest is some step drained)
    drained = fastpersist.open(durable)
    step = drained.latest_step()
    assert step is not None
    assert_state_equal(drained.load(step), replicated(step))
    # every node holds every byte: each node's own view loads alone
    for node in ("node0", "node1"):
        view_state = Checkpointer(roots_of(base, node), node=node).load("latest")
        assert_state_equal(view_state, replicated(2))
    shutil.rmtree(os.path.join(base, "node1"))  # node 1 is lost with its disks; a replacement comes up empty
    assert run_ranks(tmp_path, 4, _load, base, PER_NODE, "latest", 2) == [2] * 4
    # after the restore the next save is fully redundant again
    run_ranks(tmp_path, 4, _save_steps, base, PER_NODE, [3], {"keep": 2})
    m = fastpersist.open(roots_of(base, "node1")).manifest("latest")
    assert m.step == 3 and m.nodes == ("node0", "node1")
    for _, e in copies.extents(m):
        assert {m.files[f].node for f, _ in e.locations()} == {0, 1}


def test_four_nodes_lose_one_restore_on_a_replacement_and_on_one_node_fewer(tmp_path):
    base = str(tmp_path / "nodes")
    run_ranks(tmp_path, 4, _save_steps, base, 1, [0, 1], {})
    m = fastpersist.open(roots_of(base, "node0")).manifest(1)
    rep = m.objects[mf.REPLICATED]
    on_node = [0] * 4
    for s in rep.storages:
        for e in s.extents:
            for f, _ in e.locations():
                on_node[m.files[f].node] += e.nbytes
    assert all(abs(b - rep.nbytes / 2) < 0.1 * rep.nbytes for b in on_node), (on_node, rep.nbytes)  # r/N each
    shutil.rmtree(os.path.join(base, "node2"))
    # a replacement node with empty disks, same world size
    assert run_ranks(tmp_path, 4, _load, base, 1, "latest", 1) == [1] * 4
    shutil.rmtree(os.path.join(base, "node2"))
    # one node fewer: ranks 0-2 on nodes 0, 1 and 3 (rank 2's own state from its copy on node 3)
    names = ["node0", "node1", "node3"]
    assert run_ranks(tmp_path, 3, _load, base, 1, 1, 1, names, 3) == [1] * 3


def test_losing_as_many_nodes_as_copies_fails_naming_what_is_lost(tmp_path):
    base = str(tmp_path / "nodes")
    run_ranks(tmp_path, 4, _save_steps, base, 1, [0, 1], {})
    shutil.rmtree(os.path.join(base, "node1"))
    shutil.rmtree(os.path.join(base, "node2"))
    errors = run_ranks(tmp_path, 4, _load_error, base, 1, 1)
    assert all(e is not None for e in errors)
    assert "checkpoint step 1 cannot be restored" in errors[0] and "have no copy on any of them" in errors[0]
    assert "(node node1)" in errors[0] or "(node node2)" in errors[0]
    assert "no older step is complete" in errors[0]


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_flipped_byte_in_one_copy_is_read_from_another(tmp_path):
    base = str(tmp_path / "nodes")
    run_ranks(tmp_path, 4, _save_steps, base, 1, [0], {})
    m = fastpersist.open(roots_of(base, "node0")).manifest("latest")
    e = max((e for _, e in copies.extents(m)), key=lambda e: e.nbytes)
    f, off = e.locations()[0]
    node = m.nodes[m.files[f].node]
    path = os.path.join(roots_of(base, node)[m.files[f].root], "step-00000000", m.files[f].name)
    _flip(path, off + e.nbytes // 2)
    assert run_ranks(tmp_path, 4, _load, base, 1, 0, 0) == [0] * 4


def test_a_node_back_with_stale_disks_does_not_win(tmp_path):
    base = str(tmp_path / "nodes")
    run_ranks(tmp_path, 4, _save_steps, base, PER_NODE, [0, 1], {})
    stale = str(tmp_path / "stale")
    shutil.copytree(os.path.join(base, "node1"), stale)  # node 1's disks as they were at step 1
    run_ranks(tmp_path, 4, _save_steps, base, PER_NODE, [2, 3], {"keep": 2})
    shutil.rmtree(os.path.join(base, "node1"))
    shutil.copytree(stale, os.path.join(base, "node1"))  # node 1 comes back with its old disks
    assert run_ranks(tmp_path, 4, _load, base, PER_NODE, "latest", 3) == [3] * 4
    # the next save's clean start and retention leave the job's timeline as it was, on both nodes
    run_ranks(tmp_path, 4, _save_steps, base, PER_NODE, [4], {"keep": 2})
    for node, kept in (("node0", [3, 4]), ("node1", [4])):  # node 1 never held step 3; its stale steps went
        view = Checkpointer(roots_of(base, node), node=node)
        assert view.latest_step() == 4
        assert [c.step for c in view.list() if c.committed] == kept


def _fsdp_save(rank, world, base, per_node):
    from helpers import fsdp_mlp

    model, _ = fsdp_mlp(world)
    ck = checkpointer(base, rank, per_node)
    ck.save(1, {"model": model.state_dict()})
    ck.close()


def _fsdp_load(rank, world, base, per_node):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from helpers import fsdp_mlp, gathered

    model, _ = fsdp_mlp(world)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    ck = checkpointer(base, rank, per_node)
    ck.load("latest", into={"model": model.state_dict()})
    ck.close()
    return gathered(get_model_state_dict(model))


def test_sharded_state_survives_a_lost_node_and_reshards(tmp_path):
    from helpers import small_mlp

    base = str(tmp_path / "nodes")
    run_ranks(tmp_path, 4, _fsdp_save, base, PER_NODE)  # the model as fsdp_mlp initialises it
    shutil.rmtree(os.path.join(base, "node0"))
    want = small_mlp().state_dict()
    for world, per_node in ((4, PER_NODE), (2, 1)):  # same size on a replacement node; 2 ranks: resharded
        for got in run_ranks(tmp_path, world, _fsdp_load, base, per_node):
            assert sorted(got) == sorted(want)
            for k in want:
                assert torch.equal(got[k], want[k]), (world, k)


def test_a_one_node_checkpoint_restores_on_two_nodes(tmp_path):
    """Scaling out: a job saved on one node (format version 3) resumes on two; node 1 receives
    every byte from node 0."""
    base = str(tmp_path / "nodes")
    with Checkpointer(roots_of(base, "node0"), node="node0") as ck:
        ck.save(4, replicated(4), rank_state=per_rank(4, 0))
    assert fastpersist.open(roots_of(base, "node0")).manifest(4).version == 3
    assert run_ranks(tmp_path, 4, _load_scaled_out, base) == [4] * 4


def _load_scaled_out(rank, world, base):
    ck = checkpointer(base, rank, PER_NODE)
    try:
        assert_state_equal(ck.load("latest"), replicated(4))
        assert_state_equal(ck.load_rank_state(rank=0), per_rank(4, 0))
        return ck.latest_step()
    finally:
        ck.close()


def _save_with_a_full_disk(rank, world, base):
    from fastpersist.errors import CheckpointWriteError

    ck = checkpointer(base, rank, PER_NODE, fail_at=("write", 1) if rank == 3 else None, timeout_s=120)
    try:
        try:
            ck.save(0, replicated(0), rank_state=per_rank(0, rank)).wait()
        except CheckpointWriteError as e:
            first = str(e)
        else:
            first = None
        return first, ck.latest_step()
    finally:
        try:
            ck.close()
        except CheckpointWriteError:
            pass


def test_a_full_disk_on_one_node_fails_the_save_everywhere_without_a_hang(tmp_path):
    base = str(tmp_path / "nodes")
    results = run_ranks(tmp_path, 4, _save_with_a_full_disk, base, timeout=240)
    assert all(err is not None and "rank 3" in err and "No space left" in err for err, _ in results), results
    assert all(latest is None for _, latest in results)  # nothing committed anywhere


def _restore_with_a_full_disk(rank, world, base):
    ck = checkpointer(base, rank, 1, fail_at=("stage", 1) if rank == 2 else None, timeout_s=120)
    try:
        ck.load("latest")
    except CheckpointReadError as e:
        return str(e)
    finally:
        ck.close()
    return None


def test_a_node_that_cannot_stage_fails_the_restore_everywhere_without_a_hang(tmp_path):
    base = str(tmp_path / "nodes")
    run_ranks(tmp_path, 4, _save_steps, base, 1, [0], {})
    errors = run_ranks(tmp_path, 4, _restore_with_a_full_disk, base, timeout=240)
    assert all(e is not None and "rank 2" in e and "No space left" in e for e in errors), errors


def _shared_roots(rank, world, root):
    from fastpersist.errors import CheckpointWriteError

    ck = Checkpointer(root, node=f"host{rank // 2}", mode="sync")
    try:
        ck.save(0, replicated(0))
    except CheckpointWriteError as e:
        return str(e)
    finally:
        ck.close()
    return None


def test_roots_shared_by_two_nodes_are_refused_naming_the_remedy(tmp_path):
    errors = run_ranks(tmp_path, 4, _shared_roots, str(tmp_path / "shared"))
    assert all(e is not None and "FASTPERSIST_NODE=shared" in e for e in errors), errors
    assert not any(n.startswith("step-") for n in os.listdir(tmp_path / "shared"))
