"""Seeded mutation fuzzing of both formats: make a damaged or hostile copy, load it in a child,
classify what happened.

Case ``i`` of format ``f`` under seed ``s`` is a pure function of ``(s, f, i)``: the mutation
and all its choices come from ``random.Random(f"{s}:{f}:{i}")``, so any case reproduces alone
(``python -m fuzz --format sharded --seed 14 --case 123``, run in tests/).

Outcomes (a case is one load, plus, for the sharded format, one verify of the same copy):

- ``exact``: loaded exactly the saved state (and verify found nothing);
- ``checkpoint_error``: a CheckpointError naming the checkpoint (and verify reported problems);
- ``crafted``: a *crafted* case (its checksums recomputed, as an attacker would) loaded a
  different, self-consistent checkpoint; not a failure, counted apart;
- failures: ``wrong`` (different data, integrity not recomputed), ``hang``, ``oom``, ``crash``,
  ``other`` (any other exception), ``unnamed`` (a CheckpointError not naming the checkpoint),
  ``disagree`` (load and verify disagree), ``code_ran`` (the pickle's code ran).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import struct
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from fuzz import build, probes
from fuzz.harness import Outcome, run_isolated

FAILURES = ("wrong", "hang", "oom", "crash", "other", "unnamed", "disagree", "code_ran")
HOSTILE_JSON = ["Infinity", "-Infinity", "NaN", "1e400", "-1", "18446744073709551616", "1" + "0" * 400,
                "9223372036854775807", "0", "1", "null", "true", '"x"', "[]", "{}", '"' + "A" * 100_000 + '"',
                "[" * 5000 + "]" * 5000, "0.5", '"../../etc/passwd"', '"step-00000001\\n"', '"\\u0661"']
_SYMLINK_TARGETS = ["/etc/passwd", "/dev/zero", "/proc/self/mem", "/proc/self/environ", "/sys/power/state",
                    "/", "/nonexistent", "@outside", "@self", "@other"]


@dataclass
class Case:
    fmt: str
    index: int
    mutation: str
    crafted: bool  # integrity recomputed: a different, self-consistent checkpoint is no failure
    where: str  # the case's directory
    target: Any  # the single file, or the roots
    marker: str  # created if a pickle's code runs


# ---- mutations shared by both formats -------------------------------------------------------


def _flip(rng: random.Random, path: str) -> str:
    size = os.path.getsize(path)
    if not size:
        return "empty"
    positions = [rng.randrange(size) for _ in range(rng.choice([1, 1, 2, 4, 8]))]
    for p in positions:
        build.flip(path, p, rng.randrange(1, 256))
    return f"flip {positions}"


def _truncate(rng: random.Random, path: str) -> str:
    size = rng.randrange(max(1, os.path.getsize(path)))
    os.truncate(path, size)
    return f"truncate to {size}"


def _zero(rng: random.Random, path: str) -> str:
    size = os.path.getsize(path)
    start = rng.randrange(max(1, size)) // 4096 * 4096 if rng.random() < 0.5 else rng.randrange(max(1, size))
    n = min(rng.choice([1, 16, 512, 4096]), max(0, size - start))
    build.patch(path, start, bytes(n))
    return f"zero {n} at {start}"


def _extend(rng: random.Random, path: str) -> str:
    with open(path, "ab") as f:
        f.write(rng.randbytes(rng.choice([1, 100, 5000])))
    return "extend"


def _special(rng: random.Random, path: str, where: str) -> str:
    """Replace ``path`` by something that is not a regular file."""
    kind = rng.choice(["fifo", "device", "directory", "sparse", "symlink"])
    if kind == "sparse":
        os.truncate(path, 8 << 30)
        return "sparse 8 GiB"
    outside = os.path.join(where, "outside-copy")
    if os.path.lexists(path) and not os.path.isdir(path):
        shutil.copyfile(path, outside)
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, rng.choice([3, 5, 8])))  # null, zero, random
        except PermissionError:
            os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        target = rng.choice(_SYMLINK_TARGETS)
        target = {"@outside": outside, "@self": os.path.basename(path), "@other": os.path.join(where, "nothing")}.get(
            target, target)
        os.symlink(target, path)
        kind = f"symlink to {target}"
    return kind


_BYTE_MUTATIONS: dict[str, Callable[[random.Random, str], str]] = {
    "flip": _flip, "truncate": _truncate, "zero": _zero, "extend": _extend,
}


# ---- the single file ------------------------------------------------------------------------


def _cd_field(rng: random.Random, path: str) -> str:
    raw = open(path, "rb").read()
    entries = build.central_entries(raw)
    pos, name = rng.choice(entries)
    fields = {"method": (10, "<H"), "crc": (16, "<I"), "csize": (20, "<I"), "usize": (24, "<I"),
              "nlen": (28, "<H"), "xlen": (30, "<H"), "header": (42, "<I")}
    field = rng.choice(sorted(fields))
    off, fmt = fields[field]
    top = 0xFFFF if fmt == "<H" else 0xFFFFFFFF
    old = struct.unpack_from(fmt, raw, pos + off)[0]
    value = rng.choice([0, 1, top, top - 1, old + 1, max(0, old - 1), old + 4096, len(raw), rng.randrange(top + 1)])
    build.patch(path, pos + off, struct.pack(fmt, min(value, top)))
    return f"{name} {field}={value}"


def _end_field(rng: random.Random, path: str) -> str:
    raw = open(path, "rb").read()
    z64, loc, eocd = raw.rfind(b"PK\x06\x06"), raw.rfind(b"PK\x06\x07"), build.eocd_offset(raw)
    choices = [(z64 + 24, "<Q"), (z64 + 32, "<Q"), (z64 + 40, "<Q"), (z64 + 48, "<Q"), (loc + 8, "<Q"),
               (eocd + 10, "<H"), (eocd + 12, "<I"), (eocd + 16, "<I"), (eocd + 20, "<H")]
    off, fmt = rng.choice([c for c in choices if c[0] >= 0])
    top = {"<H": 0xFFFF, "<I": 0xFFFFFFFF, "<Q": 2**64 - 1}[fmt]
    old = struct.unpack_from(fmt, raw, off)[0]
    value = rng.choice([0, 1, top, 2**63 if fmt == "<Q" else top, old + 1, max(0, old - 1), old + 4096,
                        max(0, old - 4096), len(raw)])
    build.patch(path, off, struct.pack(fmt, min(value, top)))
    return f"end record @{off}={value}"


def _repeat(rng: random.Random, path: str) -> str:
    """Many directory entries for one record (renamed or not)."""
    raw = open(path, "rb").read()
    entries = build.central_entries(raw)
    k = rng.randrange(len(entries))
    start = entries[k][0]
    end = entries[k + 1][0] if k + 1 < len(entries) else raw.rfind(b"PK\x06\x06")
    entry = raw[start:end]
    n = rng.choice([1, 10, 3000])
    copies = entry * n if rng.random() < 0.5 else _renamed(entry, n)
    cd = raw.find(b"PK\x01\x02")
    z64 = raw.rfind(b"PK\x06\x06")
    new = bytearray(raw[:z64] + copies + raw[z64:])
    z = z64 + len(copies)
    count, cd_size = struct.unpack_from("<QQ", new, z + 32)
    struct.pack_into("<QQQ", new, z + 24, count + n, count + n, cd_size + len(copies))
    struct.pack_into("<Q", new, new.rfind(b"PK\x06\x07") + 8, z)
    eocd = build.eocd_offset(bytes(new))
    struct.pack_into("<HH", new, eocd + 8, min(0xFFFF, count + n), min(0xFFFF, count + n))
    del cd
    with open(path, "wb") as f:
        f.write(bytes(new))
    return f"{n} more entries for {entries[k][1]}"


def _renamed(entry: bytes, n: int) -> bytes:
    nlen, xlen, clen = struct.unpack_from("<HHH", entry, 28)
    tail = entry[46 + nlen :]
    out = bytearray()
    for i in range(n):
        name = b"archive/r%07d" % i
        head = bytearray(entry[:46])
        struct.pack_into("<H", head, 28, len(name))
        out += head + name + tail
    return bytes(out)


def _drop_checksums(rng: random.Random, path: str) -> str:
    raw = open(path, "rb").read()
    for pos in (raw.find(b"archive/.fastpersist"), raw.rfind(b"archive/.fastpersist")):
        build.patch(path, pos, b"archive/.fastpersisT")
    if rng.random() < 0.7:
        data = [r for n, r in build.records(path).items() if n.startswith("data/") and r.nbytes]
        r = rng.choice(data)
        build.flip(path, r.offset + rng.randrange(r.nbytes))
        return "checksum record renamed, data byte flipped"
    return "checksum record renamed"


def _checksum_json(rng: random.Random, path: str) -> str:
    rec = build.records(path)[".fastpersist"]
    raw = open(path, "rb").read()[rec.offset : rec.offset + rec.nbytes]
    field = rng.choice([b'"version":1', b'"hash":"xxh3-64"', b'"format":"fastpersist-single-file"', b'"records":{'])
    value = rng.choice(HOSTILE_JSON[:15]).encode()
    key = field.split(b":")[0]
    new = raw.replace(field, key + b":" + value + (b",\"x\":{" if field.endswith(b"{") else b""), 1)
    if len(new) > rec.nbytes:
        new = b"[" * rec.nbytes
    build.patch(path, rec.offset, new.ljust(rec.nbytes))
    return f"checksum record {key.decode()} = {value[:20].decode()}"


def _compressed(rng: random.Random, path: str) -> str:
    raw = open(path, "rb").read()
    pos, name = rng.choice(build.central_entries(raw))
    build.patch(path, pos + 10, struct.pack("<H", 8))
    return f"{name} marked deflated"


def _recompute_digest(path: str, name: str) -> None:
    """Make ``.fastpersist`` agree with record ``name``'s current bytes (a crafted file)."""
    recs = build.records(path)
    raw = open(path, "rb").read()
    rec = recs[".fastpersist"]
    doc = json.loads(raw[rec.offset : rec.offset + rec.nbytes])
    r = recs[name]
    doc["records"][name] = f"{xxhash.xxh3_64_intdigest(raw[r.offset : r.offset + r.nbytes]):016x}"
    new = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    build.patch(path, rec.offset, new.ljust(rec.nbytes))


