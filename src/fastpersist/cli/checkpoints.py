"""``fastpersist ls ROOT``, ``fastpersist convert CKPT_DIR OUT.pt``, ``fastpersist verify CKPT``.

Results go to stdout, diagnostics and errors to stderr (one line naming the path and the
cause, never a traceback). Exit status: 0 success, 1 a problem found (verify found damage,
convert met a damaged or incomplete checkpoint), 2 a usage error or a path that is missing,
unreadable or of the wrong kind. ``--json`` output is described in docs/CLI.md.

The durable tier (``Checkpointer(durable=...)``): ``ls ROOT --durable LOCATION`` shows which
tier holds each step; ``ls``, ``inspect``, ``verify`` and ``convert`` also take an
``s3://bucket/prefix`` URL (its latest checkpoint) or ``s3://bucket/prefix/step-N``, read
through :class:`fastpersist.tiers.durable.view.DurableView`. A durable tier in a directory is a
checkpoint root like any other.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from fastpersist.storage import catalog
from fastpersist import timeline
from fastpersist.tiers.durable.store import is_url
from fastpersist.objects.verify import Problem, verify
from fastpersist.cli.progress import Progress, ProgressBackend, wanted
from fastpersist.cli.units import rate, size
from fastpersist.config import get_config
from fastpersist.errors import CheckpointError, CheckpointNotFoundError
from fastpersist.format import manifest as mf
from fastpersist.single_file import load, save
from fastpersist.loading.view import (
    CheckpointInfo,
    CheckpointView,
    checkpoint_dirs,
    list_checkpoints,
    load_object,
    load_state,
    tensor_infos,
)

if TYPE_CHECKING:
    from fastpersist.tiers.durable.view import DurableView

OK, PROBLEM, USAGE = 0, 1, 2
T = TypeVar("T")


class _PathError(Exception):
    """A path given on the command line is missing or of the wrong kind (exit status 2)."""


def _guarded(prog: str, run: Callable[[], int]) -> int:
    """Run a command; its expected failures become one line on stderr and an exit status."""
    try:
        return run()
    except BrokenPipeError:  # `fastpersist ls | head`: the reader left; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not complain
        return PROBLEM
    except _PathError as e:
        return _fail(prog, str(e), USAGE)
    except CheckpointNotFoundError as e:  # also a FileNotFoundError: before OSError
        return _fail(prog, str(e), USAGE)
    except CheckpointError as e:
        return _fail(prog, str(e), PROBLEM)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return _fail(prog, f"{where}{e.strerror or e}", USAGE)


def _fail(prog: str, message: str, status: int) -> int:
    one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"{prog}: {one_line}", file=sys.stderr)
    return status


def _need_dir(path: str) -> None:
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise _PathError(f"{path}: is a file, not a directory")
    raise _PathError(f"{path}: no such directory")


def _when(created: float) -> str:
    try:
        return datetime.datetime.fromtimestamp(created).isoformat(" ", "seconds") if created else "-"
    except (ValueError, OverflowError, OSError):
        return "?"


# ------------------------------------------------------------------------------ durable tier


def _split_url(url: str) -> tuple[str, int | str]:
    """``s3://bucket/prefix/step-00000012`` -> (``s3://bucket/prefix``, 12); a URL without a
    step directory at its end names the tier (its latest checkpoint)."""
    url = url.rstrip("/")
    head, _, tail = url.rpartition("/")
    step = catalog.parse_step_dir(tail)
    if step is not None and is_url(head) and head.split("://", 1)[1]:
        return head, step
    return url, "latest"


def _reach(where: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a durable location: one that cannot be reached or read at all (no such
    endpoint, credentials refused) is a path error (exit status 2), as an unreadable directory is."""
    from fastpersist.tiers.durable.store import StoreError

    try:
        return fn()
    except StoreError as e:
        raise _PathError(str(e)) from e


