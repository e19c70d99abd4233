"""Hostile and damaged checkpoints (issue 14): one named test per class of failure seen.

Each test runs the reader in a child process (tests/fuzz/harness.py) with a memory limit and a
timeout, so a reader that blocks, loops or allocates without bound fails the test instead of
hanging or killing the suite. The promise checked everywhere: a damaged or hostile checkpoint
either loads exactly what was saved, or raises a CheckpointError naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

import fastpersist as fp
from fastpersist.format import manifest as mf
from fuzz import build, probes
from fuzz.harness import run_isolated


def _sharded(tmp_path) -> tuple[list[str], dict]:
    roots = build.save_sharded(str(tmp_path))
    return roots, build.read_doc(roots)


def _single(tmp_path) -> str:
    return build.save_single(str(tmp_path / "model.pt"))


def _target(roots: list[str], doc: dict, which: str) -> str:
    """The path of one kind of file of the sharded checkpoint."""
    if which == "manifest":
        return build.manifest_path(roots)
    if which == "skeleton":
        return build.skeleton_path(roots, doc)
    if which == "latest":
        return os.path.join(roots[0], "latest")
    big = max(doc["objects"]["replicated"]["storages"], key=lambda s: s["nbytes"])
    return build.file_of(roots, doc, big["extents"][0]["file"])


def _exact_or_refused(outcome, *names: str) -> None:
    if outcome.kind != "value":
        _refused(outcome, *names)
    else:
        assert outcome.value == "exact", str(outcome)


def _refused(outcome, *names: str) -> None:
    assert outcome.kind == "checkpoint_error", str(outcome)
    assert any(n in outcome.message for n in names), outcome.message


# ---- 1. readers never block, loop or over-allocate ----------------------------------------


@pytest.mark.parametrize("which", ["manifest", "skeleton", "data"])
def test_fifo_in_place_of_a_file_is_refused_at_once(tmp_path, which):
    """A FIFO in place of a checkpoint file blocked open() forever."""
    roots, doc = _sharded(tmp_path)
    path = _target(roots, doc, which)
    os.unlink(path)
    os.mkfifo(path)
    outcome = run_isolated(probes.load_step, roots, timeout_s=20)
    _refused(outcome, path)
    assert "FIFO" in outcome.message
    problems = run_isolated(probes.verify_sharded, roots, timeout_s=20)
    assert problems.kind == "value" and any("FIFO" in p for p in problems.value), str(problems)


def test_fifo_as_latest_falls_back_without_blocking(tmp_path):
    """A FIFO as `latest` blocked the reader; it is ignored (and logged) like any damaged pointer."""
    roots, doc = _sharded(tmp_path)
    latest = _target(roots, doc, "latest")
    os.unlink(latest)
    os.mkfifo(latest)
    outcome = run_isolated(probes.load_sharded, roots, timeout_s=20)
    assert outcome.kind == "value" and outcome.value == "exact", str(outcome)


def test_fifo_as_single_file_is_refused_at_once(tmp_path):
    path = str(tmp_path / "model.pt")
    os.mkfifo(path)
    _refused(run_isolated(probes.load_single, path, timeout_s=20), "FIFO")


def _sysfs_file() -> str:
    for p in ("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/kernel/profiling", "/sys/power/state"):
        if os.path.isfile(p) and os.stat(p).st_size >= 4096:
            return p
    pytest.skip("no sysfs file of 4096 bytes here")


def test_reads_that_return_nothing_end_as_truncation(tmp_path):
    """A skeleton pointing at a file whose reads return fewer bytes than its size (sysfs) made
    verify loop forever. Inside a checkpoint such a file can only come through a link, which
    is refused; named by the caller, the short read is truncation."""
    sysfs = _sysfs_file()
    roots, doc = _sharded(tmp_path)
    path = build.skeleton_path(roots, doc)
    os.unlink(path)
    os.symlink(sysfs, path)
    outcome = run_isolated(probes.verify_sharded, roots, timeout_s=20)
    assert outcome.kind == "value" and any("symbolic link" in p for p in outcome.value), str(outcome)
    single = run_isolated(probes.load_single, sysfs, timeout_s=20)
    assert single.kind == "checkpoint_error", str(single)
    from fastpersist.io.files import read_exact

    fd = os.open(sysfs, os.O_RDONLY)
    try:
        with pytest.raises(fp.CorruptCheckpointError, match="truncated"):
            read_exact(fd, sysfs, 0, 4096)
    finally:
        os.close(fd)


@pytest.mark.parametrize("which", ["manifest", "skeleton", "latest"])
def test_huge_sparse_metadata_is_refused_before_reading(tmp_path, which):
    """An 8 GiB sparse manifest, skeleton or `latest` was read whole until memory ran out."""
    roots, doc = _sharded(tmp_path)
    path = _target(roots, doc, which)
    os.truncate(path, 8 << 30)
    probe = probes.load_sharded if which == "latest" else probes.load_step
    outcome = run_isolated(probe, roots, timeout_s=30, memory_bytes=1 << 30)
    if which == "latest":
        assert outcome.kind == "value" and outcome.value == "exact", str(outcome)
    else:
        _refused(outcome, path)


@pytest.mark.parametrize("which", ["manifest", "skeleton", "latest"])
def test_dev_zero_as_metadata_is_refused(tmp_path, which):
    """/dev/zero (here: a link to it inside the checkpoint) was read until memory ran out."""
    roots, doc = _sharded(tmp_path)
    path = _target(roots, doc, which)
    os.unlink(path)
    os.symlink("/dev/zero", path)
    probe = probes.load_sharded if which == "latest" else probes.load_step
    outcome = run_isolated(probe, roots, timeout_s=30, memory_bytes=1 << 30)
    if which == "latest":
        assert outcome.kind == "value" and outcome.value == "exact", str(outcome)
    else:
        _refused(outcome, path)


def test_manifest_claiming_a_huge_storage_is_refused_before_allocating(tmp_path):
    """A manifest claiming a 5 GiB storage made load allocate it before checking any file size."""
    roots, doc = _sharded(tmp_path)
    ends = {i: f["size"] for i, f in enumerate(doc["files"])}
    s = next(s for s in doc["objects"]["replicated"]["storages"]
             if s["extents"] and s["extents"][-1]["offset"] + s["extents"][-1]["nbytes"] == ends[s["extents"][-1]["file"]])
    e = s["extents"][-1]
    grow = 5 << 30
    e["nbytes"] += grow
    s["nbytes"] += grow
    doc["files"][e["file"]]["size"] += grow
    build.write_doc(roots, doc)  # resealed: the claim passes the manifest's own checksum
    outcome = run_isolated(probes.load_step, roots, timeout_s=30, memory_bytes=1 << 30)
    _refused(outcome, "truncated", "needs")


def test_zip_directory_with_repeated_records_is_refused(tmp_path):
    """3,000 directory entries pointing at one 2 MiB record were copied once per entry."""
    pickle_bytes = fp_pickle({"s": "x" * (2 << 20)})
    members = [("archive/data.pkl", pickle_bytes), ("archive/byteorder", b"little")]
    raw = bytearray(build.zip_bytes(members))
    entries = build.central_entries(bytes(raw))
    cd_start = entries[0][0]
    entry = bytes(raw[cd_start : entries[1][0]])
    eocd = build.eocd_offset(bytes(raw))
    count, cd_size = struct.unpack_from("<HI", raw, eocd + 10)
    new_cd = bytes(raw[cd_start:eocd]) + _renamed_copies(entry, 3000)
    out = bytes(raw[:cd_start]) + new_cd + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count + 3000,
                                                        count + 3000, len(new_cd), cd_start, 0)
    path = str(tmp_path / "repeat.pt")
    with open(path, "wb") as f:
        f.write(out)
    _refused(run_isolated(probes.load_single, path, False, timeout_s=30, memory_bytes=1 << 30), path)


def _renamed_copies(entry: bytes, n: int) -> bytes:
    """``n`` copies of a central directory entry, each under a new 16-byte name, same offset."""
    out = bytearray()
    for i in range(n):
        name = b"archive/d%07d" % i
        head = bytearray(entry[:46])
        struct.pack_into("<H", head, 28, len(name))
        out += head + name
    return bytes(out)


def fp_pickle(obj: object) -> bytes:
    import pickle

    return pickle.dumps(obj, protocol=2)


def test_compressed_skeleton_member_is_refused_not_inflated(tmp_path):
    """A skeleton member compressed 1,000:1 was inflated whole (to 5 GiB)."""
    roots, doc = _sharded(tmp_path)
    inflated = 1536 << 20
    bomb = build.deflate_bomb(inflated)
    raw = build.zip_bytes([("data.pkl", b""), ("byteorder", b"little")], method=8,
                          raw_data={"data.pkl": bomb}, sizes={"data.pkl": inflated})
    build.replace_skeleton(roots, raw)
    outcome = run_isolated(probes.load_step, roots, timeout_s=60, memory_bytes=1 << 30)
    _refused(outcome, "compressed")


# ---- 2. symlinks ----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["manifest", "skeleton", "data"])
def test_symlink_inside_a_checkpoint_is_refused(tmp_path, which):
    """Links planted in a checkpoint were followed (to /etc/passwd, /proc/<pid>/mem, sysfs...).
    Here the link leads to a faithful copy outside the checkpoint: refused all the same."""
    roots, doc = _sharded(tmp_path)
    path = _target(roots, doc, which)
    outside = str(tmp_path / "outside.bin")
    shutil.move(path, outside)
    os.symlink(outside, path)
    outcome = run_isolated(probes.load_step, roots, timeout_s=20)
    _refused(outcome, "symbolic link")
    assert path in outcome.message


@pytest.mark.parametrize("target", ["/etc/passwd", "/proc/self/mem", "/proc/self/environ"])
def test_symlink_to_system_files_is_never_read(tmp_path, target):
    roots, doc = _sharded(tmp_path)
    path = _target(roots, doc, "data")
    os.unlink(path)
    os.symlink(target, path)
    _refused(run_isolated(probes.load_step, roots, timeout_s=20), "symbolic link")


def test_linked_step_directory_is_not_a_checkpoint_of_the_root(tmp_path):
    """A step directory planted as a link inside a root (here to a real checkpoint elsewhere,
    named by `latest`) is neither listed nor used as `latest`."""
    from fastpersist.storage import catalog

    roots, doc = _sharded(tmp_path)
    os.symlink(os.path.join(roots[0], build.STEP), os.path.join(roots[0], "step-00000002"))
    with open(os.path.join(roots[0], "latest"), "w") as f:
        f.write("step-00000002\n")
    assert [e.step for e in catalog.scan(roots[0])] == [1]
    assert catalog.read_latest(roots[0]) == 1


def test_single_file_named_through_a_link_is_followed(tmp_path):
    """The policy: links the caller names (a single file, roots) are the caller's and followed."""
    real = _single(tmp_path)
    link = str(tmp_path / "link.pt")
    os.symlink(real, link)
    assert run_isolated(probes.load_single, link).value == "exact"


