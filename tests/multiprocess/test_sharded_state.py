"""Sharded state (DTensors) through the Checkpointer: FSDP2 (fully_shard on a CPU mesh, gloo)
model and AdamW state saved at 4 ranks over 2 roots, each rank writing its own shards, a shard
replicated over a mesh dimension written once; loaded at 4, 3, 2 and 1 rank(s), Shard(0) ->
Shard(1), a 2x2 (Replicate, Shard) mesh -> a 1-D mesh, world size 1 without a process group,
every tensor bit-exact against the full tensors gathered at save time."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from helpers import assert_state_equal, fsdp_mlp, gathered, run_ranks, small_mlp

import fastpersist
from fastpersist import Checkpointer
from fastpersist.errors import CheckpointError, CheckpointReadError, CorruptCheckpointError
from fastpersist.format import manifest as mf

D_IN, D_HID, D_OUT = 48, 130, 37


def _trained(world: int):
    m, opt = fsdp_mlp(world)
    torch.manual_seed(1 + dist.get_rank())
    m(torch.randn(8, D_IN)).sum().backward()
    opt.step()
    return m, opt


def _save_fsdp(rank: int, world: int, roots: list[str]) -> dict:
    m, opt = _trained(world)
    with Checkpointer(roots, mode="snapshot") as ckpt:
        ckpt.save(7, {"model": m, "optim": opt, "step": 7})
    return gathered({"model": m.state_dict(), "optim": opt.state_dict(), "step": 7})


def _load_fsdp(rank: int, world: int, roots: list[str]) -> dict:
    m, opt = _trained(world)  # state exists (other values): load must overwrite every byte
    for p in m.parameters():
        p.data.to_local().fill_(0.5)
    ckpt = Checkpointer(roots)
    ckpt.load(7, into={"model": m, "optim": opt})
    ckpt.close()
    return gathered({"model": m.state_dict(), "optim": opt.state_dict(), "step": 7})


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    roots = [str(tmp / "nvme0"), str(tmp / "nvme1")]
    full = run_ranks(tmp, 4, _save_fsdp, roots)[0]
    return tmp, roots, full


def _manifest(roots: list[str], step: int = 7) -> mf.Manifest:
    return fastpersist.open(roots).manifest(step)


def test_every_rank_writes_its_shards_over_both_roots(fsdp_saved):
    _, roots, full = fsdp_saved
    man = _manifest(roots)
    assert man.version == 3 and man.root_paths == tuple(os.path.abspath(r) for r in roots)
    keys = {t.key for t in man.sharded}
    assert "model.0.weight" in keys and "optim.state.0.exp_avg" in keys
    # written once: the sharded bytes on disk equal the tensors' sizes
    assert sum(c.nbytes for t in man.sharded for c in t.chunks) == sum(full[t.key].nbytes for t in man.sharded)
    writers = {(f.root, f.name.split("-")[2]) for f in man.files if f"-{mf.SHARDED}-" in f.name}
    assert writers == {(root, f"r{r:05d}") for root in (0, 1) for r in range(4)}, writers
    per_root = [sum(e.nbytes for t in man.sharded for c in t.chunks for e in c.extents if man.files[e.file].root == j)
                for j in (0, 1)]
    assert abs(per_root[0] - per_root[1]) <= 4 * 4096 * 8, per_root
    # the replicated part knows nothing of the shards (None where they were) and indexes "step"
    assert not [t for t in man.objects[mf.REPLICATED].tensors if t.key.startswith("model.")]


@pytest.mark.parametrize("world", [4, 3, 2])
def test_reshard_load_is_exact(fsdp_saved, world):
    tmp, roots, full = fsdp_saved
    assert_state_equal(run_ranks(tmp, world, _load_fsdp, roots)[0], full, layout=False)


def test_load_at_world_size_one_without_a_process_group(fsdp_saved):
    _, roots, full = fsdp_saved
    assert not dist.is_initialized()
    state = fastpersist.open(roots).load(7)
    assert_state_equal(gathered(state), full, layout=False)
    # into a plain model: filled in place
    m = small_mlp()
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(3.0)
    fastpersist.open(roots).load(7, into={"model": m})
    assert_state_equal(gathered({"model": m.state_dict()}), {k: v for k, v in full.items() if k.startswith("model.")},
                       layout=False)


def _save_loaded_whole(rank: int, world: int, roots: list[str], out: str) -> bool:
    state = fastpersist.open(roots).load(7)  # whole tensors, as a ddp job reading a sharded checkpoint
    with Checkpointer(out) as ckpt:
        ckpt.save(8, state).wait()  # written once for all ranks: every rank's layout must agree
    return True


def test_whole_tensors_of_a_sharded_load_can_be_saved_again_as_replicated_state(fsdp_saved, tmp_path):
    """Each whole tensor owns a storage of exactly its bytes (its aligned read buffer's place
    in the allocation differs between processes; the replicated state's layout may not)."""
    _, roots, full = fsdp_saved
    tensors: list[torch.Tensor] = []

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(fastpersist.open(roots).load(7))
    assert len(tensors) > 8 and all(t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes for t in tensors)
    assert run_ranks(tmp_path, 2, _save_loaded_whole, roots, str(tmp_path / "again")) == [True, True]
    assert_state_equal(gathered(fastpersist.open(str(tmp_path / "again")).load(8)), full, layout=False)


def test_keys_reads_only_those_tensors(fsdp_saved):
    _, roots, full = fsdp_saved
    view = fastpersist.open(roots)
    wanted = ["model.2.bias", "optim.state.0.exp_avg_sq", "optim.state.0.step"]
    got = view.load(7, keys=wanted)
    assert list(got) == wanted
    for k, v in got.items():
        assert v.dtype == full[k].dtype and torch.equal(v, full[k]), k
    assert not got["optim.state.0.step"].is_sharded if hasattr(got["optim.state.0.step"], "is_sharded") else True
    with pytest.raises(CheckpointReadError, match="no tensor 'model.9.weight'"):
        view.load(7, keys=["model.9.weight"])
    infos = {t.key: t for t in view.tensors(7)}
    assert infos["model.0.weight"].sharded and infos["model.0.weight"].shape == (D_HID, D_IN)
    assert infos["model.0.weight"].chunks == 4


def test_convert_writes_full_tensors_for_torch_load(fsdp_saved, tmp_path):
    _, roots, full = fsdp_saved
    from fastpersist.cli import main

    out = str(tmp_path / "full.pt")
    assert main(["convert", os.path.join(roots[0], "step-00000007"), out, "--root", roots[1]]) == 0
    assert_state_equal(gathered(torch.load(out, weights_only=True)), full, layout=False)


# ---- a 2x2 mesh (Replicate, Shard(0)): the replicated shard written once, split over its holders


def _save_2d(rank: int, world: int, roots: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    big = torch.randn(1024, 640)  # 2.5 MiB: its shards are split over their two holders
    small = torch.arange(60, dtype=torch.int64).reshape(6, 10)
    state = {"big": distribute_tensor(big, mesh, [Replicate(), Shard(0)]),
             "small": distribute_tensor(small, mesh, [Shard(1), Replicate()]),
             "plain": torch.ones(3)}
    with Checkpointer(roots, mode="sync") as ckpt:
        ckpt.save(1, state)
    return {"big": big, "small": small, "plain": torch.ones(3)}


def _load_1d_shard1(rank: int, world: int, roots: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"big": distribute_tensor(torch.zeros(1024, 640), mesh, [Shard(1)]),
             "small": distribute_tensor(torch.zeros(6, 10, dtype=torch.int64), mesh, [Shard(0)]),
             "plain": torch.zeros(3)}
    got = fastpersist.open(roots).load(1, into=state)
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in got.items()}


def test_2x2_mesh_to_1d_shard1(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    full = run_ranks(tmp_path, 4, _save_2d, roots)[0]
    man = _manifest(roots, 1)
    big = man.sharded_by_key()["big"]
    assert len(big.chunks) == 2  # two distinct shards, not four
    assert sum(c.nbytes for c in big.chunks) == full["big"].nbytes
    writers = {man.files[e.file].name.split("-")[2] for c in big.chunks for e in c.extents}
    assert writers == {"r00000", "r00001", "r00002", "r00003"}  # each shard split over its 2 holders
    for world in (2, 3):
        assert_state_equal(run_ranks(tmp_path, world, _load_1d_shard1, roots)[0], full, layout=False)
    assert_state_equal(fastpersist.open(roots).load(1), full, layout=False)


# ---- bad input


def _edit_manifest(root: str, step: int, edit) -> None:
    path = os.path.join(root, f"step-{step:08d}", "manifest.json")
    with open(path, "rb") as f:
        raw = f.read()
    doc = json.loads(raw)
    edit(doc)
    doc.pop("manifest_checksum")
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(mf.seal(body))


@pytest.fixture
def copy_of(fsdp_saved, tmp_path):
    import shutil

    _, roots, full = fsdp_saved
    new = [str(tmp_path / os.path.basename(r)) for r in roots]
    for a, b in zip(roots, new):
        shutil.copytree(a, b)
    return new, full


def test_overlapping_chunks_are_refused_naming_the_key(copy_of):
    roots, _ = copy_of

    def edit(doc):
        t = next(t for t in doc["sharded"] if t["path"] == ["model", "0.weight"])
        t["chunks"][1]["offsets"][0] -= 1

    _edit_manifest(roots[0], 7, edit)
    with pytest.raises(CorruptCheckpointError, match=r"sharded tensor 'model.0.weight'.*overlap"):
        fastpersist.open(roots).load(7)


def test_a_missing_chunk_is_refused_naming_the_key(copy_of):
    roots, _ = copy_of

    def edit(doc):
        t = next(t for t in doc["sharded"] if t["path"] == ["optim", "state", 2, "exp_avg"])
        del t["chunks"][-1]

    _edit_manifest(roots[0], 7, edit)
    with pytest.raises(CorruptCheckpointError, match=r"sharded tensor 'optim.state.2.exp_avg'.*missing"):
        fastpersist.open(roots).load(7)


def test_a_missing_data_file_names_the_file(copy_of):
    roots, _ = copy_of
    step = os.path.join(roots[1], "step-00000007")
    victim = next(n for n in sorted(os.listdir(step)) if f"-{mf.SHARDED}-r00002-" in n)
    os.remove(os.path.join(step, victim))
    with pytest.raises(CorruptCheckpointError, match=victim):
        fastpersist.open(roots).load(7)


def test_a_truncated_data_file_names_the_file(copy_of):
    roots, _ = copy_of
    step = os.path.join(roots[0], "step-00000007")
    victim = next(n for n in sorted(os.listdir(step)) if f"-{mf.SHARDED}-r00001-" in n)
    path = os.path.join(step, victim)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CorruptCheckpointError, match=f"{victim} is truncated"):
        fastpersist.open(roots).load(7)
    problems = fastpersist.open(roots).verify(7)
    assert problems and all(victim in str(p) for p in problems)


def test_a_flipped_byte_names_the_tensor(copy_of):
    roots, _ = copy_of
    man = _manifest(roots)
    t = man.sharded_by_key()["model.0.weight"]
    e = t.chunks[0].extents[0]
    path = os.path.join(roots[man.files[e.file].root], "step-00000007", man.files[e.file].name)
    with open(path, "r+b") as f:
        f.seek(e.offset + 5)
        b = f.read(1)
        f.seek(e.offset + 5)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointError, match="model.0.weight"):
        fastpersist.open(roots).load(7)
    problems = fastpersist.open(roots).verify(7)
    assert len(problems) == 1 and "model.0.weight" in str(problems[0])