def _pickle_flip(rng: random.Random, path: str) -> str:
    r = build.records(path)["data.pkl"]
    positions = [r.offset + rng.randrange(r.nbytes) for _ in range(rng.choice([1, 2, 4]))]
    for p in positions:
        build.flip(path, p, rng.randrange(1, 256))
    _recompute_digest(path, "data.pkl")
    return f"data.pkl flipped at {positions}, digest recomputed"


def _single_bomb(rng: random.Random, path: str) -> str:
    size = rng.choice([64 << 20, 512 << 20, 1536 << 20])
    raw = build.zip_bytes([("archive/data.pkl", b""), ("archive/byteorder", b"little")], method=8,
                          raw_data={"archive/data.pkl": build.deflate_bomb(size)}, sizes={"archive/data.pkl": size})
    with open(path, "wb") as f:
        f.write(raw)
    return f"deflated data.pkl of {size} bytes"


def _single_evil(rng: random.Random, path: str, marker: str) -> str:
    import fastpersist as fp

    fp.save({"x": build._Evil(marker), "t": build.reference_state()["a"]}, path)
    return "code-running pickle, checksums right"


def _single_mutation(rng: random.Random, path: str, where: str, marker: str, plain: str) -> tuple[str, bool]:
    kind = rng.choices(
        ["flip", "truncate", "zero", "extend", "cd_field", "end_field", "repeat", "drop_checksums", "checksum_json",
         "compressed", "pickle_flip", "bomb", "evil", "special", "plain_torch"],
        weights=[16, 6, 6, 2, 14, 8, 4, 4, 4, 3, 6, 1, 2, 4, 6])[0]
    if kind in _BYTE_MUTATIONS:
        if rng.random() < 0.5:  # aim at the structure: the tail (directory) or a record's header
            raw = open(path, "rb").read()
            tail = len(raw) - rng.randrange(1, 800)
            build.flip(path, max(0, tail), rng.randrange(1, 256))
            return f"tail-flip: byte {max(0, tail)} (the zip directory's region)", False
        return f"{kind}: {_BYTE_MUTATIONS[kind](rng, path)}", False
    if kind == "plain_torch":
        shutil.copyfile(plain, path)
        mutate = rng.choice([_flip, _truncate, _zero, _cd_field])
        return f"plain torch.save file, {mutate(rng, path)}", False
    simple: dict[str, Callable[[random.Random, str], str]] = {
        "cd_field": _cd_field, "end_field": _end_field, "repeat": _repeat, "drop_checksums": _drop_checksums,
        "checksum_json": _checksum_json, "compressed": _compressed, "bomb": _single_bomb,
    }
    if kind in simple:
        return f"{kind}: {simple[kind](rng, path)}", False
    if kind == "pickle_flip":
        return f"{kind}: {_pickle_flip(rng, path)}", True
    if kind == "evil":
        return f"{kind}: {_single_evil(rng, path, marker)}", True
    return f"{kind}: {_special(rng, path, where)}", False


