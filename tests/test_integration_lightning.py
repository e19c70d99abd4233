"""Lightning through fastpersist's CheckpointIO plugins: real Trainer runs in child processes,
killed with SIGKILL in the middle of writing a checkpoint, resumed, and compared loss by loss
with an uninterrupted run (single process and ddp over gloo with 2 processes)."""

from __future__ import annotations

import os

import pytest
import torch

import fastpersist as fp
from integration_util import check_resumed, read_losses, require, run_child

CHILD = "integration_lightning_child.py"
STEPS = 8
KILL = 4  # the checkpoint of global step 4 is being written when the process dies

require("lightning")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, str]:
    d = str(tmp_path_factory.mktemp("lightning-ref"))
    run_child(CHILD, [d, str(STEPS), "1", "async", "0", "none"])
    (losses,) = read_losses(d)
    assert sorted(losses) == list(range(STEPS))
    return losses


def _kill_and_resume(d: str, devices: int) -> tuple[dict[int, str], dict[int, str]]:
    ckpt = os.path.join(d, "ckpt")
    run_child(CHILD, [d, str(STEPS), str(devices), "async", str(KILL), "none"], killed=True)
    # Killed mid-write: the checkpoint of step KILL exists only as a partial directory, and the
    # checkpoint Lightning resumes from (last.ckpt) is the one before it.
    assert os.path.isdir(os.path.join(ckpt, f"step={KILL}.ckpt.fp-partial"))
    assert not os.path.exists(os.path.join(ckpt, f"step={KILL}.ckpt"))
    assert fp.load_checkpoint(_committed(os.path.join(ckpt, "last.ckpt")), weights_only=False)["global_step"] == KILL - 1
    run_child(CHILD, [d, str(STEPS), str(devices), "async", "0", os.path.join(ckpt, "last.ckpt")])
    killed, resumed = read_losses(d)
    return killed, resumed


def _committed(path: str) -> str:
    (info,) = [c for c in fp.list_checkpoints(path) if c.committed]
    return info.path


def test_async_kill_and_resume_is_exact(tmp_path, reference) -> None:
    killed, resumed = _kill_and_resume(str(tmp_path), 1)
    check_resumed(reference, killed, resumed, KILL - 1, STEPS - 1)
    # save_top_k=2 with removal through the plugin: two step checkpoints and last, nothing partial
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["last.ckpt", f"step={STEPS - 1}.ckpt", f"step={STEPS}.ckpt"]


def test_ddp_gloo_kill_and_resume_is_exact(tmp_path) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    run_child(CHILD, [str(ref_dir), str(STEPS), "2", "async", "0", "none"])
    (ref,) = read_losses(str(ref_dir))
    killed, resumed = _kill_and_resume(str(run_dir), 2)
    check_resumed(ref, killed, resumed, KILL - 1, STEPS - 1)


def test_file_format_is_torch_loadable(tmp_path, reference) -> None:
    """The single-file format: checkpointing leaves training unchanged, every kept checkpoint is
    a file torch.load reads, and save_top_k removes the others."""
    run_child(CHILD, [str(tmp_path), "5", "1", "file", "0", "none"])
    (losses,) = read_losses(str(tmp_path))
    assert losses == {s: reference[s] for s in range(5)}
    ckpt = tmp_path / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["last.ckpt", "step=4.ckpt", "step=5.ckpt"]
    plain = torch.load(ckpt / "last.ckpt", weights_only=False)
    assert plain["global_step"] == 5
    fast = fp.load(ckpt / "step=5.ckpt", weights_only=False)
    assert fast.keys() == plain.keys()
    for k, v in plain["state_dict"].items():
        assert torch.equal(fast["state_dict"][k], v)