def _durable_view(url: str) -> DurableView:
    """The durable tier at ``url`` (an ``s3://bucket/prefix`` URL, no step)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("s3", "s3a"):
        raise _PathError(f"{url}: only s3:// URLs are supported (a durable tier in a directory is given by its path)")
    try:
        from fastpersist.tiers.durable.view import DurableView

        return DurableView(url)
    except (ImportError, ValueError) as e:
        raise _PathError(f"{url}: {e}") from e


def _durable_step(checkpoint: str) -> tuple[DurableView, mf.Manifest]:
    """``s3://bucket/prefix[/step-N]``: the tier and the manifest of that step (or its latest)."""
    location, step = _split_url(checkpoint)
    view = _durable_view(location)
    return view, _reach(location, lambda: view.manifest(step))


@dataclass(frozen=True)
class _Tier:
    """A durable tier named on the command line: a directory (read as a root) or an s3:// URL."""

    where: str
    view: CheckpointView | DurableView

    @staticmethod
    def at(location: str) -> _Tier:
        if is_url(location):
            location, step = _split_url(location)
            if step != "latest":
                raise _PathError(f"{location}/{catalog.step_dir(int(step))}: names a checkpoint; "
                                 "give the durable tier's location")
            return _Tier(location, _durable_view(location))
        _need_dir(location)
        return _Tier(os.path.abspath(location), CheckpointView(location))

    def list(self) -> list[CheckpointInfo]:
        return _reach(self.where, self.view.list)

    def manifest(self, step: int) -> mf.Manifest:
        return _reach(self.where, lambda: self.view.manifest(step))


# ---------------------------------------------------------------------------------------- ls


def ls_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="fastpersist ls", description="list the checkpoints under a root")
    p.add_argument("root", help="the first root of a Checkpointer (holds the manifests and `latest`), or a durable "
                                "tier's s3://bucket/prefix URL")
    p.add_argument("--durable", metavar="LOCATION", default=None,
                   help="the Checkpointer's durable tier (a directory or an s3://bucket/prefix URL): "
                        "show which tier holds each step")
    p.add_argument("--json", action="store_true", help="print a JSON document (see docs/CLI.md)")
    p.add_argument("--tensors", action="store_true", help="also list the tensors of the latest checkpoint")
    args = p.parse_args(argv)
    return _guarded(p.prog, lambda: _ls(args.root, args.json, args.tensors, args.durable))


def _state(i: CheckpointInfo) -> str:
    if not i.committed:
        return "incomplete"
    return "latest" if i.latest else "abandoned" if i.abandoned else "committed"


@dataclass(frozen=True)
class _Row:
    """One step of ``ls``: its checkpoint, and (with a durable tier) which tiers hold it."""

    info: CheckpointInfo
    tier: str | None = None  # local, durable, local+durable (None: no durable tier named)
    durable_path: str | None = None


def _tiers(local: list[CheckpointInfo], durable: list[CheckpointInfo]) -> list[_Row]:
    """The steps of both tiers. A step's tier is where it is committed (both: the same commit,
    by its sequence; otherwise the newer one's tier); a step committed nowhere is incomplete
    where its leftovers lie. ``latest`` and ``abandoned`` are decided over the commits of both
    tiers (commit sequences continue across tiers)."""
    here, there = {i.step: i for i in local}, {i.step: i for i in durable}
    rows: list[_Row] = []
    for step in sorted(here.keys() | there.keys()):
        found = [(t, i) for t, i in (("local", here.get(step)), ("durable", there.get(step))) if i is not None]
        held = [(t, i) for t, i in found if i.committed]
        if len(held) == 2 and held[0][1].sequence != held[1][1].sequence:  # the step saved again since
            held = [max(held, key=lambda h: h[1].sequence)]
        held = held or found
        dur = there.get(step)
        rows.append(_Row(held[0][1], "+".join(t for t, _ in held), dur.path if dur is not None else None))
    commits = [timeline.Commit(r.info.step, r.info.sequence, r.info.created) for r in rows if r.info.committed]
    dead, latest = timeline.abandoned_steps(commits), timeline.latest(commits)
    return [replace(r, info=replace(r.info, latest=r.info.step == latest, abandoned=r.info.step in dead))
            if r.info.committed else r for r in rows]