# ---- the sharded checkpoint -----------------------------------------------------------------


def _targets(roots: list[str]) -> dict[str, str]:
    doc = build.read_doc(roots)
    out = {"manifest": build.manifest_path(roots), "skeleton": build.skeleton_path(roots, doc),
           "latest": os.path.join(roots[0], "latest")}
    for i, f in enumerate(doc["files"]):
        if not f["name"].endswith(".skel"):
            out[f"data{i}"] = build.file_of(roots, doc, i)
    return out


def _json_paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _json_paths(v, prefix + (i,))
    return out


def _json_field(rng: random.Random, roots: list[str]) -> tuple[str, bool]:
    doc = build.read_doc(roots)
    doc.pop("manifest_checksum", None)
    path = rng.choice(_json_paths(doc))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    value = rng.choice(HOSTILE_JSON)
    parent[path[-1]] = "@hostile@"
    reseal = rng.random() < 0.7
    build.write_doc(roots, doc, reseal=reseal, raw_values={"@hostile@": value})
    return f"{'/'.join(map(str, path))} = {value[:24]}{' (resealed)' if reseal else ''}", reseal


def _json_swap(rng: random.Random, roots: list[str]) -> tuple[str, bool]:
    doc = build.read_doc(roots)
    storages = doc["objects"]["replicated"]["storages"]
    a, b = rng.sample(range(len(storages)), 2)
    field = rng.choice(["key", "extents", "nbytes", "key+extents"])
    for f in field.split("+"):
        storages[a][f], storages[b][f] = storages[b][f], storages[a][f]
    reseal = rng.random() < 0.5
    build.write_doc(roots, doc, reseal=reseal)
    return f"swap {field} of storages {a} and {b}{' (resealed)' if reseal else ''}", reseal


