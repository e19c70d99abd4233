"""The sharded Checkpointer in one process: round trips, roots, retention, bad input, faults."""

from __future__ import annotations

import collections
import enum
import errno
import io
import json
import os
import types

import pytest
from helpers import states_equal as _equal
import torch

import fastpersist as fp
from fastpersist.checkpointer import Checkpointer, list_checkpoints, load_checkpoint
from fastpersist.format import manifest as mf
from fastpersist.state import to_saveable
from fastpersist.storage.backend import FileBackend


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300_000, generator=g)
    emb = torch.randn(1000, 64, generator=g)
    return {
        "big": big,
        "view": big[10:5000],  # shares big's storage
        "emb": emb,
        "tied": emb,  # the same tensor twice
        "t": emb.t(),  # non-contiguous
        "bf16": torch.randn(4097, generator=g).to(torch.bfloat16),
        "half": torch.randn(33, generator=g).half(),
        "i8": torch.randint(-100, 100, (4095,), generator=g, dtype=torch.int8),
        "bool": torch.rand(1, generator=g) > 0.5,
        "c64": torch.randn(17, generator=g, dtype=torch.complex64),
        "u8": torch.randint(0, 255, (1,), generator=g, dtype=torch.uint8),
        "zero_d": torch.tensor(float(seed)),
        "empty": torch.empty(0),
        "nested": {"list": [torch.full((3,), seed), seed], "s": f"seed {seed}"},
        "step": seed,
    }


def _roots(tmp_path, n: int) -> list[str]:
    return [str(tmp_path / f"nvme{i}") for i in range(n)]


@pytest.mark.parametrize("nroots", [1, 2, 3])
def test_round_trip_over_roots(tmp_path, small_io, nroots):
    ck = Checkpointer(_roots(tmp_path, nroots), config=small_io)
    a, b = _state(1), _state(2)
    assert not _equal(a, b)
    ck.save(1, a).wait()
    ck.save(2, b).wait()
    got = ck.load(1)
    assert _equal(got, a) and not _equal(got, b)
    got = ck.load("latest")
    assert _equal(got, b)
    assert got["tied"].untyped_storage().data_ptr() == got["emb"].untyped_storage().data_ptr()
    assert got["view"].untyped_storage().data_ptr() == got["big"].untyped_storage().data_ptr()
    # every root received a share
    for root in ck.roots:
        assert any(n.endswith(".bin") for n in os.listdir(os.path.join(root, "step-00000002")))