# ---- 3. verification cannot be switched off by the file ---------------------------------------


def _drop_checksum_record(path: str, how: str) -> None:
    raw = open(path, "rb").read()
    if how == "renamed":
        for pos in (raw.find(b"archive/.fastpersist"), raw.rfind(b"archive/.fastpersist")):
            build.patch(path, pos, b"archive/.fastpersisX")
        return
    entries = build.central_entries(raw)
    names = [n for _, n in entries]
    k = names.index("archive/.fastpersist")
    start = entries[k][0]
    end = entries[k + 1][0] if k + 1 < len(entries) else raw.find(b"PK\x06\x06", start)
    cut = raw[:start] + raw[end:]
    # fix the record counts and directory size in the zip64 and classic end records
    z64 = cut.rfind(b"PK\x06\x06")
    z = bytearray(cut)
    n64, cd64 = struct.unpack_from("<QQ", z, z64 + 24)[0], struct.unpack_from("<Q", z, z64 + 40)[0]
    struct.pack_into("<QQQ", z, z64 + 24, n64 - 1, n64 - 1, cd64 - (end - start))
    struct.pack_into("<Q", z, z.rfind(b"PK\x06\x07") + 8, z64)
    eocd = z.rfind(b"PK\x05\x06")
    n, _, cd = struct.unpack_from("<HHI", z, eocd + 8)
    struct.pack_into("<HHI", z, eocd + 8, n - 1, n - 1, cd - (end - start))
    with open(path, "wb") as f:
        f.write(bytes(z))