def _json_dup(rng: random.Random, roots: list[str]) -> tuple[str, bool]:
    doc = build.read_doc(roots)
    storages = [s for s in doc["objects"]["replicated"]["storages"] if s["extents"]]
    what = rng.choice(["extent", "file", "object", "storage", "drop-storage"])
    if what == "extent":
        s = rng.choice(storages)
        s["extents"].append(dict(s["extents"][-1]))
    elif what == "file":
        doc["files"].append(dict(rng.choice(doc["files"])))
    elif what == "object":
        doc["objects"]["rank-00001"] = doc["objects"]["replicated"]
    elif what == "storage":
        doc["objects"]["replicated"]["storages"].append(dict(rng.choice(storages)))
    else:
        doc["objects"]["replicated"]["storages"].remove(rng.choice(storages))
    build.write_doc(roots, doc)
    return f"duplicate {what} (resealed)", True


def _skeleton_records(roots: list[str]) -> dict[str, bytes]:
    from fastpersist.format import skeleton

    doc = build.read_doc(roots)
    raw = open(build.skeleton_path(roots, doc), "rb").read()
    return skeleton.decode("skeleton", raw)


def _skeleton_pickle_flip(rng: random.Random, roots: list[str]) -> tuple[str, bool]:
    from fastpersist.format import skeleton

    records = _skeleton_records(roots)
    pk = bytearray(records["data.pkl"])
    positions = [rng.randrange(len(pk)) for _ in range(rng.choice([1, 2, 4]))]
    for p in positions:
        pk[p] ^= rng.randrange(1, 256)
    build.replace_skeleton(roots, skeleton.encode({**records, "data.pkl": bytes(pk)}))
    return f"skeleton pickle flipped at {positions}, checksums recomputed", True


