"""``fastpersist ls ROOT``, ``fastpersist convert CKPT_DIR OUT.pt``, ``fastpersist verify CKPT``."""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import fastpersist
from fastpersist import catalog, sharded
from fastpersist.view import load_checkpoint
from fastpersist.errors import CheckpointError
from fastpersist.single_file import load, save


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _when(created: float) -> str:
    try:
        return datetime.datetime.fromtimestamp(created).isoformat(" ", "seconds") if created else "-"
    except (ValueError, OverflowError, OSError):
        return "?"


def ls_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fastpersist ls", description="list the checkpoints under a root")
    p.add_argument("root", help="the first root of a Checkpointer (holds the manifests and `latest`)")
    args = p.parse_args(argv)
    infos = fastpersist.open(args.root).list()  # read-only: creates nothing, takes no lock
    if not infos:
        print(f"no checkpoints in {args.root}")
        return 0
    print(f"{'step':>10}  {'state':<10} {'size':>10}  {'files':>5}  {'ranks':>5}  created")
    for i in infos:
        state = ("latest" if i.latest else "abandoned" if i.abandoned else "committed") if i.committed else "incomplete"
        created = _when(i.created)
        print(f"{i.step:>10}  {state:<10} {_size(i.nbytes) if i.committed else '-':>10}  "
              f"{i.files if i.committed else '-':>5}  {i.world_size if i.committed else '-':>5}  {created}")
    return 0


def convert_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fastpersist convert",
                                description="write a sharded checkpoint as one torch.load-compatible file")
    p.add_argument("checkpoint", help="the checkpoint's directory in its first root, e.g. ROOT/step-00000100")
    p.add_argument("out", help="the file to write (e.g. model.pt)")
    p.add_argument("--root", action="append", default=[], help="another root of the checkpoint, in order")
    p.add_argument("--rank", type=int, default=None, help="convert this rank's own state instead")
    p.add_argument("--trust", action="store_true", help="load the skeleton with the full unpickler")
    args = p.parse_args(argv)
    try:
        obj = load_checkpoint(args.checkpoint, args.root, rank=args.rank, map_location="cpu",
                              weights_only=not args.trust)
        save(obj, args.out)
    except CheckpointError as e:
        print(f"fastpersist convert: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


def verify_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fastpersist verify",
                                description="read a checkpoint completely and check every checksum")
    p.add_argument("checkpoint", help="a checkpoint directory (ROOT/step-N) or a single file from fastpersist.save")
    p.add_argument("--root", action="append", default=[], help="another root of the checkpoint, in order")
    args = p.parse_args(argv)
    try:
        if not os.path.isdir(args.checkpoint):
            return _verify_file(args.checkpoint)
        return _verify_directory(args.checkpoint, args.root)
    except Exception as e:  # noqa: BLE001 - verify reports, it never ends in a traceback
        print(f"FAILED {args.checkpoint}: unexpected {type(e).__name__}: {e} (please report this as a bug)")
        return 1


def _verify_file(path: str) -> int:
    """A single file: verified by the load path itself (checksums, structure, skeleton)."""
    try:
        load(path, map_location="cpu", verify=True)
    except CheckpointError as e:
        print(f"FAILED {e}")
        return 1
    print(f"OK {path}: every record matches its checksum")
    return 0


def _verify_directory(checkpoint: str, roots: list[str]) -> int:
    """A sharded checkpoint: every check load runs, on every object, every problem reported."""
    first = os.path.abspath(checkpoint)
    name = os.path.basename(first.rstrip(os.sep))
    dirs = [first] + [os.path.join(os.path.abspath(r), name) for r in roots]
    try:
        manifest = catalog.read_manifest(first)
    except CheckpointError as e:
        print(f"FAILED {e}")
        return 1
    problems, checked = sharded.verify(dirs, manifest)
    for problem in problems:
        print(f"FAILED {problem}")
    if problems:
        print(f"{len(problems)} problem(s) in step {manifest.step} ({first})")
        return 1
    storages = sum(len(o.storages) for o in manifest.objects.values())
    print(f"OK step {manifest.step}: {len(manifest.objects)} objects, {storages} storages, "
          f"{len(manifest.files)} files, {checked} bytes verified")
    return 0
