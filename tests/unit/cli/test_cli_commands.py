"""The command line: dispatch, exit codes, stdout/stderr, --json, progress, units, lazy imports."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import types

import pytest
import torch

import fastpersist as fp
from fastpersist.cli import COMMANDS, main
from fastpersist.cli import checkpoints, progress
from fastpersist.cli.units import rate, size
from helpers import REPO

SRC = os.path.join(REPO, "src")


def _py(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_do_not_import_torch(flag):
    """`fastpersist --help` used to import torch (2 s here) through the package's eager imports."""
    r = _py(f"import sys\nfrom fastpersist.cli import main\ntry:\n    main([{flag!r}])\n"
            f"finally:\n    print('TORCH', 'torch' in sys.modules, file=sys.stderr)")
    assert "TORCH False" in r.stderr, r.stderr
    assert "usage: fastpersist" in r.stdout if flag == "--help" else r.stdout.startswith("fastpersist ")


def test_version_is_the_package_version():
    r = subprocess.run([sys.executable, "-m", "fastpersist", "--version"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0
    assert r.stdout.strip() == f"fastpersist {fp.__version__}"


def test_package_names_still_resolve():
    """Every exported name resolves (the lazy ones import their module) to fastpersist's class or
    function of that name, not to another object filed under it."""
    for name in fp.__all__:
        obj = getattr(fp, name)
        assert obj.__name__ == name and obj.__module__.startswith("fastpersist."), (name, obj)
    with pytest.raises(AttributeError):
        fp.no_such_name  # noqa: B018


def test_command_arguments_are_forwarded_unchanged(monkeypatch, capsys):
    """`demo` and `bench` parse their own options: everything after the command reaches them as given."""
    seen = []
    fake = types.ModuleType("fastpersist_fake_cmd")
    fake.main = lambda argv: seen.append(list(argv)) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fastpersist_fake_cmd", fake)
    monkeypatch.setitem(COMMANDS, "fake", ("fastpersist_fake_cmd", "main", "a test command"))
    argv = ["--help", "-q", "--rounds", "3", "pos", "--x=1", "-h"]
    assert main(["fake", *argv]) == 7
    assert seen == [argv]
    assert main(["fake"]) == 7 and seen[-1] == []


def test_stray_option_before_the_command_is_a_usage_error(capsys):
    assert main(["--bogus", "ls", "x"]) == 2
    assert "--bogus" in capsys.readouterr().err


def test_demo_help_is_the_demos_own():
    with pytest.raises(SystemExit) as e:
        main(["ls", "--help"])
    assert e.value.code == 0
    r = subprocess.run([sys.executable, "-m", "fastpersist", "demo", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "fastpersist demo" in r.stdout and "COMMAND" not in r.stdout


def _checkpoints(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    with fp.Checkpointer(roots) as ck:
        ck.save(1, {"w": torch.randn(10_000)}).wait()
        ck.save(2, {"w": torch.randn(300_000), "v": torch.randn(5000)}).wait()
    os.makedirs(os.path.join(roots[0], "step-00000003"))
    return roots, os.path.join(roots[0], "step-00000002")


def test_ls_missing_root_and_file_are_usage_errors(tmp_path, capsys):
    """`ls` on a missing root said "no checkpoints" and exited 0; on a file it ended in a traceback."""
    missing = str(tmp_path / "nope")
    assert main(["ls", missing]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == f"fastpersist ls: {missing}: no such directory"
    a_file = tmp_path / "f.pt"
    a_file.write_bytes(b"x")
    assert main(["ls", str(a_file)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "is a file" in err and str(a_file) in err and "Traceback" not in err


def test_ls_empty_root(tmp_path, capsys):
    assert main(["ls", str(tmp_path)]) == 0
    assert "no checkpoints" in capsys.readouterr().out
    assert main(["ls", "--json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"root": str(tmp_path), "checkpoints": []}


def test_ls_json_schema(tmp_path, capsys):
    roots, _ = _checkpoints(tmp_path)
    assert main(["ls", roots[0], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["root"] == roots[0]
    keys = {"step", "path", "state", "committed", "latest", "abandoned", "sequence", "created", "bytes", "files",
            "world_size", "objects"}
    assert all(set(c) == keys for c in doc["checkpoints"])
    by_step = {c["step"]: c for c in doc["checkpoints"]}
    assert [by_step[s]["state"] for s in (1, 2, 3)] == ["committed", "latest", "incomplete"]
    assert [by_step[s]["latest"] for s in (1, 2, 3)] == [False, True, False]
    assert by_step[2]["bytes"] > 300_000 * 4 > by_step[1]["bytes"] > 0
    assert by_step[2]["sequence"] > by_step[1]["sequence"]
    assert isinstance(by_step[2]["created"], float) and by_step[2]["world_size"] == 1
    assert by_step[3]["bytes"] is None and by_step[3]["created"] is None and by_step[3]["committed"] is False


def test_ls_sizes_use_binary_units(tmp_path, capsys):
    roots, _ = _checkpoints(tmp_path)
    nbytes = fp.open(roots).list()[1].nbytes
    assert main(["ls", roots[0]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f" {nbytes / 2**20:.1f} MiB " in lines[2], lines[2]


def test_verify_json_ok_and_damaged(tmp_path, capsys):
    roots, step = _checkpoints(tmp_path)
    assert main(["verify", step, "--root", roots[1], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["problems"] == [] and doc["path"] == step and doc["step"] == 2
    assert doc["bytes_verified"] >= 305_000 * 4
    manifest = json.load(open(os.path.join(step, "manifest.json")))
    big = max(manifest["objects"]["replicated"]["storages"], key=lambda s: s["nbytes"])
    e = big["extents"][0]
    f = manifest["files"][e["file"]]
    path = os.path.join(roots[f["root"]], "step-00000002", f["name"])
    with open(path, "r+b") as fh:
        fh.seek(e["offset"] + 4)
        fh.write(b"\x00\xff\x00")
    assert main(["verify", step, "--root", roots[1], "--json"]) == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["ok"] is False and len(doc["problems"]) == 1
    problem = doc["problems"][0]
    assert set(problem) == {"path", "what", "offset", "message"}
    assert problem["path"] == path and problem["offset"] == e["offset"] and "checksum mismatch" in problem["message"]


def test_verify_single_file_json(tmp_path, capsys):
    good = str(tmp_path / "m.pt")
    fp.save({"w": torch.randn(1000)}, good)
    assert main(["verify", good, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["bytes_verified"] == os.path.getsize(good) and doc["kind"] == "file"
    with open(good, "r+b") as f:
        f.seek(-200, 2)
        f.write(b"junk" * 10)
    assert main(["verify", good, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["ok"] and doc["problems"][0]["path"] == good and doc["bytes_verified"] == 0


def test_missing_paths_are_one_line_errors_with_status_2(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    for argv in (["verify", missing], ["convert", missing, str(tmp_path / "o.pt")],
                 ["verify", missing, "--json"]):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and missing in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    roots, step = _checkpoints(tmp_path)
    assert main(["convert", step, str(tmp_path / "no-dir" / "o.pt"), "--root", roots[1]]) == 2
    assert "no-dir" in capsys.readouterr().err


def test_progress_is_quiet_off_a_terminal(tmp_path, capsys):
    roots, step = _checkpoints(tmp_path)
    capsys.readouterr()
    assert main(["verify", step, "--root", roots[1]]) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal here


class _Tty:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_wanted():
    assert progress.wanted(False, _Tty(True)) is True
    assert progress.wanted(True, _Tty(True)) is False  # --quiet
    assert progress.wanted(False, _Tty(False)) is False


@pytest.mark.parametrize("command", ["verify", "convert"])
def test_progress_bar_on_a_terminal_counts_every_byte(tmp_path, capsys, monkeypatch, command):
    roots, step = _checkpoints(tmp_path)
    bars: list[progress.Progress] = []
    real = progress.Progress

    def recording(*args, **kwargs):
        bars.append(real(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(checkpoints, "wanted", lambda quiet: not quiet)  # as if stderr were a terminal
    monkeypatch.setattr(checkpoints, "Progress", recording)
    capsys.readouterr()
    argv = [command, step] + ([str(tmp_path / "o.pt")] if command == "convert" else []) + ["--root", roots[1]]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "iB" in err and ("verify" in err or "read" in err)
    data = 305_000 * 4
    assert bars and all(b.done >= data for b in bars), [b.done for b in bars]
    bars.clear()
    assert main(argv + ["--quiet"]) == 0
    assert capsys.readouterr().err == "" and all(b.done >= data for b in bars)


def test_library_progress_callbacks(tmp_path):
    roots, _ = _checkpoints(tmp_path)
    got: list[int] = []
    assert fp.open(roots).verify(2, progress=got.append) == []
    assert sum(got) == 305_000 * 4 and len(got) >= 2
    path = str(tmp_path / "m.pt")
    fp.save({"w": torch.randn(100_000), "b": torch.ones(7)}, path)
    got.clear()
    fp.load(path, progress=got.append)
    assert sum(got) >= 100_007 * 4


def test_units():
    assert [size(n) for n in (0, 1, 1023, 1024, 1536, 5 << 20, 3 << 30)] == [
        "0 B", "1 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "3.0 GiB"]
    assert rate(2 << 30, 2.0) == "1.00 GiB/s" and rate(1, 0) == "- GiB/s"


def test_checkpointer_log_line_uses_binary_units(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fastpersist.checkpointer")
    with fp.Checkpointer(str(tmp_path / "r"), mode="sync") as ck:
        ck.save(1, {"w": torch.randn(1000)})
    line = next(r.getMessage() for r in caplog.records if "committed" in r.getMessage())
    assert "MiB" in line and "GiB/s" in line and "GB/s" not in line and not line.startswith("fastpersist:")


def test_no_fastpersist_prefix_in_log_messages():
    """The logger's name says fastpersist; a "fastpersist:" prefix in the message repeated it."""
    pattern = re.compile(r"(logger\.\w+|_warn_once)\(\s*f?[\"']fastpersist:")
    found = []
    for dirpath, _, names in os.walk(os.path.join(SRC, "fastpersist")):
        for name in names:
            if name.endswith(".py"):
                text = open(os.path.join(dirpath, name)).read()
                found += [f"{name}: {m.group(0)}" for m in pattern.finditer(text)]
    assert found == []
