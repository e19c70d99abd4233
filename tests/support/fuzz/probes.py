"""What a child process runs against a (possibly damaged) checkpoint. Each returns a small,
picklable summary; any exception is classified by the harness."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import fastpersist as fp
from fastpersist.storage import catalog
from fastpersist.objects.verify import verify
from fastpersist.cli.checkpoints import verify_main
from fuzz.build import equal, reference_state


def compare(obj: Any) -> str:
    return "exact" if equal(reference_state(), obj) else "different"


def load_single(path: str, verify: bool | None = None, weights_only: bool = True) -> str:
    return compare(fp.load(path, verify=verify, weights_only=weights_only))


def load_sharded(roots: list[str]) -> str:
    """Load "latest" the way a resuming job does: the pointer, then the checkpoint."""
    step = catalog.read_latest(roots[0])
    if step is None:
        raise fp.CheckpointNotFoundError(f"no committed checkpoint in {roots[0]}")
    name = catalog.step_dir(step)
    return compare(fp.load_checkpoint(os.path.join(roots[0], name), roots[1:]))


def verify_sharded(roots: list[str], step: str = "step-00000001") -> list[str]:
    """The problems ``fastpersist verify`` finds (an unreadable manifest is one problem)."""
    dirs = [os.path.join(r, step) for r in roots]
    try:
        manifest = catalog.read_manifest(dirs[0])
    except fp.CheckpointError as e:
        return [f"manifest: {e}"]
    problems, _ = verify(dirs, manifest)
    return [str(p) for p in problems]


def cli_verify(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = verify_main(args)
    return code, out.getvalue()


def load_and_verify_sharded(roots: list[str]) -> tuple[str, list[str]]:
    """Both, in one child: how load ends ("exact", "different" or the error type) and what verify
    reports, so the fuzz can check that they agree."""
    try:
        loaded = load_sharded(roots)
    except fp.CheckpointError as e:
        loaded = f"error {type(e).__name__}: {e}"
    return loaded, verify_sharded(roots)


def load_step(roots: list[str], step: str = "step-00000001") -> str:
    """Load one checkpoint by its directory (``fastpersist.load_checkpoint``)."""
    return compare(fp.load_checkpoint(os.path.join(roots[0], step), roots[1:]))
