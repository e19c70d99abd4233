"""The prepared GPU run (benchmarks/gpu_check.py) in its smoke mode, here on whatever device the
machine has: every part runs, and the JSON and Markdown it writes hold every section."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import bench_path  # noqa: F401  (benchmarks/ on sys.path)
from helpers import REPO

ROOT = REPO
# The smoke run takes under 30 s on an idle machine; the bound leaves room for a shared, loaded one.
BOUND_S = 240


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-smoke")
    work = tmp_path_factory.mktemp("gpu-smoke-work")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--smoke", "--out", str(out),
                        "--dir", str(work)], capture_output=True, text=True, env=env, timeout=BOUND_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert os.listdir(work) == [], "the run left files in the directory it was given"
    with open(out / "results.json") as f:
        report = json.load(f)
    with open(out / "results.md") as f:
        md = f.read()
    return report, md


def test_smoke_run_writes_every_section(smoke):
    report, md = smoke
    assert report["smoke"] is True
    assert not report.get("errors"), report.get("errors")
    for key in ("machine", "d2h", "save", "train", "crash", "targets", "part_s"):
        assert key in report, key
    assert set(report["part_s"]) == {"machine", "d2h", "save", "train fits", "train big", "crash"}
    m = report["machine"]
    for fact in ("gpu", "cpu_cores", "host_memory_gib", "filesystem", "fio", "device_write_gbps", "device_read_gbps"):
        assert fact in m, fact
    assert m["device_write_gbps"] > 0 and m["device_read_gbps"] > 0
    for heading in ("## Machine", "## Device-to-host copy", "## Save of a GPU state",
                    "## Training with a checkpoint every iteration", "## Crash and resume", "## Targets (issue 13)"):
        assert heading in md, heading
    assert "SMOKE" in md


def test_smoke_run_measures_every_contender(smoke):
    report, md = smoke
    assert report["d2h"] and all(len(r["gbps"]) >= 1 and min(r["gbps"]) > 0 for r in report["d2h"])
    (save,) = report["save"]
    assert set(save["series"]) == {"device write (O_DIRECT)", "torch.save+fsync",
                                   "DCP FileSystemWriter t4 (sync_files)", "fastpersist.save"}
    assert all(s["gbps"] and min(s["gbps"]) > 0 for s in save["series"].values())
    for which in ("fits", "big"):
        runs = report["train"][which]["runs"]
        assert set(runs) == {"none", "torch.save", "dcp", "sync", "snapshot", "overlap"}
        for kind, rs in runs.items():
            assert rs and all(len(r["iter_s"]) >= 1 for r in rs), (which, kind)
            if kind != "none":
                assert all(len(r["blocked_s"]) == len(r["iter_s"]) for r in rs), (which, kind)
        for label in ("no checkpoint", "torch.save + fsync", "DCP async_save", "fastpersist sync",
                      "fastpersist snapshot", "fastpersist overlap"):
            assert f"| {label} |" in md


def test_smoke_run_crashes_mid_write_and_resumes_exactly(smoke):
    report, md = smoke
    c = report["crash"]
    assert c["returncode"] == -9
    assert c["killed_mid_write"], "the kill did not land during a checkpoint write"
    # the checkpoint being written when the run was killed was not committed
    assert c["resumed_from"] is not None and c["resumed_from"] < c["killed_after_step"]
    assert c["resumed"] and c["equal"]
    assert sorted(int(s) for s in c["resumed"]) == list(range(c["resumed_from"] + 1, len(c["reference"])))
    assert "bit for bit: yes" in md


def test_full_plan_calibrates_and_keeps_to_its_budget(tmp_path):
    """The full run's own logic, on the smoke model: gradient accumulation is calibrated so
    that a checkpoint write takes at most half an iteration, and a part out of time still
    runs every contender once except torch.save on the large model."""
    import dataclasses

    import torch

    import gpu_check as g

    plan = dataclasses.replace(g.SMOKE, smoke=False)
    clock = g.Clock(1000, plan.shares)
    clock.begin("train fits")
    fits = g.part_train(plan, "fits", torch.device("cpu"), str(tmp_path), clock)
    c = fits["calibration"]
    wanted = min(2 * c["write_s"], 64 * c["micro_step_s"])  # an iteration >= two writes, at most 64 micro-batches
    assert fits["accum"] >= 1 and fits["accum"] * c["micro_step_s"] >= wanted * 0.999
    clock.part_deadline = 0.0  # out of time
    big = g.part_train(plan, "big", torch.device("cpu"), str(tmp_path), clock)
    assert {k: len(v) for k, v in big["runs"].items()} == {"none": 1, "overlap": 1, "snapshot": 1, "sync": 1, "dcp": 1,
                                                          "torch.save": 0}
    assert clock.cut == ["train big: torch.save round 1 skipped"]
    assert os.listdir(tmp_path) == []