def _skeleton_zip(rng: random.Random, roots: list[str]) -> tuple[str, bool]:
    """Structural tricks inside the skeleton file, with the manifest made to match."""
    records = _skeleton_records(roots)
    members = sorted(records.items())
    trick = rng.choice(["duplicate", "bomb", "deflated", "junk-before", "overlap"])
    if trick == "duplicate":
        raw = build.zip_bytes(members + [members[0]] * rng.choice([1, 3000]))
    elif trick in ("bomb", "deflated"):
        size = (1536 << 20) if trick == "bomb" else len(records["data.pkl"])
        data = build.deflate_bomb(size) if trick == "bomb" else zlib.compress(records["data.pkl"], 9)[2:-4]
        raw = build.zip_bytes(members, method=8, raw_data={"data.pkl": data}, sizes={"data.pkl": size})
    elif trick == "junk-before":
        raw = rng.randbytes(100) + build.zip_bytes(members)
    else:
        raw = bytearray(build.zip_bytes(members))
        pos = build.central_entries(bytes(raw))[-1][0]
        struct.pack_into("<I", raw, pos + 42, 0)  # the last entry's header offset -> the first record
        raw = bytes(raw)
    build.replace_skeleton(roots, raw)
    return f"skeleton zip: {trick}", True


def _skeleton_evil(rng: random.Random, roots: list[str], marker: str) -> tuple[str, bool]:
    from fastpersist.format import skeleton

    build.replace_skeleton(roots, skeleton.encode({"data.pkl": build.evil_pickle(marker), "byteorder": b"little"}))
    if rng.random() < 0.5:  # no storages: nothing stops it before the unpickler
        doc = build.read_doc(roots)
        doc["objects"]["replicated"]["storages"] = []
        build.write_doc(roots, doc)
    return "code-running skeleton, checksums recomputed", True


def _sharded_mutation(rng: random.Random, roots: list[str], where: str, marker: str) -> tuple[str, bool]:
    targets = _targets(roots)
    kind = rng.choices(
        ["flip", "truncate", "zero", "extend", "delete", "swap", "duplicate", "json", "json_swap", "json_dup",
         "pickle_flip", "skeleton_zip", "evil", "special"],
        weights=[18, 8, 6, 2, 4, 3, 3, 18, 6, 4, 8, 5, 2, 10])[0]
    name = rng.choice(sorted(targets))
    path = targets[name]
    if kind in _BYTE_MUTATIONS:
        return f"{kind} {name}: {_BYTE_MUTATIONS[kind](rng, path)}", False
    if kind == "delete":
        os.unlink(path)
        return f"delete {name}", False
    if kind in ("swap", "duplicate"):
        other = targets[rng.choice(sorted(set(targets) - {name}))]
        if kind == "swap":
            tmp = path + ".swap"
            os.rename(path, tmp)
            os.rename(other, path)
            os.rename(tmp, other)
        else:
            shutil.copyfile(other, path)
        return f"{kind} {name} with {os.path.basename(other)}", False
    if kind == "special":
        return f"special {name}: {_special(rng, path, where)}", False
    if kind == "evil":
        return _skeleton_evil(rng, roots, marker)
    mutate = {"json": _json_field, "json_swap": _json_swap, "json_dup": _json_dup,
              "pickle_flip": _skeleton_pickle_flip, "skeleton_zip": _skeleton_zip}[kind]
    detail, crafted = mutate(rng, roots)
    return f"{kind}: {detail}", crafted


