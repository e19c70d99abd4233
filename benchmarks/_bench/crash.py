"""The crash harness: a training run killed with SIGKILL in the middle of a checkpoint write, then
resumed from the latest committed checkpoint, its losses compared with an uninterrupted run's.

The kill does not depend on timing: the training child (``_bench.crash_child``) stalls inside the
write of the chosen step's checkpoint and says so on a pipe, and the harness sends SIGKILL when it
reads that byte. Three runs of the child: the reference (no checkpoints; it runs alongside the
killed one), the killed run, and the resumed run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import fastpersist
from _bench.crash_child import STALLED
from _bench.models import ModelSpec

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def losses(text: str) -> dict[int, str]:
    """``{step: loss}`` from the child's ``step N loss HEX`` lines."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "step" and parts[2] == "loss":
            out[int(parts[1])] = parts[3]
    return out


def _env() -> dict[str, str]:
    """The child imports ``_bench`` from here and the same fastpersist as this process."""
    env = dict(os.environ)
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS
    library = os.path.dirname(os.path.dirname(os.path.abspath(fastpersist.__file__)))
    path = [BENCHMARKS, library] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


class _Child:
    """One run of the training child, its stdout and stderr in files under ``directory``."""

    def __init__(self, directory: str, name: str, args: list[str], pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        self.out, self.err = (os.path.join(directory, f"{name}.{x}") for x in ("out", "err"))
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "_bench.crash_child", *args], stdout=out,
                                         stderr=err, env=_env(), pass_fds=pass_fds)

    def wait(self, timeout: float, check: bool = True) -> str:
        """Its exit, then its stdout; raises if it failed (``check``) or outran ``timeout``."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the {self.name} run did not finish within {timeout:.0f} s") from None
        if check and self.proc.returncode != 0:
            with open(self.err) as f:
                raise RuntimeError(f"the {self.name} run failed (exit {self.proc.returncode}):\n{f.read()[-3000:]}")
        with open(self.out) as f:
            return f.read()


def _wait_for_stall(fd: int, timeout: float) -> bool:
    """True when the child sent :data:`STALLED`; False if it exited without (end of file) or the
    timeout passed."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            return os.read(fd, 1) == STALLED
    return False


def _uncommitted(run_dir: str) -> tuple[dict[str, int], list[str]]:
    """What the kill left without a manifest: checkpoint directories newer than the newest
    committed one (saves being written), with the bytes of data their files hold, and the older
    ones (deletions by retention that were under way: a deletion removes the manifest first)."""
    names = sorted(n for n in os.listdir(run_dir) if n.startswith("step-") and os.path.isdir(os.path.join(run_dir, n)))
    committed = [n for n in names if os.path.exists(os.path.join(run_dir, n, "manifest.json"))]
    newest = committed[-1] if committed else ""
    writing, deleting = {}, []
    for n in names:
        if n in committed:
            continue
        if n < newest:
            deleting.append(n)
            continue
        d = os.path.join(run_dir, n)
        data = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".bin")]
        if data:
            writing[n] = sum(os.path.getsize(f) for f in data)
    return writing, deleting


def crash_and_resume(directory: str, *, spec: ModelSpec = ModelSpec(), steps: int = 24, kill_after: int = 10,
                     device: str = "cpu", timeout_s: float = 600.0) -> dict[str, Any]:
    """Kill a training run with SIGKILL while step ``kill_after``'s checkpoint is being written,
    resume it, compare its losses with an uninterrupted run's.

    Returns the losses (``{step: float.hex}``) of the reference run, the killed run and the
    resumed run, the step the run resumed from, ``returncode`` of the killed run (-9),
    ``in_progress``: the checkpoint directories newer than the newest committed one that the kill
    left with data files and no manifest, with their bytes of data, ``being_deleted``: older
    directories without a manifest (retention's deletion was under way), ``left_after_resume``:
    the directories without a manifest still there after the resumed run (it removes them at its
    start), and ``killed_mid_write``: the child had stalled inside the write, and a directory in
    progress was left.
    """
    os.makedirs(directory, exist_ok=True)
    run_dir = os.path.join(directory, "run")
    common = ["--spec", json.dumps(dataclasses.asdict(spec)), "--steps", str(steps), "--device", device]
    ref = _Child(directory, "reference", ["--dir", os.path.join(directory, "ref"), "--mode", "none", *common])
    read_fd, write_fd = os.pipe()
    try:
        try:
            killed = _Child(directory, "killed", ["--dir", run_dir, *common, "--stall-at", str(kill_after),
                                                  "--signal-fd", str(write_fd)], pass_fds=(write_fd,))
        finally:
            os.close(write_fd)  # the child holds the only write end: its exit is our end of file
        stalled = _wait_for_stall(read_fd, timeout_s)
    finally:
        os.close(read_fd)
    if killed.proc.poll() is None:
        os.kill(killed.proc.pid, signal.SIGKILL)  # the crash itself: no cleanup runs in the child
    killed_out = killed.wait(timeout_s, check=False)
    in_progress, being_deleted = _uncommitted(run_dir)
    reference = losses(ref.wait(timeout_s))
    resumed_out = _Child(directory, "resumed", ["--dir", run_dir, *common, "--resume"]).wait(timeout_s)
    left_after_resume = [n for n in sorted(os.listdir(run_dir))
                         if n.startswith("step-") and not os.path.exists(os.path.join(run_dir, n, "manifest.json"))]
    start = next((int(x.split()[-1]) for x in resumed_out.splitlines() if x.startswith("resumed from step")), None)
    return {"reference": reference, "killed": losses(killed_out), "resumed": losses(resumed_out),
            "resumed_from": start, "in_progress": in_progress, "being_deleted": being_deleted,
            "left_after_resume": left_after_resume, "killed_mid_write": stalled and bool(in_progress),
            "returncode": killed.proc.returncode}