def _ls(root: str, as_json: bool, tensors: bool = False, durable: str | None = None) -> int:
    where, tier = root, None
    if is_url(root):  # a durable tier in object storage, alone
        if durable is not None:
            raise _PathError(f"{root}: is a durable tier's URL; ROOT is the local root that --durable goes with")
        tier = _Tier.at(root)
        where = tier.where
        rows = [_Row(i, "durable", i.path) for i in tier.list()]
    else:
        _need_dir(root)
        where = os.path.abspath(root)
        infos = list_checkpoints(root)  # read-only: creates nothing, takes no lock
        if durable is None:
            rows = [_Row(i) for i in infos]
        else:
            tier = _Tier.at(durable)
            rows = _tiers(infos, tier.list())
    latest = next((r for r in rows if r.info.latest), None)
    manifest = None
    if tensors and latest is not None:
        if latest.tier == "durable" and tier is not None:
            manifest = tier.manifest(latest.info.step)
        else:  # read where its path is (a local copy when there is one)
            manifest = catalog.read_manifest(latest.info.path)
    if as_json:
        doc: dict[str, Any] = {"root": where}
        if durable is not None and tier is not None:
            doc["durable"] = tier.where
        doc["checkpoints"] = [_row_json(r) for r in rows]
        if manifest is not None and latest is not None:
            doc["latest"] = _inspect_json(latest.info.path, manifest)
        print(json.dumps(doc, indent=2))
        return OK
    if not rows:
        print(f"no checkpoints in {root}" + (f" or {durable}" if durable is not None else ""))
        return OK
    tiered = any(r.tier is not None for r in rows)
    tier_head = f" {'tier':<13}" if tiered else ""
    print(f"{'step':>10}  {'state':<10}{tier_head} {'size':>10}  {'files':>5}  {'ranks':>5}  created")
    for r in rows:
        i, c = r.info, r.info.committed
        tier_cell = f" {r.tier:<13}" if tiered else ""
        print(f"{i.step:>10}  {_state(i):<10}{tier_cell} {size(i.nbytes) if c else '-':>10}  "
              f"{i.files if c else '-':>5}  {i.world_size if c else '-':>5}  {_when(i.created)}")
    if manifest is not None:
        print(f"\ntensors of step {manifest.step} (latest):")
        _print_tensors(_inspect_json("", manifest)["tensors"], manifest.version)
    return OK


def _row_json(r: _Row) -> dict[str, Any]:
    doc = _info_json(r.info)
    if r.tier is not None:
        doc["tier"] = r.tier
        doc["durable_path"] = r.durable_path
    return doc


def _info_json(i: CheckpointInfo) -> dict[str, Any]:
    c = i.committed
    return {"step": i.step, "path": i.path, "state": _state(i), "committed": c, "latest": i.latest,
            "abandoned": i.abandoned, "sequence": i.sequence if c else None,
            "created": i.created if c and i.created else None, "bytes": i.nbytes if c else None,
            "files": i.files if c else None, "world_size": i.world_size if c else None,
            "objects": list(i.objects)}


# ----------------------------------------------------------------------------------- inspect


def inspect_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="fastpersist inspect",
                                description="describe a checkpoint and list its tensors (key, dtype, shape, bytes)")
    p.add_argument("checkpoint", help="a checkpoint directory (ROOT/step-N) or a root (its latest checkpoint); "
                                      "or s3://bucket/prefix[/step-N], a durable tier's")
    p.add_argument("--json", action="store_true", help="print a JSON document (see docs/CLI.md)")
    args = p.parse_args(argv)
    return _guarded(p.prog, lambda: _inspect(args.checkpoint, args.json))