@pytest.mark.parametrize("how", ["removed", "renamed"])
def test_single_file_without_its_checksum_record_is_unverified(tmp_path, how):
    """Removing or renaming `.fastpersist` made the file load unverified: a flipped data byte
    came back silently and `verify` said every record matched."""
    path = _single(tmp_path)
    data = build.records(path)["data/0"]
    build.flip(path, data.offset + 5)
    _drop_checksum_record(path, how)
    outcome = run_isolated(probes.load_single, path)
    assert outcome.kind == "checkpoint_error" and outcome.error_type == "UnverifiedCheckpointError", str(outcome)
    assert path in outcome.message
    code, out = run_isolated(probes.cli_verify, [path]).value
    assert code == 1 and "carries no checksums" in out
    assert run_isolated(probes.load_single, path, False).value == "different"  # only an explicit opt-out


def test_crc32_of_a_plain_torch_save_file_is_checked(tmp_path):
    """A flipped data byte in a plain torch.save file loaded silently."""
    import torch

    path = str(tmp_path / "plain.pt")
    torch.save(build.reference_state(), path)
    assert run_isolated(probes.load_single, path).value == "exact"
    build.flip(path, build.records(path)["data/0"].offset + 3)
    outcome = run_isolated(probes.load_single, path)
    assert outcome.error_type == "ChecksumMismatchError" and "CRC-32" in outcome.message, str(outcome)