def test_another_global_shape_loads_nothing(copy_of):
    roots, _ = copy_of
    m = torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID + 1), torch.nn.ReLU(), torch.nn.Linear(D_HID + 1, D_OUT))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(CheckpointReadError, match=r"'model.0.weight'.*shape \[130, 48\].*\[131, 48\].*nothing"):
        fastpersist.open(roots).load(7, into={"model": m})
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


# ---- overlap mode (technique 3): shards written from live memory while the next iteration runs


def _save_overlap(rank: int, world: int, roots: list[str]) -> dict:
    m, opt = _trained(world)
    ckpt = Checkpointer(roots, mode="overlap")
    ckpt.protect(opt)
    saved = gathered({"model": m.state_dict(), "optim": opt.state_dict()})
    handle = ckpt.save(1, {"model": m, "optim": opt})
    for _ in range(3):  # the next iterations; their optimizer steps wait for the shards to be written
        m(torch.randn(8, D_IN)).sum().backward()
        opt.step()
        opt.zero_grad()
    handle.result()
    ckpt.close()
    return {"saved": saved, "copied": handle.metrics.bytes_copied}


def test_overlap_mode_saves_the_state_at_save_time(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    out = run_ranks(tmp_path, 2, _save_overlap, roots)
    state = fastpersist.open(roots).load(1)
    assert_state_equal(gathered(state), out[0]["saved"], layout=False)
    # the parameters' and optimizer moments' shards were not copied: written from live memory
    params = sum(v.nbytes for k, v in out[0]["saved"].items() if k.startswith("model.")) // 2
    assert out[0]["copied"] < params


def _load_fresh(rank: int, world: int, roots: list[str]) -> dict:
    """A fresh optimizer has no state to fill: torch's get_optimizer_state_dict creates it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    m, opt = fsdp_mlp(world)
    get_optimizer_state_dict(m, opt)
    assert opt.state, "the optimizer should have state now"
    fastpersist.open(roots).load(7, into={"model": m, "optim": opt})
    return gathered({"model": m.state_dict(), "optim": opt.state_dict(), "step": 7})


def test_load_into_a_fresh_optimizer(fsdp_saved):
    tmp, roots, full = fsdp_saved
    assert_state_equal(run_ranks(tmp, 2, _load_fresh, roots)[0], full, layout=False)


# ---- odd inputs (a stranger's review)


def _odd_cases(rank: int, world: int, base: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fastpersist.errors import ReplicaMismatchError, UnsaveableObjectError

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    torch.manual_seed(0)
    # a lazily conjugated local tensor: its values, not its raw bytes, are saved
    c = torch.randn(8, 6, dtype=torch.complex64)
    dt = distribute_tensor(c, mesh, [Shard(0)])
    from torch.distributed.tensor import DTensor

    conj = DTensor.from_local(dt.to_local().conj(), mesh, [Shard(0)])
    with Checkpointer([os.path.join(base, "conj")], mode="sync") as ck:
        ck.save(1, {"c": conj})
    out["conj"] = c.conj().resolve_conj()
    # a Replicate() DTensor whose ranks hold different values: refused, not stitched together
    bad = DTensor.from_local(torch.full((600, 600), float(rank)), mesh, [Replicate()])
    with Checkpointer([os.path.join(base, "diverged")], mode="sync") as ck:
        try:
            ck.save(1, {"r": bad})
            out["diverged"] = "saved"
        except ReplicaMismatchError as e:
            out["diverged"] = str(e)
    # a storage shared by a DTensor's local tensor and the rank state, in snapshot mode
    w = distribute_tensor(torch.arange(4000.0).reshape(40, 100), mesh, [Shard(0)])
    with Checkpointer([os.path.join(base, "shared")], mode="snapshot") as ck:
        ck.save(1, {"w": w}, rank_state={"w_local": w.to_local()}).result()
    out["shared"] = torch.arange(4000.0).reshape(40, 100)
    # DTensors inside a namedtuple: named
    from collections import namedtuple

    pair = namedtuple("pair", "a b")
    with Checkpointer([os.path.join(base, "nt")], mode="sync") as ck:
        try:
            ck.save(1, {"p": pair(w, 1)})
        except UnsaveableObjectError as e:
            out["namedtuple"] = str(e)
    return out


def _into_parameter(rank: int, world: int, base: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(40, 100), mesh, [Shard(1)]))
    fastpersist.open([os.path.join(base, "shared")]).load(1, into={"w": p})
    return torch.equal(p.full_tensor(), torch.arange(4000.0).reshape(40, 100))


def test_odd_inputs(tmp_path):
    base = str(tmp_path)
    out = run_ranks(tmp_path, 2, _odd_cases, base)[0]
    got = fastpersist.open([os.path.join(base, "conj")]).load(1)["c"]
    assert torch.equal(got, out["conj"])
    assert "'r'" in out["diverged"] and "rank 1 and rank 0" in out["diverged"]
    shared = fastpersist.open([os.path.join(base, "shared")]).load(1)
    assert torch.equal(shared["w"], out["shared"])
    assert "namedtuple" in out["namedtuple"]
    # into a DTensor parameter (requires grad), resharded through the buffered path
    assert run_ranks(tmp_path, 3, _into_parameter, base) == [True, True, True]


def test_into_reads_only_its_keys(fsdp_saved):
    _, roots, full = fsdp_saved
    m = small_mlp()
    state = fastpersist.open(roots).load(7, into={"model": m})
    assert state["optim"]["state"][0]["exp_avg"] is None  # not read: `into` did not ask for it
    assert_state_equal(gathered({"model": m.state_dict()}), {k: v for k, v in full.items() if k.startswith("model.")},
                       layout=False)


def test_colliding_dotted_keys_are_refused(tmp_path):
    roots = [str(tmp_path / "r")]
    with Checkpointer(roots, mode="sync") as ck:
        ck.save(1, {"a.b": torch.ones(2), "a": {"b": torch.full((2,), 2.0)}})
    view = fastpersist.open(roots)
    with pytest.raises(CheckpointReadError, match="'a.b' names 2 tensors"):
        view.load(1, keys=["a.b"])
    state = view.load(1)
    assert torch.equal(state["a.b"], torch.ones(2)) and torch.equal(state["a"]["b"], torch.full((2,), 2.0))


def test_a_tensor_in_into_of_another_dtype_is_refused(tmp_path):
    roots = [str(tmp_path / "r")]
    with Checkpointer(roots, mode="sync") as ck:
        ck.save(1, {"x": torch.tensor([0.25, 0.75])})
    dest = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(CheckpointReadError, match="float32.*int32"):
        fastpersist.open(roots).load(1, into={"x": dest})


def _save_recording(rank: int, world: int, roots: list[str]) -> list[tuple[str, str]]:
    """Save a DTensor state through a backend that records file creations, directory fsyncs and
    the "after-data" point (the data is declared durable there)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fastpersist.storage.backend import FileBackend

    class Recording(FileBackend):
        seen: list[tuple[str, str]] = []

        def before_open(self, root, path):
            self.seen.append(("open", path))

        def fsync_dir(self, path):
            self.seen.append(("fsync_dir", path))
            super().fsync_dir(path)

        def event(self, point):
            self.seen.append(("event", point))

    mesh = init_device_mesh("cpu", (world,))
    backend = Recording()
    with Checkpointer(roots, mode="sync", backend=backend) as ck:
        ck.save(1, {"w": distribute_tensor(torch.arange(8192.0).reshape(64, 128), mesh, [Shard(0)])})
    return backend.seen


def test_shard_files_are_durable_before_the_data_is_declared_written(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    seen = run_ranks(tmp_path, 2, _save_recording, roots)[0]
    after = seen.index(("event", "after-data"))
    shards = [i for i, (what, path) in enumerate(seen) if what == "open" and f"-{mf.SHARDED}-" in path]
    assert shards and max(shards) < after
    for i in shards:  # each shard file's directory is fsync'd after the file is created, before after-data
        d = os.path.dirname(seen[i][1])
        assert any(what == "fsync_dir" and path == d for what, path in seen[i + 1:after]), seen[i]