def _inspect(checkpoint: str, as_json: bool) -> int:
    if is_url(checkpoint):
        view, manifest = _durable_step(checkpoint)
        first = view.store.where(catalog.step_dir(manifest.step))
    else:
        _need_dir(checkpoint)
        first = _first_dir(checkpoint)  # the manifest is in the first root: the others are not read
        manifest = catalog.read_manifest(first)
    doc = _inspect_json(first, manifest)
    if as_json:
        print(json.dumps(doc, indent=2))
        return OK
    print(f"step {manifest.step} at {first}: format version {manifest.version}, saved by {manifest.world_size} "
          f"rank(s) over {manifest.roots} root(s), {size(manifest.nbytes)} in {len(manifest.files)} files")
    for i, r in enumerate(manifest.root_paths):
        print(f"  root #{i}: {r}")
    _print_tensors(doc["tensors"], manifest.version)
    return OK


def _inspect_json(path: str, manifest: mf.Manifest) -> dict[str, Any]:
    return {"path": path, "step": manifest.step, "format_version": manifest.version,
            "world_size": manifest.world_size, "roots": manifest.roots, "root_paths": list(manifest.root_paths),
            "bytes": manifest.nbytes, "files": len(manifest.files), "objects": sorted(manifest.objects),
            "metadata": manifest.user,
            "tensors": [{"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                         "sharded": t.sharded, "chunks": t.chunks, "object": t.object}
                        for t in tensor_infos(manifest)]}


def _print_tensors(tensors: list[dict[str, Any]], version: int) -> None:
    if version < 3:
        print(f"  (format version {version}: written before tensors were indexed by key)")
        return
    if not tensors:
        print("  no tensors")
        return
    width = max(len(t["key"]) for t in tensors)
    print(f"  {'key':<{width}}  {'dtype':<9} {'shape':<20} {'size':>10}  layout")
    for t in tensors:
        layout = f"sharded, {t['chunks']} chunks" if t["sharded"] else \
            ("replicated" if t["object"] == mf.REPLICATED else t["object"])
        print(f"  {t['key']:<{width}}  {t['dtype']:<9} {str(t['shape']):<20} {size(t['bytes']):>10}  {layout}")


# ----------------------------------------------------------------------------------- convert


def convert_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="fastpersist convert",
                                description="write a sharded checkpoint as one torch.load-compatible file")
    p.add_argument("checkpoint", help="the checkpoint's directory in its first root, e.g. ROOT/step-00000100, or "
                                      "a durable tier's s3://bucket/prefix[/step-N]")
    p.add_argument("out", help="the file to write (e.g. model.pt)")
    p.add_argument("--root", action="append", default=[], help="another root of the checkpoint, in order")
    p.add_argument("--rank", type=int, default=None, help="convert this rank's own state instead")
    p.add_argument("--trust", action="store_true", help="load the skeleton with the full unpickler")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    return _guarded(p.prog, lambda: _convert(args))


def _first_dir(checkpoint: str) -> str:
    """A step directory as it is; a root: its latest commit's directory."""
    first = os.path.abspath(checkpoint)
    is_step = catalog.parse_step_dir(os.path.basename(first.rstrip(os.sep))) is not None
    if is_step or os.path.exists(os.path.join(first, mf.MANIFEST_NAME)):
        return first
    step = catalog.read_latest(first)
    if step is None:
        raise _PathError(f"{checkpoint}: neither a checkpoint directory (no {mf.MANIFEST_NAME}) nor a root "
                         "holding a committed checkpoint")
    return os.path.join(first, catalog.step_dir(step))


def _dirs(checkpoint: str, roots: Sequence[str]) -> list[str]:
    """The checkpoint's directory in each of its roots: ``checkpoint`` is a step directory or a
    root (its latest commit); the other roots are ``roots`` (--root, in order) or those the
    manifest recorded (see :func:`fastpersist.loading.view.checkpoint_dirs`)."""
    return checkpoint_dirs(_first_dir(checkpoint), roots, option="--root")


def _object_bytes(obj: mf.ObjectEntry) -> int:
    return sum(e.nbytes for s in obj.storages for e in s.extents)


