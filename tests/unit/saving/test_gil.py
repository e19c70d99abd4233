"""The interpreter's switch interval while a checkpoint is written in the background
(fastpersist.saving.gil): lowered for the save, put back after, someone else's change kept."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import HeldBackend

from fastpersist.checkpointer import Checkpointer
from fastpersist.config import IOConfig, config_from_env
from fastpersist.errors import CheckpointError

STATE = {"w": torch.arange(4096, dtype=torch.float32)}


@pytest.fixture(autouse=True)
def default_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


ON = IOConfig(switch_interval_us=500)


def _held_save(tmp_path, mode: str, config: IOConfig | None = ON):
    backend = HeldBackend(hold="step-00000001")
    ckpt = Checkpointer(str(tmp_path / "ckpt"), mode=mode, backend=backend, config=config)
    handle = ckpt.save(1, STATE)
    return ckpt, backend, handle


def test_a_background_save_lowers_the_interval_and_puts_it_back(tmp_path) -> None:
    ckpt, backend, handle = _held_save(tmp_path, "snapshot")
    assert backend.holding.wait(30)  # the save is writing, in the background
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    backend.release()
    handle.wait()
    ckpt.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_change_made_during_the_save_is_kept(tmp_path) -> None:
    ckpt, backend, handle = _held_save(tmp_path, "overlap")
    assert backend.holding.wait(30)
    sys.setswitchinterval(0.002)  # the user's, while fastpersist had it lowered
    backend.release()
    handle.wait()
    ckpt.close()
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_a_lower_interval_and_the_default_setting_are_left_alone(tmp_path) -> None:
    sys.setswitchinterval(0.0001)
    ckpt, backend, handle = _held_save(tmp_path, "snapshot")
    assert backend.holding.wait(30)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    backend.release()
    handle.wait()
    ckpt.close()
    sys.setswitchinterval(0.005)
    ckpt, backend, handle = _held_save(tmp_path / "off", "snapshot", None)  # the default: off
    assert backend.holding.wait(30)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    backend.release()
    handle.wait()
    ckpt.close()


def test_two_checkpointers_put_it_back_when_the_last_save_ends(tmp_path) -> None:
    first, b1, h1 = _held_save(tmp_path / "a", "snapshot")
    second, b2, h2 = _held_save(tmp_path / "b", "snapshot")
    assert b1.holding.wait(30) and b2.holding.wait(30)
    b1.release()
    h1.wait()
    assert sys.getswitchinterval() == pytest.approx(0.0005)  # the other save still runs
    b2.release()
    h2.wait()
    first.close(), second.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_setting_from_the_environment_and_its_bounds() -> None:
    assert config_from_env({"FASTPERSIST_SWITCH_US": "200"}).switch_interval_us == 200
    with pytest.raises(CheckpointError, match="switch_interval_us"):
        IOConfig(switch_interval_us=-1)
