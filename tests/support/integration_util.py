"""Helpers shared by the integration tests: run a training child, read its losses."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")


def require(module: str) -> None:
    """Skip the test when the framework ``module`` is not installed (the integrations extra)."""
    pytest.importorskip(module)


def run_child(script: str, args: list[str], *, killed: bool = False, timeout: float = 180.0) -> None:
    """Run ``tests/<script> args`` in a new session; check it finished, or died by SIGKILL.

    A killed child's other processes (a ddp peer waiting in a collective) are killed with it.
    """
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONHASHSEED="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    expected = -signal.SIGKILL if killed else 0
    if proc.returncode != expected:
        raise AssertionError(f"{script} {args} exited with {proc.returncode}, expected {expected}:\n{out[-4000:]}")


def read_losses(directory: str) -> list[dict[int, str]]:
    """Every run's losses in ``directory`` (losses-<pid>.txt), oldest run first: step -> hex."""
    runs = []
    for path in sorted(glob.glob(os.path.join(directory, "losses-*.txt")), key=os.path.getmtime):
        with open(path) as f:
            runs.append({int(s): v for s, v in (line.split() for line in f if line.strip())})
    return runs


def check_resumed(reference: dict[int, str], killed: dict[int, str], resumed: dict[int, str],
                  resumed_from: int, last: int) -> None:
    """The killed run matched the reference up to its death; the resumed run starts at
    ``resumed_from`` and matches the reference, bit for bit, through step ``last``."""
    assert killed, "the killed run logged no loss"
    assert {s: reference[s] for s in killed} == killed
    assert min(resumed) == resumed_from, f"resumed at step {min(resumed)}, expected {resumed_from}"
    assert max(resumed) == last
    assert len(resumed) == last - resumed_from + 1
    mismatched = [s for s in resumed if resumed[s] != reference[s]]
    assert not mismatched, f"losses differ from the uninterrupted run at steps {mismatched}"