def _convert(args: argparse.Namespace) -> int:
    url = is_url(args.checkpoint)
    if url and args.root:
        raise _PathError(f"{args.checkpoint}: a durable checkpoint has one root; --root applies to local ones")
    if not url:
        _need_dir(args.checkpoint)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise _PathError(f"{args.out}: cannot write here: {out_dir} is not a directory")
    if os.path.isdir(args.out):
        raise _PathError(f"{args.out}: is a directory; name the file to write")
    if not url:
        dirs = _dirs(args.checkpoint, args.root)
        return _convert_dirs(args, dirs, catalog.read_manifest(dirs[0]))
    view, manifest = _durable_step(args.checkpoint)
    where = view.store.where(catalog.step_dir(manifest.step))
    _check_object(where, manifest, args.rank)  # before fetching anything
    top = tempfile.mkdtemp(prefix=".fastpersist-tmp-convert-")  # $TMPDIR, as DurableView's own loads
    try:
        local = os.path.join(top, catalog.step_dir(view.fetch(manifest.step, top)))
        try:
            return _convert_dirs(args, [local], catalog.read_manifest(local))
        except CheckpointError as e:  # name the objects, not the private copy
            raise type(e)(str(e).replace(local, where)) from e
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _check_object(where: str, manifest: mf.Manifest, rank: int | None) -> mf.ObjectEntry:
    name = mf.REPLICATED if rank is None else mf.rank_object(rank)
    entry = manifest.objects.get(name)
    if entry is None:
        raise _PathError(f"{where}: step {manifest.step} holds no object {name!r} "
                         f"(it holds {', '.join(sorted(manifest.objects))})")
    return entry


def _convert_dirs(args: argparse.Namespace, dirs: list[str], manifest: mf.Manifest) -> int:
    name = mf.REPLICATED if args.rank is None else mf.rank_object(args.rank)
    entry = _check_object(dirs[0], manifest, args.rank)
    total = _object_bytes(entry) + (sum(t.nbytes for t in manifest.sharded) if args.rank is None else 0)
    show = wanted(args.quiet)
    with Progress(total, "read", enabled=show) as bar:
        if args.rank is None:  # the state, its sharded tensors whole
            obj = load_state(dirs, manifest, None, "cpu", not args.trust, None, get_config(), ProgressBackend(bar))
        else:
            obj = load_object(dirs, manifest, name, None, "cpu", not args.trust, None, get_config(),
                              ProgressBackend(bar))
    with Progress(total, "write", enabled=show) as bar:
        save(obj, args.out, backend=ProgressBackend(bar))
    print(f"wrote {args.out} ({size(os.path.getsize(args.out))}) from step {manifest.step}")
    return OK


# ------------------------------------------------------------------------------------ verify


