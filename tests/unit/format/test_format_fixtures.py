"""Checkpoints written by earlier fastpersist versions, kept as fixtures, still load.

``tests/fixtures/format-v2`` was written by fastpersist before tensors were indexed by key
(manifest version 2: storages and extents, the manifest's own checksum); ``format-v1`` is the
same checkpoint with a version-1 manifest (no checksum of its own). ``expected.pt`` holds the
state they hold (written by torch.save).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import SUPPORT, assert_state_equal

import fastpersist
from fastpersist.cli import main
from fastpersist.errors import CheckpointReadError, UnverifiedCheckpointError

HERE = os.path.join(SUPPORT, "fixtures")


def _roots(version: int) -> list[str]:
    return [os.path.join(HERE, f"format-v{version}", "root0"), os.path.join(HERE, f"format-v{version}", "root1")]


@pytest.fixture(scope="module")
def expected():
    return torch.load(os.path.join(HERE, "expected.pt"), weights_only=True)


def test_version_2_loads_verified_and_bit_exact(expected):
    view = fastpersist.open(_roots(2))
    assert view.manifest(12).version == 2 and view.latest_step() == 12
    assert_state_equal(view.load(12), expected["state"])
    assert_state_equal(view.load_rank_state(12, rank=0), expected["rank_state"])
    assert view.metadata(12) == {"note": "format fixture"}
    assert view.verify(12) == []
    assert view.tensors(12) == []  # no index by key before version 3


def test_version_2_keyed_load_says_why_not():
    with pytest.raises(CheckpointReadError, match="format version 2, before tensors were indexed by key"):
        fastpersist.open(_roots(2)).load(12, keys=["model.w"])


def test_version_1_needs_verify_off(expected):
    view = fastpersist.open(_roots(1))
    with pytest.raises(UnverifiedCheckpointError, match="version 1"):
        view.load(12)
    assert_state_equal(view.load(12, verify=False), expected["state"])


def test_version_2_converts_to_a_torch_load_file(expected, tmp_path):
    out = str(tmp_path / "v2.pt")
    root0, root1 = _roots(2)
    assert main(["convert", os.path.join(root0, "step-00000012"), out, "--root", root1]) == 0
    assert_state_equal(torch.load(out, weights_only=True), expected["state"])
