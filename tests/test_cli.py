from __future__ import annotations

from fastpersist.cli import main
from fastpersist.cli.bench import Sample, Series, gpt_state, table, tensor_bytes


def test_unknown_command_is_usage_error(capsys):
    assert main(["no-such-command"]) == 2
    assert "bench" in capsys.readouterr().out


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
    assert main(["convert", os.path.join(roots[0], "step-00000002"), target]) == 1
    assert "only 1 roots were given" in capsys.readouterr().err