def verify_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="fastpersist verify",
                                description="read a checkpoint completely and check every checksum")
    p.add_argument("checkpoint", help="a checkpoint directory (ROOT/step-N), a single file from fastpersist.save, "
                                      "or a durable tier's s3://bucket/prefix[/step-N]")
    p.add_argument("--root", action="append", default=[], help="another root of the checkpoint, in order")
    p.add_argument("--json", action="store_true", help="print a JSON document (see docs/CLI.md)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    return _guarded(p.prog, lambda: _verify(args))


def _verify(args: argparse.Namespace) -> int:
    path = args.checkpoint
    if is_url(path) and args.root:
        raise _PathError(f"{path}: a durable checkpoint has one root; --root applies to local ones")
    if not is_url(path) and not os.path.exists(path):
        raise _PathError(f"{path}: no such file or directory")
    for r in args.root:
        _need_dir(r)
    show = wanted(args.quiet)
    if is_url(path):
        result = _verify_durable(path, show)
    elif os.path.isdir(path):
        result = _verify_directory(path, args.root, show)
    else:
        if args.root:
            raise _PathError(f"{path}: is a single file; --root applies to a checkpoint directory only")
        result = _verify_file(path, show)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_verdict(result)
    return OK if result["ok"] else PROBLEM


def _result(path: str, kind: str, step: int | None, checked: int, problems: list[Problem],
            seconds: float) -> dict[str, Any]:
    return {"path": path if is_url(path) else os.path.abspath(path), "kind": kind, "step": step, "ok": not problems,
            "bytes_verified": checked, "seconds": round(seconds, 3),
            "problems": [{"path": p.path, "what": p.what, "offset": p.offset, "message": p.message}
                         for p in problems]}


def _verify_file(path: str, show: bool) -> dict[str, Any]:
    """A single file: verified by the load path itself (checksums, structure, skeleton)."""
    import time

    if not os.access(path, os.R_OK):
        raise _PathError(f"{path}: permission denied")
    nbytes = os.path.getsize(path)
    start = time.perf_counter()
    problems: list[Problem] = []
    with Progress(nbytes, "verify", enabled=show) as bar:
        try:
            load(path, map_location="cpu", verify=True, progress=bar)
        except CheckpointNotFoundError:
            raise
        except CheckpointError as e:
            message = str(e)
            message = message[len(path):].lstrip(": ") if message.startswith(path) else message
            problems.append(Problem(path, "file", None, message))
    return _result(path, "file", None, 0 if problems else nbytes, problems, time.perf_counter() - start)


def _verify_directory(checkpoint: str, roots: list[str], show: bool) -> dict[str, Any]:
    """A sharded checkpoint: every check load runs, on every object, every problem reported."""
    import time

    dirs = _dirs(checkpoint, roots)
    start = time.perf_counter()
    try:
        manifest = catalog.read_manifest(dirs[0])
    except CheckpointNotFoundError:
        raise
    except CheckpointError as e:  # a manifest that is there but damaged: a problem found
        return _result(checkpoint, "directory", None, 0,
                       [Problem(os.path.join(dirs[0], "manifest.json"), "manifest", None, str(e))],
                       time.perf_counter() - start)
    total = sum(_object_bytes(o) for o in manifest.objects.values()) + sum(t.nbytes for t in manifest.sharded)
    with Progress(total, "verify", enabled=show) as bar:
        problems, checked = verify(dirs, manifest, progress=bar)
    return _result(checkpoint, "directory", manifest.step, checked, problems, time.perf_counter() - start)


def _verify_durable(url: str, show: bool) -> dict[str, Any]:
    """A checkpoint in a durable tier's object storage, fetched and verified by its
    DurableView: every check, every checksum; the problems name the objects."""
    import time

    location, step = _split_url(url)
    start = time.perf_counter()
    view = _durable_view(location)
    try:
        manifest = _reach(location, lambda: view.manifest(step))
    except CheckpointNotFoundError:
        raise
    except CheckpointError as e:  # a manifest that is there but damaged: a problem found
        where = view.store.where(f"{catalog.step_dir(step)}/{mf.MANIFEST_NAME}") if isinstance(step, int) else url
        return _result(url, "directory", None, 0, [Problem(where, "manifest", None, str(e))],
                       time.perf_counter() - start)
    total = sum(_object_bytes(o) for o in manifest.objects.values()) + sum(t.nbytes for t in manifest.sharded)
    hashed = 0
    with Progress(total, "verify", enabled=show) as bar:
        def progress(n: int) -> None:
            nonlocal hashed
            hashed += n
            bar(n)

        problems = view.verify(manifest.step, progress=progress)
    # DurableView.verify returns the problems, not how many bytes matched: the bytes it hashed
    # (every byte when nothing is wrong; with damage, the damaged ranges count too)
    return _result(view.store.where(catalog.step_dir(manifest.step)), "directory", manifest.step, hashed, problems,
                   time.perf_counter() - start)


def _print_verdict(r: dict[str, Any]) -> None:
    for p in r["problems"]:
        print(f"FAILED {Problem(p['path'], p['what'], p['offset'], p['message'])}")
    what = f"step {r['step']}" if r["step"] is not None else r["path"]
    if r["problems"]:
        print(f"{len(r['problems'])} problem(s) in {what} ({r['path']})")
        return
    print(f"OK {what}: {size(r['bytes_verified'])} verified in {r['seconds']:.2f} s "
          f"({rate(r['bytes_verified'], r['seconds'])}), every checksum matches")
