"""`fastpersist inspect`, `ls --tensors`, and verify/convert given a root: the latest checkpoint,
its other roots found where the manifest recorded them (or named when they moved)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import fastpersist as fp
from fastpersist.cli import main


@pytest.fixture
def two_roots(tmp_path):
    roots = [str(tmp_path / "nvme0" / "run"), str(tmp_path / "nvme1" / "run")]
    state = {"model": {"w": torch.randn(300, 70), "b": torch.zeros(70, dtype=torch.float64)}, "step": 3}
    with fp.Checkpointer(roots, mode="sync") as c:
        c.save(2, {"model": {"w": torch.ones(2)}, "step": 2})
        c.save(3, state)
    return roots, state


def test_inspect_lists_tensors_by_key(two_roots, capsys):
    roots, _ = two_roots
    assert main(["inspect", roots[0]]) == 0  # a root means its latest checkpoint
    out = capsys.readouterr().out
    assert "step 3" in out and "format version 3" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  model.")}
    assert lines["model.w"][1:3] == ["float32", "[300,"] and "replicated" in lines["model.w"]
    assert lines["model.b"][1] == "float64"


def test_inspect_json_schema(two_roots, capsys):
    roots, _ = two_roots
    assert main(["inspect", os.path.join(roots[0], "step-00000002"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"path", "step", "format_version", "world_size", "roots", "root_paths", "bytes", "files",
                        "objects", "metadata", "tensors"}
    assert doc["step"] == 2 and doc["root_paths"] == [os.path.abspath(r) for r in roots]
    assert doc["tensors"] == [{"key": "model.w", "dtype": "float32", "shape": [2], "bytes": 8, "sharded": False,
                               "chunks": 1, "object": "replicated"}]


def test_ls_tensors(two_roots, capsys):
    roots, _ = two_roots
    assert main(["ls", roots[0], "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "tensors of step 3 (latest)" in out and "model.w" in out
    assert main(["ls", roots[0], "--tensors", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["latest"]["step"] == 3 and {t["key"] for t in doc["latest"]["tensors"]} == {"model.w", "model.b"}


def test_verify_and_convert_find_the_other_roots_from_the_manifest(two_roots, tmp_path, capsys):
    roots, state = two_roots
    assert main(["verify", roots[0]]) == 0
    out = str(tmp_path / "full.pt")
    assert main(["convert", roots[0], out]) == 0
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["step"] == 3


def test_a_moved_root_is_named_with_the_option_to_pass(two_roots, tmp_path, capsys):
    roots, _ = two_roots
    moved = str(tmp_path / "elsewhere")
    shutil.move(roots[1], moved)
    capsys.readouterr()
    assert main(["verify", roots[0]]) == 2
    err = capsys.readouterr().err
    assert f"root #1 was {os.path.abspath(roots[1])}" in err and "--root" in err
    assert main(["verify", roots[0], "--root", moved]) == 0


def test_a_directory_that_is_no_checkpoint_is_a_usage_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "neither a checkpoint directory" in capsys.readouterr().err


def test_paths_of_the_wrong_kind_say_what_they_are(tmp_path):
    from fastpersist.errors import CheckpointError

    f = tmp_path / "afile"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="afile is a file, not a directory"):
        fp.save({"a": torch.ones(2)}, str(f / "x.pt"))
    with pytest.raises(CheckpointError, match="afile is a file, not a checkpoint root directory"):
        fp.open(str(f)).list()
    with pytest.raises(CheckpointError, match="afile: it is a file, not a checkpoint directory"):
        fp.load_checkpoint(str(f))


def test_a_copied_checkpoint_is_not_read_from_the_original_roots(two_roots, tmp_path, capsys):
    roots, _ = two_roots
    backup = [str(tmp_path / "backup" / "r0"), str(tmp_path / "backup" / "r1")]
    for a, b in zip(roots, backup):
        shutil.copytree(a, b)
    step = os.path.join(backup[1], "step-00000003")
    os.remove(os.path.join(step, sorted(os.listdir(step))[0]))  # damage the copy only
    capsys.readouterr()
    assert main(["verify", backup[0]]) == 2
    assert "a copy?" in capsys.readouterr().err
    assert main(["verify", backup[0], "--root", backup[1]]) == 1