def _swap_equal_storages(doc: dict, field: str) -> None:
    storages = doc["objects"]["replicated"]["storages"]
    by_size: dict[int, list[dict]] = {}
    for s in storages:
        by_size.setdefault(s["nbytes"], []).append(s)
    a, b = next(v for n, v in by_size.items() if len(v) >= 2 and n)[:2]
    a[field], b[field] = b[field], a[field]


@pytest.mark.parametrize("reseal", [False, True], ids=["stale-checksum", "resealed"])
def test_swapped_storage_keys_are_refused_by_load_and_verify(tmp_path, reseal):
    """Swapping the `key` fields of two equal-size storages loaded the tensors swapped, and
    verify said OK."""
    roots, doc = _sharded(tmp_path)
    _swap_equal_storages(doc, "key")
    build.write_doc(roots, doc, reseal=reseal)
    _refused(run_isolated(probes.load_step, roots), "manifest.json")
    code, out = run_isolated(probes.cli_verify, [os.path.join(roots[0], build.STEP), "--root", roots[1]]).value
    assert code == 1 and "FAILED" in out


def test_manifest_checksum_catches_an_edit_nothing_else_would(tmp_path):
    """Swapping the extents of two equal-size storages keeps every extent checksum right; only
    the manifest's checksum of its own content sees it."""
    roots, doc = _sharded(tmp_path)
    _swap_equal_storages(doc, "extents")
    build.write_doc(roots, doc, reseal=False)
    outcome = run_isolated(probes.load_step, roots)
    assert outcome.error_type == "ChecksumMismatchError" and "own checksum" in outcome.message, str(outcome)


def test_version_1_manifest_is_unverified_unless_asked(tmp_path):
    """A manifest without its own checksum (format version 1) cannot switch verification off:
    verify=True refuses it; verify=False reads it."""
    roots, doc = _sharded(tmp_path)
    doc["version"] = 1
    doc.pop("manifest_checksum")
    with open(build.manifest_path(roots), "w") as f:
        f.write(json.dumps(doc, sort_keys=True, separators=(",", ":")))
    step = os.path.join(roots[0], build.STEP)
    with pytest.raises(fp.errors.UnverifiedCheckpointError, match="version 1"):
        fp.load_checkpoint(step, roots[1:])
    assert build.equal(fp.load_checkpoint(step, roots[1:], verify=False), build.reference_state())


# ---- 4. one verify, the same checks as load ------------------------------------------------


def _unknown_key(roots: list[str], doc: dict) -> None:
    doc["objects"]["replicated"]["storages"][-1]["key"] = "999"
    build.write_doc(roots, doc)


