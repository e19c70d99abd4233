"""Pure parts of sharded state: who writes which bytes (dtensor.assign) and the strict reading
of version-3 manifests (tensor index, chunks that must tile their tensor)."""

from __future__ import annotations

import json

import pytest

from fastpersist.objects.dtensor import SPLIT_MIN, ChunkMeta, assign
from fastpersist.errors import CheckpointWriteError, CorruptCheckpointError
from fastpersist.format import manifest as mf


def _meta(path, shape, offsets, sizes, dtype="float32"):
    return ChunkMeta(tuple(path), dtype, tuple(shape), tuple(offsets), tuple(sizes))


def test_a_replicated_shard_is_written_once_split_over_its_holders():
    rows = 4096  # 4096 x 256 x 4 bytes = 4 MiB per shard
    s0 = _meta(["w"], [2 * rows, 256], [0, 0], [rows, 256])
    s1 = _meta(["w"], [2 * rows, 256], [rows, 0], [rows, 256])
    # a 2x2 mesh (Replicate, Shard(0)): ranks 0, 2 hold shard 0; ranks 1, 3 hold shard 1
    layout = assign([[s0], [s1], [s0], [s1]])
    assert layout.chunks == [s0, s1]
    by_rank = {r: sum(p.nbytes for p in layout.pieces if p.rank == r) for r in range(4)}
    assert by_rank == {r: s0.nbytes // 2 for r in range(4)}
    for c in (0, 1):
        spans = sorted((p.start, p.start + p.nbytes) for p in layout.pieces if p.chunk == c)
        assert spans[0][0] == 0 and spans[-1][1] == s0.nbytes and spans[0][1] == spans[1][0]
        assert all(a % 4096 == 0 for a, _ in spans)


def test_small_chunks_go_whole_to_the_least_loaded_holder():
    metas = [_meta([f"b{i}"], [10], [0], [10]) for i in range(6)]
    layout = assign([metas, metas, metas])
    assert all(p.start == 0 and p.nbytes == 40 for p in layout.pieces)
    assert sorted(p.rank for p in layout.pieces) == [0, 0, 1, 1, 2, 2]
    assert SPLIT_MIN > 40


def test_ranks_disagreeing_on_a_global_shape_fail():
    with pytest.raises(CheckpointWriteError, match=r"sharded tensor 'w'.*rank 0.*\[8\].*rank 1.*\[9\]"):
        assign([[_meta(["w"], [8], [0], [4])], [_meta(["w"], [9], [4], [5])]])


def test_chunks_that_do_not_partition_their_tensor_fail():
    with pytest.raises(CheckpointWriteError, match=r"'w'.*overlap.*do not partition"):
        assign([[_meta(["w"], [8], [0], [4])], [_meta(["w"], [8], [2], [4])]])
    with pytest.raises(CheckpointWriteError, match=r"'w'.*missing.*do not partition"):
        assign([[_meta(["w"], [8], [0], [4])], [_meta(["w"], [8], [0], [4])]])


# ---- manifest version 3


def _doc(**over):
    chunk = lambda off, n, file_off: {"offsets": [off, 0], "sizes": [n, 4],  # noqa: E731
                                      "extents": [{"file": 1, "offset": file_off, "start": 0, "nbytes": n * 16,
                                                   "checksum": "0" * 16}]}
    doc = {
        "format": mf.FORMAT_NAME, "version": 3, "hash": "xxh3-64", "step": 1, "save_id": "abc", "created": 1.0,
        "world_size": 2, "roots": 1, "sequence": 1, "user": {}, "root_paths": ["/r0"],
        "files": [{"root": 0, "name": "a.skel", "size": 10}, {"root": 0, "name": "a.bin", "size": 4096}],
        "objects": {"replicated": {
            "skeleton": {"file": 0, "offset": 0, "start": 0, "nbytes": 10, "checksum": "0" * 16},
            "storages": [{"key": "0", "nbytes": 64, "extents": [
                {"file": 1, "offset": 1024, "start": 0, "nbytes": 64, "checksum": "0" * 16}]}],
            "tensors": [{"path": ["step"], "dtype": "int64", "shape": [], "stride": [], "storage": "0", "offset": 7}],
        }},
        "sharded": [{"path": ["model", "w"], "dtype": "float32", "shape": [6, 4],
                     "chunks": [chunk(0, 3, 0), chunk(3, 3, 256)]}],
    }
    doc.update(over)
    return doc


def _parse(doc):
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return mf.parse("/r0/step-1/manifest.json", mf.seal(body))


def test_a_valid_version_3_manifest_round_trips():
    m = _parse(_doc())
    assert m.sharded[0].key == "model.w" and m.sharded[0].nbytes == 96
    assert m.objects["replicated"].tensors[0].key == "step"
    again = mf.parse("x", m.to_json())
    assert again == m


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["sharded"][0]["chunks"][1]["offsets"].__setitem__(0, 2), "overlap"),
    (lambda d: d["sharded"][0]["chunks"].pop(), "missing"),
    (lambda d: d["sharded"][0]["chunks"][1]["sizes"].__setitem__(0, 4), "exceeds the tensor's global shape"),
    (lambda d: d["sharded"][0].__setitem__("dtype", "float33"), "unknown dtype"),
    (lambda d: d["sharded"][0]["chunks"][0]["extents"][0].__setitem__("nbytes", 40), "extents cover 40"),
    (lambda d: d["sharded"][0]["chunks"][1]["extents"][0].__setitem__("offset", 10), "overlaps"),
    (lambda d: d["sharded"].append(json.loads(json.dumps(d["sharded"][0]))), "listed twice"),
    (lambda d: d["objects"]["replicated"]["tensors"][0].__setitem__("offset", 8), "lies beyond storage"),
    (lambda d: d["objects"]["replicated"]["tensors"][0].__setitem__("storage", "5"), "is not listed"),
    (lambda d: d["objects"]["replicated"]["tensors"][0].__setitem__("path", [1.5]), "strings or integers"),
    (lambda d: d.__setitem__("root_paths", ["relative"]), "absolute path"),
])
def test_damaged_version_3_fields_are_named(edit, message):
    doc = _doc()
    edit(doc)
    with pytest.raises(CorruptCheckpointError, match=message):
        _parse(doc)


def test_errors_name_the_tensor_key():
    doc = _doc()
    doc["sharded"][0]["chunks"].pop()
    with pytest.raises(CorruptCheckpointError, match="sharded tensor 'model.w'"):
        _parse(doc)


def test_plain_states_do_not_import_dtensor(tmp_path):
    """torch.distributed.tensor costs most of a second to import: a state without DTensors
    (so without that module loaded) never pays it, at save or load."""
    import subprocess
    import sys

    code = (
        "import sys, torch, fastpersist as fp\n"
        f"c = fp.Checkpointer([{str(tmp_path / 'r')!r}], mode='sync')\n"
        "c.save(1, {'w': torch.ones(3)}); c.close()\n"
        f"fp.open([{str(tmp_path / 'r')!r}]).load(1)\n"
        "print('torch.distributed.tensor' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
