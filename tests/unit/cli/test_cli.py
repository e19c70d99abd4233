from __future__ import annotations

import bench_path  # noqa: F401  (benchmarks/ on sys.path)
from _bench.measure import Sample
from _bench.state import gpt_state, tensor_bytes
from bench_single_file import Series, table
from fastpersist.cli import main


def test_unknown_command_is_usage_error(capsys):
    assert main(["no-such-command"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "'no-such-command'" in err and all(c in err for c in ("demo", "bench", "ls", "convert", "verify"))


def test_gpt_state_has_the_requested_size_and_shape():
    state = gpt_state(0.05)
    size = tensor_bytes(state)
    assert 0.8 * 0.05 * (1 << 30) <= size <= 1.2 * 0.05 * (1 << 30)
    model, optim = state["model"], state["optim"]
    assert len(optim["state"]) == len(model)
    big = [t for t in model.values() if t.dim() == 2]
    small = [t for t in model.values() if t.dim() == 1]
    assert big and len(small) > len(big), "a few large matrices and many small vectors"


def test_table_reports_ratios_of_medians():
    series = {}
    for name, kind, gbps in [("device write", "save", [2.0, 3.0, 4.0]), ("torch.save+fsync", "save", [0.5] * 3),
                             ("DCP FileSystemWriter t4", "save", [1.0] * 3), ("fastpersist.save", "save", [2.4] * 3),
                             ("device read", "load", [2.0] * 3), ("torch.load", "load", [0.5] * 3),
                             ("fastpersist.load", "load", [1.8] * 3)]:
        s = Series(name, kind)
        for g in gbps:
            s.add(Sample(1.0 / g, 0.1 / g, 0), int(1e9))
        series[name] = s
    out = table(1, 1.07, series)
    assert "| fastpersist.save / device write | 0.80 |" in out
    assert "| fastpersist.save / torch.save+fsync | 4.80 |" in out
    assert "| fastpersist.load / device read | 0.90 |" in out


def test_ls_and_convert(tmp_path, capsys):
    import os

    import torch

    from fastpersist.checkpointer import Checkpointer

    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    ck = Checkpointer(roots)
    state = {"w": torch.randn(50_000), "n": 3}
    ck.save(1, {"w": torch.zeros(3), "n": 0}).wait()
    ck.save(2, state).wait()
    os.makedirs(os.path.join(roots[0], "step-00000003"))
    assert main(["ls", roots[0]]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[1:]] == [["1", "committed"], ["2", "latest"], ["3", "incomplete"]]
    target = str(tmp_path / "out.pt")
    assert main(["convert", os.path.join(roots[0], "step-00000002"), target, "--root", roots[1]]) == 0
    got = torch.load(target)
    assert torch.equal(got["w"], state["w"]) and got["n"] == 3
    # without --root: the other root is where the manifest recorded it
    os.remove(target)
    assert main(["convert", os.path.join(roots[0], "step-00000002"), target]) == 0
    assert torch.equal(torch.load(target)["w"], state["w"])
    # an explicit --root list that is short: the missing root is named
    capsys.readouterr()
    assert main(["convert", os.path.join(roots[0], "step-00000002"), target, "--root", roots[0]]) == 1


def _two_root_checkpoint(tmp_path):
    import torch

    from fastpersist.checkpointer import Checkpointer

    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    with Checkpointer(roots) as ck:
        ck.save(1, {"w": torch.randn(300_000), "v": torch.randn(5000), "n": 1}).wait()
    import json
    import os

    step = os.path.join(roots[0], "step-00000001")
    return roots, step, json.load(open(os.path.join(step, "manifest.json")))


def test_verify_reports_every_problem(tmp_path, capsys):
    import os

    roots, step, doc = _two_root_checkpoint(tmp_path)
    assert main(["verify", step, "--root", roots[1]]) == 0
    assert "OK step 1" in capsys.readouterr().out
    # three problems at once: a flipped byte, a truncated file, a deleted file
    files = doc["files"]
    storages = doc["objects"]["replicated"]["storages"]
    big = max(storages, key=lambda s: s["nbytes"])
    e0, e1 = big["extents"][0], big["extents"][1]
    path0 = os.path.join(roots[files[e0["file"]]["root"]], "step-00000001", files[e0["file"]]["name"])
    with open(path0, "r+b") as f:
        f.seek(e0["offset"] + 10)
        f.write(b"\xff\xfe")
    path1 = os.path.join(roots[files[e1["file"]]["root"]], "step-00000001", files[e1["file"]]["name"])
    os.truncate(path1, 100)
    skel = doc["objects"]["replicated"]["skeleton"]
    os.unlink(os.path.join(roots[files[skel["file"]]["root"]], "step-00000001", files[skel["file"]]["name"]))
    assert main(["verify", step, "--root", roots[1]]) == 1
    out = capsys.readouterr().out
    assert f"{path0}: object 'replicated' storage '{big['key']}'" in out and f"at offset {e0['offset']}" in out
    assert f"{path1}: file: truncated" in out
    assert "replicated.skel: file: missing" in out
    assert "lies beyond the end of the file" in out  # the storages the truncation lost, by key
    assert "problem(s) in step 1" in out


def test_verify_single_file_and_garbage(tmp_path, capsys):
    import torch

    import fastpersist as fp

    good = str(tmp_path / "m.pt")
    fp.save({"w": torch.randn(1000)}, good)
    assert main(["verify", good]) == 0
    with open(good, "r+b") as f:
        f.seek(-200, 2)
        f.write(b"junk" * 10)
    assert main(["verify", good]) == 1
    (tmp_path / "notckpt").mkdir()
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "notckpt")]) == 2  # not a checkpoint: a wrong path
    out, err = capsys.readouterr()
    assert "nor a root holding a committed checkpoint" in err and out == ""