def _loop(roots: list[str], doc: dict) -> None:
    path = _target(roots, doc, "data")
    os.unlink(path)
    os.symlink(os.path.basename(path), path)  # ELOOP


def _directory(roots: list[str], doc: dict) -> None:
    path = _target(roots, doc, "skeleton")
    os.unlink(path)
    os.mkdir(path)  # EISDIR


def _not_a_directory(roots: list[str], doc: dict) -> None:
    step = os.path.join(roots[1], build.STEP)
    shutil.rmtree(step)
    open(step, "w").close()  # ENOTDIR for every file of the second root


def _flipped(roots: list[str], doc: dict) -> None:
    s = max(doc["objects"]["replicated"]["storages"], key=lambda s: s["nbytes"])
    build.flip(build.file_of(roots, doc, s["extents"][0]["file"]), s["extents"][0]["offset"] + 9)


@pytest.mark.parametrize("damage", [_unknown_key, _loop, _directory, _not_a_directory, _flipped],
                         ids=["unknown-key", "ELOOP", "EISDIR", "ENOTDIR", "flipped-byte"])
def test_verify_agrees_with_load(tmp_path, damage):
    """verify passed a storage key the skeleton does not know, and ended in a traceback on
    ELOOP, EISDIR and ENOTDIR; now both run the same checks: load raises, verify reports (exit 1)."""
    roots, doc = _sharded(tmp_path)
    damage(roots, doc)
    _refused(run_isolated(probes.load_step, roots), str(tmp_path))
    outcome = run_isolated(probes.cli_verify, [os.path.join(roots[0], build.STEP), "--root", roots[1]])
    assert outcome.kind == "value", str(outcome)
    code, out = outcome.value
    assert code == 1 and "FAILED" in out and "Traceback" not in out, out


# ---- 5. every failure is a CheckpointError naming the file -----------------------------------


def _z64_offsets(path: str, value: int) -> None:
    raw = open(path, "rb").read()
    build.patch(path, raw.rfind(b"PK\x06\x06") + 48, struct.pack("<Q", value))


@pytest.mark.parametrize("edit", [
    lambda p: _z64_offsets(p, 2**64 - 1),
    lambda p: _z64_offsets(p, 2**63),
    lambda p: _z64_offsets(p, struct.unpack_from("<Q", open(p, "rb").read(), open(p, "rb").read().rfind(b"PK\x06\x06") + 48)[0] + 4096),
], ids=["zip64-offset-2^64-1", "zip64-offset-2^63", "negative-record-offsets"])
def test_damaged_end_of_directory_is_a_checkpoint_error(tmp_path, edit):
    """Damaged end-of-archive records raised OSError (EINVAL: a negative offset) or OverflowError."""
    path = _single(tmp_path)
    edit(path)
    _exact_or_refused(run_isolated(probes.load_single, path), path)


@pytest.mark.parametrize("value", ["Infinity", "NaN", "1e400", "1" + "0" * 400, "-1", "[" * 100_000 + "]" * 100_000],
                         ids=["Infinity", "NaN", "1e400", "10^400", "negative", "nested-100000"])
def test_hostile_json_values_are_checkpoint_errors(tmp_path, value):
    """`"version": Infinity` (OverflowError), a timestamp of 10^400 (OverflowError), deeply
    nested JSON (RecursionError): in the manifest and in a single file's checksum record."""
    roots, doc = _sharded(tmp_path)
    doc["created"] = "@hostile@"
    build.write_doc(roots, doc, raw_values={"@hostile@": value})
    _refused(run_isolated(probes.load_step, roots), "manifest.json")
    path = _single(tmp_path)
    rec = build.records(path)[".fastpersist"]
    raw = open(path, "rb").read()[rec.offset : rec.offset + rec.nbytes]
    hostile = raw.replace(b'"version":1', b'"version":' + value.encode())
    if len(hostile) <= rec.nbytes:
        build.patch(path, rec.offset, hostile.ljust(rec.nbytes))
        _refused(run_isolated(probes.load_single, path), path)


