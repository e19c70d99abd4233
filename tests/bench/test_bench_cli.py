"""``fastpersist bench`` (benchmarks/bench_single_file.py): it works in a directory of its own and
removes only that; the command runs the checkout's program, or says it needs a checkout."""

from __future__ import annotations

import os

import bench_path  # noqa: F401  (benchmarks/ on sys.path)
import bench_single_file as bench
from _bench import measure


def test_bench_dir_keeps_the_users_directory(tmp_path, monkeypatch, capsys):
    """`fastpersist bench --dir X` used to end with `rmtree(X)`: the directory the user named,
    and whatever they kept in it, was deleted. Only the run's own subdirectory may go."""
    monkeypatch.setattr(bench, "drop_caches", lambda: False)  # not under test; leave the host's cache alone
    user_dir = tmp_path / "scratch"
    user_dir.mkdir()
    (user_dir / "keep.txt").write_text("the user's file")
    (user_dir / "data").mkdir()
    before = sorted(os.listdir(user_dir))
    out_json = tmp_path / "r.json"

    rc = bench.main(["--sizes", "0.002", "--rounds", "1", "--settle", "0", "--probe-mib", "4",
                     "--dir", str(user_dir), "--json", str(out_json)])

    assert rc == 0
    assert user_dir.is_dir(), "the benchmark removed the directory the user named"
    assert sorted(os.listdir(user_dir)) == before, "the benchmark left files behind or removed the user's"
    assert (user_dir / "keep.txt").read_text() == "the user's file"
    assert out_json.exists()
    assert "| fastpersist.save / device write |" in capsys.readouterr().out


def test_bench_dir_is_created_when_missing_and_left_empty(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "drop_caches", lambda: False)
    target = tmp_path / "new" / "dir"
    assert bench.main(["--sizes", "0.002", "--rounds", "1", "--settle", "0", "--probe-mib", "4",
                       "--dir", str(target)]) == 0
    assert target.is_dir() and os.listdir(target) == []


def test_bench_gpu_runs_the_prepared_gpu_check(capsys):
    """`fastpersist bench --gpu` is the prepared GPU run (benchmarks/gpu_check.py), with its own options."""
    import pytest

    from fastpersist.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--gpu", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "fastpersist bench --gpu" in out and "--smoke" in out


def test_device_probe_says_when_the_filesystem_refuses_o_direct(tmp_path, monkeypatch):
    """Some sandboxes (gVisor) and filesystems answer EINVAL to O_DIRECT: the probe measures
    buffered I/O instead of failing the whole benchmark, and its note says so."""
    import errno

    from fastpersist.io.files import O_DIRECT

    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(measure.shutil, "which", lambda name: None)  # no fio
    monkeypatch.setattr(os, "open", refusing_open)
    path = str(tmp_path / "probe.bin")
    _, write_gbps, note = measure.device_probe(path, "write", 8 << 20)
    _, read_gbps, _ = measure.device_probe(path, "read", 8 << 20)
    assert write_gbps > 0 and read_gbps > 0 and os.path.getsize(path) == 8 << 20
    assert "BUFFERED" in note and "O_DIRECT refused" in note


def test_demo_and_bench_need_a_checkout(monkeypatch, capsys):
    """Installed without its checkout, the package has no benchmarks/: the commands say where the
    demo and the benchmarks run, in one line, and exit 2 (a wrong path), importing nothing."""
    import sys

    from fastpersist.cli import main, programs

    monkeypatch.setattr(programs, "BENCHMARKS", os.path.join(os.sep, "nonexistent", "benchmarks"))
    before = set(sys.modules)
    for command in ("demo", "bench"):
        assert main([command, "--help"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert f"fastpersist {command}:" in err and "source checkout" in err and "scripts/demo.sh" in err
    assert not {m for m in set(sys.modules) - before if m.startswith("_fastpersist_")}


def test_bench_runs_the_checkouts_program(capsys):
    """`fastpersist bench ARGS` is benchmarks/bench_single_file.py's main(ARGS): its options, its
    usage errors."""
    import pytest

    from fastpersist.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: fastpersist bench" in out and "--dcp-threads" in out
    with pytest.raises(SystemExit) as e:
        main(["bench", "--no-such-option"])
    assert e.value.code == 2 and "--no-such-option" in capsys.readouterr().err