def _storage_bytes(obj: object, seen: dict[int, int] | None = None) -> int:
    """The bytes of the storages under ``obj``, each counted once (views and tied tensors share)."""
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, dict):
        for v in obj.values():
            _storage_bytes(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storage_bytes(v, seen)
    return sum(seen.values())


def test_balanced_share_per_root(tmp_path, small_io):
    ck = Checkpointer(_roots(tmp_path, 4), config=small_io)
    state = _state(3)
    stats = ck.save(3, state).wait()
    loads = [stats.bytes_per_root[j] for j in range(4)]
    assert max(loads) - min(loads) <= 2 * 4096
    assert sum(loads) == stats.bytes_total == _storage_bytes(state)  # every storage's bytes, once


def test_large_extents_share_memory_phase(tmp_path, small_io):
    """File offsets of large extents match the memory's alignment phase (so O_DIRECT is zero-copy)."""
    ck = Checkpointer(_roots(tmp_path, 2), config=small_io, mode="sync")  # written from the tensor itself
    state = {"w": torch.randn(1 << 20)}
    ck.save(1, state).wait()
    m = json.loads(open(os.path.join(ck.roots[0], "step-00000001", "manifest.json")).read())
    phase = state["w"].data_ptr() % 4096
    for e in m["objects"]["replicated"]["storages"][0]["extents"]:
        assert (e["offset"] - e["start"]) % 4096 == phase


def test_into_restores_module_and_optimizer_in_place(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    def train() -> None:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        sched.step()

    train()
    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save(1, {"model": model, "optim": opt, "sched": sched, "extra": {"epoch": 3}}).wait()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()["state"][0]["exp_avg"].clone()
    train()
    assert not all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    extra: dict = {}
    ck.load("latest", into={"model": model, "optim": opt, "sched": sched, "extra": extra})
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt)
    assert sched.last_epoch == 1 and extra == {"epoch": 3}


def test_rank_state_is_separate(tmp_path):
    ck = Checkpointer(_roots(tmp_path, 2))
    ck.save(1, {"w": torch.ones(5)}, rank_state={"rng": torch.get_rng_state(), "mine": torch.arange(70_000)}).wait()
    assert _equal(ck.load_rank_state(1)["mine"], torch.arange(70_000))
    with pytest.raises(fp.CheckpointReadError, match="rank-00003"):
        ck.load_rank_state(1, rank=3)


def test_list_latest_and_retention(tmp_path):
    ck = Checkpointer(_roots(tmp_path, 2), keep=2)
    for step in (1, 2, 3, 4):
        ck.save(step, {"x": torch.full((10_000,), step)}).wait()
    infos = ck.list()
    assert [i.step for i in infos] == [3, 4] and [i.latest for i in infos] == [False, True]
    assert all(i.committed for i in infos)
    assert sorted(os.listdir(ck.roots[1])) == ["step-00000003", "step-00000004"]
    assert ck.latest_step() == 4


def test_saving_a_step_again_replaces_it(tmp_path, small_io):
    ck = Checkpointer(_roots(tmp_path, 2), config=small_io)
    ck.save(5, _state(1)).wait()
    ck.save(5, _state(2)).wait()
    assert _equal(ck.load(5), _state(2))
    names = [n for r in ck.roots for n in os.listdir(os.path.join(r, "step-00000005"))]
    ids = {n.split("-")[0] for n in names if n != "manifest.json"}
    assert len(ids) == 1, names  # the first save's files are gone


def test_incomplete_checkpoint_is_not_listed_as_committed(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save(1, {"x": torch.ones(3)}).wait()
    os.makedirs(os.path.join(ck.roots[0], "step-00000002"))  # as a crash would leave it
    infos = ck.list()
    assert [(i.step, i.committed) for i in infos] == [(1, True), (2, False)]
    assert ck.latest_step() == 1
    with pytest.raises(fp.CheckpointNotFoundError, match="no committed checkpoint"):
        ck.load(2)


def test_latest_pointer_damage_falls_back(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save(1, {"x": torch.ones(3)}).wait()
    ck.save(2, {"x": torch.ones(3) * 2}).wait()
    with open(os.path.join(ck.roots[0], "latest"), "w") as f:
        f.write("step-00000099\n")
    assert ck.load()["x"][0] == 2


def test_load_checkpoint_and_missing_roots(tmp_path):
    ck = Checkpointer(_roots(tmp_path, 2))
    ck.save(7, _state(7)).wait()
    path = os.path.join(ck.roots[0], "step-00000007")
    assert _equal(load_checkpoint(path, [ck.roots[1]]), _state(7))
    # without other_roots: the roots the manifest recorded, while they are where they were saved
    assert _equal(load_checkpoint(path), _state(7))
    os.rename(ck.roots[1], ck.roots[1] + "-moved")
    with pytest.raises(fp.CheckpointNotFoundError, match="root #1 was .* and .* is not there"):
        load_checkpoint(path)
    assert _equal(load_checkpoint(path, [ck.roots[1] + "-moved"]), _state(7))
    assert [i.step for i in list_checkpoints(ck.roots[0])] == [7]


def test_failing_writer_leaves_no_manifest_and_keeps_latest(tmp_path):
    class Failing(FileBackend):
        def before_write(self, root, path, offset, nbytes):
            if self.armed and root == 1:
                raise OSError(errno.EIO, "injected I/O error")

    backend = Failing()
    backend.armed = False
    ck = Checkpointer(_roots(tmp_path, 2), backend=backend)
    ck.save(1, _state(1)).wait()
    backend.armed = True
    with pytest.raises(fp.CheckpointWriteError, match="injected I/O error") as info:
        ck.save(2, _state(2)).wait()
    assert "nvme1" in str(info.value) and "--- rank" not in str(info.value)  # world size 1: no rank block
    for root in ck.roots:
        assert not os.path.exists(os.path.join(root, "step-00000002"))
    assert ck.latest_step() == 1 and _equal(ck.load(), _state(1))


def test_full_disk_keeps_earlier_checkpoint(tmp_path, small_fs):
    ck = Checkpointer([small_fs])
    ck.save(1, {"x": torch.ones(256 * 1024)}).wait()  # 1 MiB
    with pytest.raises(fp.CheckpointWriteError, match="No space left"):
        ck.save(2, {"x": torch.ones(4 * 1024 * 1024)}).wait()  # 16 MiB > 8 MiB tmpfs
    assert ck.latest_step() == 1 and torch.equal(ck.load()["x"], torch.ones(256 * 1024))
    assert not os.path.exists(os.path.join(small_fs, "step-00000002"))


def test_read_only_root(readonly_fs):
    with pytest.raises(fp.CheckpointWriteError, match="cannot be created.*read-only filesystem"):
        Checkpointer([os.path.join(readonly_fs, "run")])
    with pytest.raises(fp.CheckpointWriteError, match="is not writable"):
        Checkpointer([readonly_fs])
    assert fp.open(readonly_fs).list() == []  # reading needs no write access


def test_state_that_cannot_be_saved(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(fp.UnsaveableObjectError):
        ck.save(1, {"f": lambda: 0}).wait()
    assert ck.list() == []


# ---------------------------------------------------------------------------------------------
# bad input on load


@pytest.fixture
def saved(tmp_path):
    ck = Checkpointer(_roots(tmp_path, 2))
    ck.save(1, _state(1)).wait()
    step = os.path.join(ck.roots[0], "step-00000001")
    return ck, step, json.loads(open(os.path.join(step, "manifest.json")).read())


def _rewrite(step: str, doc: dict) -> None:
    with open(os.path.join(step, "manifest.json"), "w") as f:
        json.dump(doc, f)


def _big_extent(doc: dict) -> tuple[dict, dict]:
    storages = doc["objects"]["replicated"]["storages"]
    s = max(storages, key=lambda s: s["nbytes"])
    return s, s["extents"][0]


def _data_path(ck, doc: dict, index: int) -> str:
    f = doc["files"][index]
    return os.path.join(ck.roots[f["root"]], "step-00000001", f["name"])


def test_flipped_byte_names_file_and_storage(saved):
    ck, step, doc = saved
    s, e = _big_extent(doc)
    path = _data_path(ck, doc, e["file"])
    with open(path, "r+b") as f:
        f.seek(e["offset"] + 1000)
        b = f.read(1)
        f.seek(e["offset"] + 1000)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(fp.ChecksumMismatchError) as info:
        ck.load(1)
    msg = str(info.value)
    assert path in msg and f"storage {s['key']!r}" in msg and str(e["offset"]) in msg
    got = ck.load(1, verify=False)  # an explicit opt-out reads it anyway
    assert not _equal(got["big"], _state(1)["big"])


def test_missing_data_file(saved):
    ck, step, doc = saved
    _, e = _big_extent(doc)
    os.unlink(_data_path(ck, doc, e["file"]))
    with pytest.raises(fp.CorruptCheckpointError, match="missing"):
        ck.load(1)


def test_truncated_data_file(saved):
    ck, step, doc = saved
    _, e = _big_extent(doc)
    path = _data_path(ck, doc, e["file"])
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(fp.CorruptCheckpointError, match="truncated"):
        ck.load(1)


def test_newer_manifest_version(saved):
    ck, step, doc = saved
    doc["version"] = 99
    _rewrite(step, doc)
    with pytest.raises(fp.UnsupportedFormatError, match="version 99.*upgrade"):
        ck.load(1)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d, s, e: d["files"][e["file"]].update(name="../../etc/passwd"), "not a plain file name"),
        (lambda d, s, e: d["files"][e["file"]].update(name="/etc/passwd"), "not a plain file name"),
        (lambda d, s, e: d["files"][e["file"]].update(root=7), "root index 7"),
        (lambda d, s, e: e.update(start=e["start"] + 8), "hole"),
        (lambda d, s, e: s["extents"].append(dict(e)), "overlap"),
        (lambda d, s, e: s.update(nbytes=s["nbytes"] + 1), "cover"),
        (lambda d, s, e: e.update(offset=10**12), "beyond the end"),
        (lambda d, s, e: e.update(checksum="xyz"), "16 hex digits"),
        (lambda d, s, e: e.update(file=99), "file index 99"),
        (lambda d, s, e: d.pop("objects"), "missing field 'objects'"),
    ],
)
def test_edited_manifest_is_refused(saved, edit, message):
    ck, step, doc = saved
    s, e = _big_extent(doc)
    edit(doc, s, e)
    _rewrite(step, doc)
    with pytest.raises(fp.CorruptCheckpointError, match=message) as info:
        ck.load(1)
    assert "manifest.json" in str(info.value)


def test_overlapping_file_ranges_are_refused(saved):
    ck, step, doc = saved
    storages = [s for s in doc["objects"]["replicated"]["storages"] if s["extents"]]
    a, b = storages[0]["extents"][0], storages[1]["extents"][0]
    b["file"], b["offset"] = a["file"], a["offset"]
    _rewrite(step, doc)
    with pytest.raises(fp.CorruptCheckpointError, match="overlaps"):
        ck.load(1)


def test_not_a_checkpoint(tmp_path):
    d = tmp_path / "step-00000001"
    d.mkdir()
    (d / "manifest.json").write_text('{"hello": 1}')
    with pytest.raises(fp.CorruptCheckpointError, match="not a fastpersist manifest"):
        load_checkpoint(str(d))
    with pytest.raises(fp.CheckpointNotFoundError):
        load_checkpoint(str(tmp_path / "nothing"))
    with pytest.raises(fp.CheckpointNotFoundError):
        Checkpointer(str(tmp_path / "empty")).load()


def test_skeleton_that_runs_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save(1, {"x": Evil()}).wait()
    with pytest.raises(fp.CheckpointReadError, match="weights-only"):
        ck.load(1)


def test_manifest_parse_is_strict_on_raw_garbage():
    with pytest.raises(fp.CorruptCheckpointError, match="not valid JSON"):
        mf.parse("m.json", b"\x00\x01")


def test_skeleton_pickle_is_byte_identical_to_torch_save():
    """fastpersist's lean pickler must write exactly the pickle torch.save writes."""
    import io
    import zipfile

    from fastpersist.format import skeleton

    x = torch.randn(10)
    cases = [
        _state(5),
        torch.nn.Linear(3, 4).state_dict(),
        {"u16": torch.ones(3, dtype=torch.uint16), "storage": torch.ones(3).untyped_storage(),
         "param": torch.nn.Parameter(torch.ones(2)), "grad": torch.ones(2, requires_grad=True),
         "views": [x, x[2:5], x.view(2, 5).t()], "tuple": (1, 2.5, True, None, "s")},
    ]
    for obj in cases:
        records, keys, storages = skeleton.serialize(obj)
        buf = io.BytesIO()
        torch.save(obj, buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
            data = sorted(n.split("/data/")[1] for n in z.namelist() if "/data/" in n)
        assert records["data.pkl"] == pkl
        assert sorted(keys) == data and len(storages) == len(keys)


@pytest.mark.parametrize("mode", ["snapshot", "overlap"])
def test_captured_state_keeps_tensor_kinds(tmp_path, mode):
    ck = Checkpointer(str(tmp_path / "ck"), mode=mode)
    p = torch.nn.Parameter(torch.randn(5))
    g = torch.randn(4, requires_grad=True)
    base = torch.randn(6)
    ck.save(1, {"p": p, "g": g, "v": base[1:4], "b": base}).wait()
    got = ck.load(1, weights_only=False)
    assert isinstance(got["p"], torch.nn.Parameter) and torch.equal(got["p"], p)
    assert got["g"].requires_grad and torch.equal(got["g"], g)
    assert got["v"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()


class _Pair(collections.namedtuple("_Pair", "weight count")):
    pass


class _Tagged(list):
    pass


class _Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize("mode", ["sync", "snapshot", "overlap"])
def test_every_mode_saves_what_torch_save_would(tmp_path, mode):
    """Whatever the mode, a checkpoint loads as torch.save's copy of the state at save() would:
    namedtuples, list subclasses, tensors with attributes, a module's state_dict with its
    ``_metadata`` (nested, beside a module replaced by its state_dict), torch.Size, enums and
    numpy scalars keep their types and attributes, even where training changes them after
    save() returns; other mappings (a defaultdict with a lambda, a mappingproxy) are saved as
    dicts, in every mode."""
    try:
        import numpy as np
        scalar: object = np.float64(1.5)  # a float subclass without attributes: immutable
    except ImportError:  # numpy is not among the test requirements
        scalar = 1.5
    tagged = torch.arange(4.0)
    tagged.note = "kept"  # type: ignore[attr-defined]
    bn = torch.nn.BatchNorm1d(3)
    dd: collections.defaultdict[str, list[int]] = collections.defaultdict(lambda: [], {"a": [1]})
    marked = torch.ones(2)  # torch.compile marks optimizer state so; the capture copies the marks
    marked._dynamo_static_input_type = "guarded"  # type: ignore[attr-defined]
    state = {
        "pair": _Pair(torch.ones(3), 2), "dd": dd, "tagged_list": _Tagged([torch.zeros(2), 5]),
        "tagged": tagged, "bn_sd": bn.state_dict(), "inner": {"module": torch.nn.Linear(2, 2), "sd": bn.state_dict()},
        "size": torch.Size([2, 3]), "color": _Color.RED, "np": scalar,
        "proxy": types.MappingProxyType({"k": 1}), "marked": marked,
    }
    buf = io.BytesIO()
    torch.save(to_saveable(state), buf)
    buf.seek(0)
    expected = torch.load(buf, weights_only=False)
    with Checkpointer(str(tmp_path / "ck"), mode=mode) as ck:
        handle = ck.save(1, state)
        tagged.note = "changed"  # type: ignore[attr-defined]
        dd["b"].append(2)
        state["tagged_list"].append(6)
        handle.wait()
        got = ck.load(1, weights_only=False)
    for key, want in expected.items():
        have = got[key]
        assert type(have) is type(want), key
    assert got["tagged"].note == "kept" and torch.equal(got["tagged"], torch.arange(4.0))
    assert type(got["dd"]) is dict and got["dd"] == {"a": [1]}  # other mappings are saved as dicts
    assert type(got["proxy"]) is dict and got["proxy"] == {"k": 1}
    assert got["tagged_list"][1:] == [5]
    assert got["pair"].count == 2 and torch.equal(got["pair"].weight, torch.ones(3))
    for sd in (got["bn_sd"], got["inner"]["sd"]):
        assert sd._metadata == bn.state_dict()._metadata
    assert type(got["inner"]["module"]) is type(expected["inner"]["module"])
    assert got["size"] == torch.Size([2, 3]) and got["color"] is _Color.RED and got["np"] == 1.5
    assert got["marked"]._dynamo_static_input_type == "guarded"