def run_job(script: str, args: list[str], world: int, directory: str, *, killed: bool = False,
            timeout: float = 420.0) -> None:
    """Run ``tests/<script> args`` as a ``world``-rank job launched the way torchrun launches
    one (RANK, LOCAL_RANK, WORLD_SIZE, env:// rendezvous on a free port); as torchrun does, the
    other ranks are killed once one rank fails. Checks that every rank finished, or that a rank
    died by SIGKILL (``killed``). Each rank's output goes to ``directory/rank-<r>.log``."""
    from helpers import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONHASHSEED="0",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GROUP_RANK="0",
               TORCHELASTIC_RUN_ID=f"fastpersist-test-{port}")
    procs, logs = [], []
    for rank in range(world):
        log = open(os.path.join(directory, f"rank-{rank}.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, script), *args],
                                      env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    failed = threading.Event()
    exited: dict[int, int] = {}  # rank -> its exit status, for the ranks that ended on their own

    def watch(rank: int, p: subprocess.Popen[bytes]) -> None:
        try:
            exited[rank] = p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        if exited.get(rank) != 0:
            failed.set()

    watchers = [threading.Thread(target=watch, args=(r, p), daemon=True) for r, p in enumerate(procs)]
    for w in watchers:
        w.start()
    try:
        while any(w.is_alive() for w in watchers) and not failed.wait(1.0):
            pass
    finally:
        own = dict(exited)
        for p in procs:  # the job's other ranks (and anything they started), as torchrun does
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        codes = [p.wait() for p in procs]
        for log in logs:
            log.close()
    if killed:  # a rank died by SIGKILL, none by anything else
        ok = -signal.SIGKILL in own.values() and all(c in (0, -signal.SIGKILL) for c in own.values())
    else:
        ok = len(own) == world and all(c == 0 for c in own.values())
    if not ok:
        outputs = []
        for rank in range(world):
            with open(os.path.join(directory, f"rank-{rank}.log")) as f:
                outputs.append(f"--- rank {rank} ---\n{f.read()[-3000:]}")
        raise AssertionError(f"{script} {args} on {world} ranks exited with {own} (then {codes})"
                             f"{' (expected a SIGKILL)' if killed else ''}:\n" + "\n".join(outputs))


def random_kill(step: int, world: int) -> str:
    """A kill at a random instant of step ``step``'s checkpoint write: a random rank, at a random
    one of its first write requests (the children's :func:`kill_faults` spec; the choice is in
    the spec, so a failure names it)."""
    import random

    rng = random.Random()
    spec = f"{step}:{rng.randrange(world)}:{rng.randint(1, 2)}"
    print(f"kill spec {spec}")  # in the test's captured output: a failure can be replayed with it
    return spec


def kill_faults(spec: str, path_contains: str) -> list:
    """The children's faults for a kill spec: "0" none; "K" every rank at its second write
    request of the checkpoint whose files' paths contain ``path_contains``; "K:R:N" rank R
    alone, at its N-th write request."""
    from fastpersist.storage.faults import Fault

    parts = [int(p) for p in spec.split(":")]
    if parts[0] <= 0:
        return []
    rank, at = (parts[1], parts[2]) if len(parts) == 3 else (None, 2)
    return [Fault("write", None, at=at, kill=True, rank=rank, path_contains=path_contains)]


def pretend_accelerator_fsdp2(plugin: Any) -> None:
    """Make accelerate run its FSDP2 path on this CPU machine.

    accelerate turns its FSDP plugin on only for accelerator devices (``AcceleratorState``
    sets ``DistributedType.FSDP`` for GPU-like processes, never for CPU ones), and this machine
    has no GPU. This tells the (already created) accelerator state what it would have decided on
    a GPU, and nothing else: accelerate's FSDP2 preparation (``fully_shard`` on its mesh),
    torch's state-dict functions and the gloo process group stay real. As on a GPU, the type is
    also copied into ``PartialState``'s shared state (each ``AcceleratorState()`` copies it back).
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    state = AcceleratorState()
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def fsdp2_kill_resume_reshard(child: str, tmp_path: Any, *, root: str, model: str, optimizer: str, weight: str,
                              buffers_key: str | None, steps: int, kill: int) -> None:
    """The FSDP2 kill-and-resume test of a framework child (``child DIR STEPS KILL_STEP
    [RESUME_STEP]``, checkpoints in DIR/``root``, resuming from RESUME_STEP or else the latest
    one there, rank 0 saving the full state it loaded to DIR/loaded.pt).

    Over 2 gloo processes every rank writes the chunks of the DTensors it owns (the model's
    parameters under ``model``, the optimizer state under ``optimizer``; ``weight`` is one
    parameter's key; rank 0's ``model_buffers``, under ``buffers_key`` if given, are the model's
    buffers); a SIGKILL at a random instant of step ``kill``'s write resumes exactly at
    2 processes; the same checkpoint loads at 1 process with every full tensor equal to the
    checkpoint's, and every later loss equals (float.hex) that of a 1-process resume from an
    uninterrupted 2-process job's checkpoint of that step."""
    import shutil

    import torch

    import fastpersist as fp
    from fastpersist.storage import catalog
    from helpers import assert_state_equal

    dirs = {name: tmp_path / name for name in ("ref", "run", "one", "short", "one-ref")}
    for d in dirs.values():
        d.mkdir()
    run_job(child, [str(dirs["ref"]), str(steps), "0"], 2, str(tmp_path))
    (reference,) = read_losses(str(dirs["ref"]))
    run_job(child, [str(dirs["run"]), str(steps), random_kill(kill, 2)], 2, str(tmp_path), killed=True)
    ckpt = str(dirs["run"] / root)
    assert {c.step for c in fp.list_checkpoints(ckpt) if c.committed} == {kill - 2, kill - 1}
    saved_root = shutil.copytree(ckpt, str(tmp_path / "saved"))  # resumes go on to retention
    step_dir = os.path.join(saved_root, f"step-{kill - 1:08d}")
    manifest = catalog.read_manifest(step_dir)
    assert {t.key.split(".")[0] for t in manifest.sharded} == {model, optimizer}
    (entry,) = [t for t in manifest.sharded if t.key == f"{model}.{weight}"]
    assert len(entry.chunks) == 2  # each rank wrote the rows it owns
    shutil.copytree(saved_root, str(dirs["one"] / root))
    run_job(child, [str(dirs["run"]), str(steps), "0"], 2, str(tmp_path))
    killed, resumed = read_losses(str(dirs["run"]))
    check_resumed(reference, killed, resumed, kill, max(reference))

    run_job(child, [str(dirs["one"]), str(steps), "0"], 1, str(tmp_path))
    (one,) = read_losses(str(dirs["one"]))
    assert sorted(one) == [s for s in sorted(reference) if s >= kill]
    state = fp.load_checkpoint(step_dir)
    own = fp.load_checkpoint(step_dir, rank=0, weights_only=False)
    buffers = own["model_buffers"] if buffers_key is None else own["model_buffers"][buffers_key]
    loaded = torch.load(str(dirs["one"] / "loaded.pt"), weights_only=False)
    assert_state_equal(dict(sorted(loaded["model"].items())), dict(sorted({**state[model], **buffers}.items())),
                       layout=False)
    assert_state_equal(loaded["optimizer"], state[optimizer], layout=False)
    # the resharded resume against an uninterrupted run: a 2-process job that goes one step past
    # the killed one's last commit (its last step would differ: the Trainer evaluates at the end,
    # and the evaluation loader draws its seed from the RNG), resumed at 1 process from its
    # checkpoint of that commit's step, has every loss of the killed job's
    run_job(child, [str(dirs["short"]), str(kill + 1 - min(reference)), "0"], 2, str(tmp_path))
    shutil.copytree(str(dirs["short"] / root), str(dirs["one-ref"] / root))
    run_job(child, [str(dirs["one-ref"]), str(steps), "0", str(kill - 1)], 1, str(tmp_path))
    (one_ref,) = read_losses(str(dirs["one-ref"]))
    assert one == one_ref