# ---- making, running and classifying a case ---------------------------------------------------


class Bases:
    """The pristine checkpoints every case copies (written once per run)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.single = build.save_single(os.path.join(directory, "single.pt"))
        self.plain = os.path.join(directory, "plain.pt")
        import torch

        torch.save(build.reference_state(), self.plain)
        self.sharded = build.save_sharded(os.path.join(directory, "sharded"))


def make_case(bases: Bases, fmt: str, seed: int, index: int, work: str) -> Case:
    rng = random.Random(f"{seed}:{fmt}:{index}")
    where = os.path.join(work, f"{fmt}-{index}")
    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(where)
    marker = os.path.join(where, "code-ran")
    if fmt == "single":
        path = os.path.join(where, "model.pt")
        shutil.copyfile(bases.single, path)
        mutation, crafted = _single_mutation(rng, path, where, marker, bases.plain)
        return Case(fmt, index, mutation, crafted, where, path, marker)
    shutil.copytree(os.path.dirname(bases.sharded[0]), os.path.join(where, "ck"), symlinks=True)
    roots = [os.path.join(where, "ck", os.path.basename(r)) for r in bases.sharded]
    mutation, crafted = _sharded_mutation(rng, roots, where, marker)
    return Case(fmt, index, mutation, crafted, where, roots, marker)


def classify(case: Case, outcome: Outcome) -> str:
    if os.path.exists(case.marker):
        return "code_ran"
    if outcome.kind != "value":
        if outcome.kind != "checkpoint_error":
            return outcome.kind
        return "checkpoint_error" if case.where in outcome.message else "unnamed"
    if case.fmt == "single":
        loaded, problems = outcome.value, None
    else:
        loaded, problems = outcome.value
    if loaded.startswith("error"):
        if case.where not in loaded:
            return "unnamed"
        return "checkpoint_error" if problems else "disagree"
    if loaded == "different":
        return "crafted" if case.crafted else "wrong"
    if problems and not case.crafted:
        return "disagree"
    return "exact"


def run_case(bases: Bases, fmt: str, seed: int, index: int, work: str, timeout_s: float = 20.0,
             memory_bytes: int = 1 << 30) -> tuple[Case, str, Outcome]:
    case = make_case(bases, fmt, seed, index, work)
    probe = probes.load_single if fmt == "single" else probes.load_and_verify_sharded
    outcome = run_isolated(probe, case.target, timeout_s=timeout_s, memory_bytes=memory_bytes)
    kind = classify(case, outcome)
    if kind in ("exact", "checkpoint_error", "crafted"):
        shutil.rmtree(case.where, ignore_errors=True)
    return case, kind, outcome


def family(mutation: str) -> str:
    """The mutation's kind ("flip", "json", "special"...), for the per-kind table."""
    return mutation.split(":")[0].split()[0].split("+")[0]


def run_many(bases: Bases, fmt: str, seed: int, count: int, work: str,
             by_family: Counter[tuple[str, str]] | None = None) -> tuple[Counter[str], list[str]]:
    counts: Counter[str] = Counter()
    failures: list[str] = []
    for i in range(count):
        case, kind, outcome = run_case(bases, fmt, seed, i, work)
        counts[kind] += 1
        if by_family is not None:
            by_family[(family(case.mutation), kind)] += 1
        if kind in FAILURES:
            failures.append(f"{fmt} case {i} (seed {seed}) {case.mutation}: {kind}: {outcome}")
    return counts, failures