@pytest.mark.parametrize("record, data", [
    ("byteorder", b"middle"),
    (".storage_alignment", b"abcd"),
    ("data.pkl", b"\x80\x02."),
    ("data.pkl", b"\x80\x02"),
    ("data.pkl", b"\x80\x02K\x01K\x02\x86\x85R."),
    ("data.pkl", b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(K\x01tR."),
], ids=["byteorder-ValueError", "storage-alignment-ValueError", "IndexError", "EOFError", "IndexError-in-reduce",
        "TypeError"])
def test_damaged_pickle_and_small_records_are_checkpoint_errors(tmp_path, record, data):
    """torch's own ValueError/EOFError/IndexError/TypeError from damaged pickles and small
    records escaped (verification off, so the damage reaches torch's loader). fastpersist
    writes no ``.storage_alignment`` (docs/FORMAT.md); torch.save's files, which it loads, do."""
    import torch

    path = _single(tmp_path)
    if record == ".storage_alignment":
        path = str(tmp_path / "torch.pt")
        torch.save({"w": torch.arange(4.0)}, path)
    rec = build.records(path)[record]
    build.patch(path, rec.offset, data[: rec.nbytes].ljust(rec.nbytes, b"." if record == "data.pkl" else b" "))
    _refused(run_isolated(probes.load_single, path, False), path)


def test_view_beyond_its_storage_is_a_checkpoint_error(tmp_path):
    """A skeleton whose tensor view lies beyond its storage: torch's RuntimeError, named."""
    import torch

    path = str(tmp_path / "view.pt")
    fp.save({"w": torch.arange(4.0)}, path)
    rec = build.records(path)["data.pkl"]
    raw = open(path, "rb").read()[rec.offset : rec.offset + rec.nbytes]
    assert raw.count(b"K\x04\x85") == 1
    build.patch(path, rec.offset + raw.index(b"K\x04\x85"), b"K\xc8\x85")  # size (4,) -> (200,)
    _refused(run_isolated(probes.load_single, path, False), path)


def test_names_accept_only_the_documented_ascii_pattern():
    """A file name ending in a newline passed the name check (``$`` matches before it)."""
    assert not mf.valid_file_name("data.bin\n")
    assert not any(mf.valid_file_name(n) for n in ("data\u0661.bin", "\u0660data.bin", "d\u00e9.bin", "a/b", ".."))


@pytest.mark.parametrize("name", ["step-00000001\n", "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661"])
def test_step_directories_accept_only_ascii_digits(name):
    from fastpersist.storage import catalog

    assert catalog.parse_step_dir(name) is None


@pytest.mark.parametrize("name", ["rank-00001\n", "rank-\u0660\u0660\u0660\u0660\u0661"], ids=["newline", "arabic-digits"])
def test_object_names_accept_only_the_pattern(tmp_path, name):
    """An object name ending in a newline or with non-ASCII digits passed (``\\d``, ``$``)."""
    roots, doc = _sharded(tmp_path)
    doc["objects"][name] = doc["objects"]["replicated"]
    build.write_doc(roots, doc)
    _refused(run_isolated(probes.load_step, roots), "unknown object name")


def test_code_execution_pickle_is_refused_with_integrity_intact(tmp_path):
    """A skeleton that would run code, with every checksum made to match: refused, nothing ran."""
    from fastpersist.format import skeleton

    marker = str(tmp_path / "ran")
    roots, doc = _sharded(tmp_path)
    build.replace_skeleton(roots, skeleton.encode({"data.pkl": build.evil_pickle(marker), "byteorder": b"little"}))
    doc = build.read_doc(roots)
    doc["objects"]["replicated"]["storages"] = []
    doc["objects"]["replicated"]["tensors"] = []  # the index would name the missing storage first
    build.write_doc(roots, doc)
    _refused(run_isolated(probes.load_step, roots), "weights-only")
    code, out = run_isolated(probes.cli_verify, [os.path.join(roots[0], build.STEP), "--root", roots[1]]).value
    assert code == 1 and "weights-only" in out
    single = str(tmp_path / "evil.pt")
    fp.save({"x": build._Evil(marker)}, single)  # every checksum right
    _refused(run_isolated(probes.load_single, single), "weights-only")
    assert not os.path.exists(marker)
