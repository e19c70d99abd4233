"""The prepared GPU run: fastpersist's GPU path measured on a GPU, in one script of a few minutes.

Parts (each writes a section of ``results.json`` and ``results.md`` in ``--out``):

1. **machine**: GPU, driver, CUDA, CPU cores, memory, the filesystem, and the device's sequential
   O_DIRECT write and read (fio, installed if absent and possible; else a raw O_DIRECT probe);
2. **d2h**: device-to-host copy bandwidth into page-locked (fastpersist's staging, torch's
   ``pin_memory``) and pageable memory, and through fastpersist's side-stream copy;
3. **save**: ``fastpersist.save`` of a GPU state (model + Adam moments) against
   ``torch.save`` + fsync and DCP ``FileSystemWriter`` (durable), as ratios to the device's
   write, contenders rotating round by round;
4. **train**: GPT-like models trained on the GPU (bf16 autocast, fp32 AdamW) with a checkpoint
   every iteration: one whose checkpoint write fits within an iteration (gradient accumulation
   is calibrated so that it does), one of about 1 B parameters where it does not
   (back-pressure). Iteration time with no checkpoint, ``torch.save``, DCP ``async_save`` and
   fastpersist sync/snapshot/overlap, interleaved, median [min-max]; time blocked per save;
   peak host RSS and GPU memory;
5. **crash**: a run killed with SIGKILL during a checkpoint write (the run stalls inside the write
   and signals it; the kill follows the signal) and resumed; its losses are compared, bit for
   bit, with an uninterrupted run's (deterministic algorithms on).

Without CUDA every part runs on the CPU (the d2h rows become host copies), so the script itself
is tested on machines without a GPU. ``--smoke`` runs every part on a tiny state (under 30 s);
run it first. The full run keeps to ``--budget-s`` (default 330 s): a part that runs out of its
share stops after the round in progress and says so in the output.

    PYTHONPATH=src python benchmarks/gpu_check.py --smoke --out /tmp/gpu-smoke
    PYTHONPATH=src python benchmarks/gpu_check.py --out /tmp/gpu-full   # or: fastpersist bench --gpu ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

import fastpersist as fp
from _bench.crash import crash_and_resume
from _bench.measure import GB, GiB, MiB, PeakRSS, device_probe, filesystem, remove
from _bench.models import GPT, ModelSpec, build, params_and_state_bytes, train_step
from _bench.savers import FastpersistSaver, make_saver, save_dcp, save_torch
from _bench.state import gpt_state, tensor_bytes
from _bench.stats import median_spread
from fastpersist.checkpointer import Checkpointer
from fastpersist.io.buffers import aligned_empty, copy_to_host, memory_view


# ------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    smoke: bool
    probe_bytes: int
    d2h_bytes: int
    d2h_reps: int
    save_gib: tuple[float, ...]
    save_rounds: tuple[int, ...]
    settle_s: float
    fits: ModelSpec
    big: ModelSpec
    train_warmup: int
    train_iters: tuple[int, int]  # measured iterations: (fits, big)
    train_rounds: tuple[int, int]
    crash: ModelSpec
    crash_steps: int
    crash_kill_after: int  # killed while this step's checkpoint is being written
    shares: dict[str, float]  # fraction of the budget per part


FULL = Plan(
    smoke=False, probe_bytes=4 * GiB, d2h_bytes=1 * GiB, d2h_reps=5,
    save_gib=(2.0, 8.0), save_rounds=(3, 2), settle_s=1.0,
    fits=ModelSpec("GPT fits", vocab=8192, d=512, layers=8, heads=8, seq=1024, batch=16),
    big=ModelSpec("GPT 1B", vocab=32768, d=2048, layers=18, heads=16, seq=1024, batch=4),
    train_warmup=1, train_iters=(6, 2), train_rounds=(2, 1),
    crash=ModelSpec("GPT crash", vocab=4096, d=256, layers=4, heads=4, seq=256, batch=8, dropout=0.1),
    crash_steps=12, crash_kill_after=5,
    shares={"machine": 0.08, "d2h": 0.03, "save": 0.32, "train fits": 0.17, "train big": 0.30, "crash": 0.10},
)

SMOKE = Plan(
    smoke=True, probe_bytes=8 * MiB, d2h_bytes=4 * MiB, d2h_reps=2,
    save_gib=(0.004,), save_rounds=(1,), settle_s=0.0,
    fits=ModelSpec("GPT fits (smoke)", vocab=256, d=32, layers=2, heads=2, seq=32, batch=4),
    big=ModelSpec("GPT big (smoke)", vocab=512, d=64, layers=2, heads=2, seq=32, batch=2),
    train_warmup=1, train_iters=(2, 1), train_rounds=(1, 1),
    crash=ModelSpec("GPT crash (smoke)", vocab=256, d=32, layers=2, heads=2, seq=32, batch=4, dropout=0.1),
    crash_steps=6, crash_kill_after=2,
    shares={"machine": 0.1, "d2h": 0.05, "save": 0.2, "train fits": 0.2, "train big": 0.2, "crash": 0.25},
)


class Clock:
    """The run's time budget, shared out between parts."""

    def __init__(self, budget_s: float, shares: dict[str, float]) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.shares = shares
        self.part_deadline = self.start + budget_s
        self.cut: list[str] = []

    def begin(self, part: str) -> None:
        left = self.budget_s - (time.monotonic() - self.start)
        self.part_deadline = time.monotonic() + max(0.0, min(left, self.budget_s * self.shares.get(part, 0.1)))

    def over(self) -> bool:
        return time.monotonic() > self.part_deadline

    def note_cut(self, what: str) -> None:
        self.cut.append(what)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------- 1. machine


def ensure_fio(allow_install: bool) -> str:
    if shutil.which("fio"):
        return "present"
    if not allow_install or not shutil.which("apt-get") or os.geteuid() != 0:
        return "absent (raw O_DIRECT probe used)"
    try:
        r = subprocess.run(["apt-get", "install", "-y", "-q", "-o", "Acquire::Retries=0",
                            "-o", "Acquire::http::Timeout=5", "fio"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "absent: apt-get install timed out (raw O_DIRECT probe used)"
    return "installed now" if r.returncode == 0 and shutil.which("fio") else "absent: install failed (raw probe used)"


def _gpu_facts() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"gpu": "none (CUDA not available: every part ran on the CPU)"}
    props = torch.cuda.get_device_properties(0)
    driver = "?"
    if shutil.which("nvidia-smi"):
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=15).stdout.strip().splitlines()[0]
        except (subprocess.SubprocessError, IndexError):
            pass
    return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / GiB, 1), "gpus": torch.cuda.device_count(),
            "driver": driver, "cuda": torch.version.cuda}


def part_machine(plan: Plan, workdir: str, allow_install: bool) -> dict[str, Any]:
    facts: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu_cores": os.cpu_count(),
                             "arch": platform.machine(), "kernel": platform.release(), "torch": torch.__version__,
                             "python": platform.python_version()}
    facts.update(_gpu_facts())
    with open("/proc/meminfo") as f:
        facts["host_memory_gib"] = round(int(f.readline().split()[1]) * 1024 / GiB, 1)
    facts["filesystem"] = filesystem(workdir)
    facts["fio"] = ensure_fio(allow_install)
    path = os.path.join(workdir, "probe.bin")
    s, w, note = device_probe(path, "write", plan.probe_bytes)
    _, r, _ = device_probe(path, "read", plan.probe_bytes)
    os.unlink(path)
    facts["device_write_gbps"], facts["device_read_gbps"] = round(w, 3), round(r, 3)
    facts["device_probe"] = f"{note}, {plan.probe_bytes / GiB:g} GiB, fsync'd"
    return facts


# ------------------------------------------------------------------------------- 2. d2h


def _time_copy(copy: Callable[[], None], device: torch.device, reps: int) -> list[float]:
    copy()  # warm-up (first touch, registration)
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def copy() -> None:
        dst.copy_(src)

    return copy


def part_d2h(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    n = plan.d2h_bytes
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    rows: list[tuple[str, torch.Tensor]] = [("pageable (torch.empty)", torch.empty(n, dtype=torch.uint8))]
    if device.type == "cuda":
        rows.insert(0, ("page-locked, fastpersist staging (cudaHostRegister)", aligned_empty(n, pin=True)))
        rows.insert(1, ("page-locked, torch pin_memory", torch.empty(n, dtype=torch.uint8, pin_memory=True)))
    out = []
    for name, dst in rows:
        secs = _time_copy(_copier(dst, src), device, plan.d2h_reps)
        out.append({"target": name, "gbps": [n / s / GB for s in secs]})
    staging = aligned_empty(n)
    view = memory_view(staging.data_ptr(), n)
    step = min(n, 32 * MiB)

    def chunked() -> None:  # what the writer does: one side-stream copy per staged chunk
        for off in range(0, n, step):
            copy_to_host(view[off : off + step], src[off : off + step])

    secs = _time_copy(chunked, device, plan.d2h_reps)
    out.append({"target": f"fastpersist copy_to_host, {step // MiB} MiB per copy (side stream)",
                "gbps": [n / s / GB for s in secs]})
    if not torch.equal(staging[: min(n, 1 << 20)].to(device), src[: min(n, 1 << 20)]):
        raise RuntimeError("copy_to_host returned different bytes")
    return out


# ------------------------------------------------------------------------------- 3. save


def part_save(plan: Plan, device: torch.device, workdir: str, clock: Clock) -> list[dict[str, Any]]:
    results = []
    for gib, rounds in zip(plan.save_gib, plan.save_rounds):
        if clock.over():
            clock.note_cut(f"save: {gib:g} GiB not run")
            continue
        state = gpt_state(gib, device=device, max_d=2048, max_layers=32)
        _sync(device)
        payload = tensor_bytes(state)
        probe = min(plan.probe_bytes, max(64 * MiB, payload - payload % MiB))
        paths = {"torch": os.path.join(workdir, "t.pt"), "dcp": os.path.join(workdir, "dcp"),
                 "fp": os.path.join(workdir, "f.pt"), "fio": os.path.join(workdir, "fio.bin")}
        contenders: list[tuple[str, str, Callable[[], None]]] = [
            ("device write (O_DIRECT)", "fio", lambda: None),
            ("torch.save+fsync", "torch", lambda: save_torch(state, paths["torch"])),
            ("DCP FileSystemWriter t4 (sync_files)", "dcp", lambda: save_dcp(state, paths["dcp"], threads=4)),
            ("fastpersist.save", "fp", lambda: fp.save(state, paths["fp"])),
        ]
        series: dict[str, dict[str, list[float]]] = {c[0]: {"gbps": [], "rss_mib": []} for c in contenders}
        probe_note = ""
        for r in range(rounds):
            if r and clock.over():
                clock.note_cut(f"save {gib:g} GiB: {r} of {rounds} rounds")
                break
            k = r % len(contenders)  # rotate: no contender always first (after idle) or last
            for name, key, fn in contenders[k:] + contenders[:k]:
                os.sync()
                time.sleep(plan.settle_s)  # the disk idle, the previous output's blocks freed
                with PeakRSS() as rss:
                    if key == "fio":
                        _, gbps, probe_note = device_probe(paths["fio"], "write", probe)
                    else:
                        t0 = time.perf_counter()
                        fn()
                        gbps = payload / (time.perf_counter() - t0) / GB
                series[name]["gbps"].append(gbps)
                series[name]["rss_mib"].append(rss.mib)
                if key == "fp" and r == 0:
                    _check_loads_back(paths["fp"], state)
                remove(paths[key])  # one output on disk at a time (8 GiB states, a 64 GiB disk)
        results.append({"gib": gib, "payload_gb": payload / GB, "device": str(device), "series": series,
                        "probe": f"{probe_note}, {probe / GiB:g} GiB"})
        del state
        _empty_cache(device)
    return results


def _check_loads_back(path: str, state: dict[str, Any]) -> None:
    """The file fastpersist.save wrote from the GPU loads back equal (a few tensors compared)."""
    got = fp.load(path, map_location="cpu")
    for key in list(state["model"])[:3] + list(state["model"])[-2:]:
        if not torch.equal(got["model"][key], state["model"][key].cpu()):
            raise RuntimeError(f"fastpersist.save of the GPU state did not load back equal: model.{key}")
    if not torch.equal(got["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"].cpu()):
        raise RuntimeError("fastpersist.save of the GPU state did not load back equal: optim.state.0.exp_avg")


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------- 4. train


def _snapshot_budget(state_bytes: int) -> int:
    with open("/proc/meminfo") as f:
        host = int(f.readline().split()[1]) * 1024
    return int(max(2 * GiB, min(1.2 * state_bytes, host // 4)))


def run_contender(kind: str, spec: ModelSpec, accum: int, warmup: int, iters: int, workdir: str,
                  device: torch.device) -> dict[str, Any]:
    model, opt, data = build(spec, device)
    _, state_bytes = params_and_state_bytes(model)
    sub = tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir)
    saver = make_saver(kind, sub, opt, keep=1, snapshot_bytes=_snapshot_budget(state_bytes))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, walls = [], []
    try:
        with PeakRSS() as rss:
            prev = time.perf_counter()
            for it in range(warmup + iters):
                train_step(model, opt, data, accum)
                walls.append(saver.save(it, model, opt, data))
                now = time.perf_counter()
                if it >= warmup:
                    times.append(now - prev)
                prev = now
            saver.close()
    finally:
        shutil.rmtree(sub, ignore_errors=True)
    blocked = saver.blocked() or walls
    out = {"contender": saver.name, "iter_s": times, "blocked_s": blocked[warmup:] if kind != "none" else [],
           "peak_rss_mib": rss.mib, "peak_gpu_gib": (torch.cuda.max_memory_allocated(device) / GiB
                                                    if device.type == "cuda" else None)}
    if isinstance(saver, FastpersistSaver):
        hist = [m for m in saver.ck.history if not m.skipped][warmup:]
        out["write_s"] = [m.write_s for m in hist]
        out["copied_mb"] = [m.bytes_copied / 1e6 for m in hist]
        out["snapshot_gib"] = saver.ck.snapshot_memory / GiB
    del model, opt
    _empty_cache(device)
    return out


# torch.save last: where the budget runs out (the 1 B model), it is the one left out.
CONTENDERS = ("none", "overlap", "snapshot", "sync", "dcp", "torch.save")


def calibrate_accum(spec: ModelSpec, device: torch.device, workdir: str, smoke: bool) -> tuple[int, dict[str, float]]:
    """Micro-batches per iteration so that one checkpoint write takes at most half an iteration."""
    if smoke:
        return 1, {}
    model, opt, data = build(spec, device)
    train_step(model, opt, data)
    t0 = time.perf_counter()
    for _ in range(3):
        train_step(model, opt, data)
    step_s = (time.perf_counter() - t0) / 3
    sub = tempfile.mkdtemp(prefix="calibrate-", dir=workdir)
    try:
        with Checkpointer(sub, mode="sync") as ck:
            ck.save(0, {"model": model, "optim": opt})
            t0 = time.perf_counter()
            ck.save(1, {"model": model, "optim": opt})
            write_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(sub, ignore_errors=True)
    del model, opt
    _empty_cache(device)
    return max(1, min(64, math.ceil(2 * write_s / step_s))), {"micro_step_s": step_s, "write_s": write_s}


def part_train(plan: Plan, which: str, device: torch.device, workdir: str, clock: Clock) -> dict[str, Any]:
    spec = plan.fits if which == "fits" else plan.big
    index = 0 if which == "fits" else 1
    accum, calib = calibrate_accum(spec, device, workdir, plan.smoke) if which == "fits" else (1, {})
    with torch.device("meta"):  # sizes only: no memory, no initialisation
        nparams, state_bytes = params_and_state_bytes(GPT(spec))
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in CONTENDERS}
    rounds = plan.train_rounds[index]
    for r in range(rounds):
        order = CONTENDERS if r % 2 == 0 else tuple(reversed(CONTENDERS))
        for kind in order:
            # Out of time: every contender still gets one run, except torch.save on the 1 B model
            # (the slowest by far, and the least needed: the save part measures it).
            if clock.over() and (runs[kind] or (which == "big" and kind == "torch.save")):
                clock.note_cut(f"train {which}: {kind} round {r + 1} skipped")
                continue
            runs[kind].append(run_contender(kind, spec, accum, plan.train_warmup, plan.train_iters[index], workdir,
                                            device))
    return {"model": asdict(spec), "params": nparams, "checkpoint_gb": state_bytes / GB, "accum": accum,
            "calibration": calib, "runs": runs, "device": str(device)}


# ------------------------------------------------------------------------------- 5. crash


def part_crash(plan: Plan, workdir: str) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    r = crash_and_resume(os.path.join(workdir, "crash"), spec=plan.crash, steps=plan.crash_steps,
                         kill_after=plan.crash_kill_after, device=device, timeout_s=300)
    reference, got = r["reference"], r["resumed"]
    return {"model": asdict(plan.crash), "returncode": r["returncode"], "killed_after_step": plan.crash_kill_after,
            "killed_mid_write": r["killed_mid_write"], "resumed_from": r["resumed_from"], "reference": reference,
            "resumed": got, "equal": bool(got) and all(got[s] == reference.get(s) for s in got)}


# ------------------------------------------------------------------------------- report


def _md_machine(f: dict[str, Any]) -> list[str]:
    lines = ["## Machine", "", "| fact | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in f.items()]
    return lines


def _md_d2h(rows: list[dict[str, Any]], n: int, device: str) -> list[str]:
    lines = ["## Device-to-host copy", "", f"{n / MiB:g} MiB from {device}; GB/s median [min-max].", "",
             "| into | GB/s |", "|---|---|"]
    lines += [f"| {r['target']} | {median_spread(r['gbps'])} |" for r in rows]
    return lines


def _md_save(results: list[dict[str, Any]], facts: dict[str, Any]) -> list[str]:
    lines = ["## Save of a GPU state", ""]
    for res in results:
        ser = res["series"]
        lines += [f"### {res['gib']:g} GiB state on {res['device']} ({res['payload_gb']:.2f} GB of tensors), "
                  f"rounds={len(next(iter(ser.values()))['gbps'])}", "", f"Device write: {res.get('probe', '')}.", "",
                  "| contender | GB/s median [min-max] | peak RSS over start, MiB |", "|---|---|---|"]
        lines += [f"| {n} | {median_spread(s['gbps'])} | {median_spread(s['rss_mib'], 0)} |" for n, s in ser.items()]
        med = {n: statistics.median(s["gbps"]) for n, s in ser.items() if s["gbps"]}
        fps = med.get("fastpersist.save")
        if fps:
            lines += ["", "| ratio (medians, this run) | value |", "|---|---|"]
            lines += [f"| fastpersist.save / {n} | {fps / v:.2f} |" for n, v in med.items() if n != "fastpersist.save"]
        lines.append("")
    return lines


def _md_train(res: dict[str, Any]) -> list[str]:
    m = res["model"]
    calib = res["calibration"]
    lines = [f"### {m['name']}: {res['params'] / 1e6:.1f} M parameters, checkpoint {res['checkpoint_gb']:.2f} GB "
             f"(fp32 weights + AdamW moments), batch {m['batch']} x {m['seq']} x {res['accum']} micro-batches, "
             f"on {res['device']}", ""]
    if calib:
        lines += [f"Calibration: micro-batch {calib['micro_step_s'] * 1e3:.1f} ms, one sync checkpoint "
                  f"{calib['write_s'] * 1e3:.1f} ms.", ""]
    lines += ["| checkpoint every iteration | iteration ms median [min-max] | overhead | blocked per save ms | "
              "background write ms | peak RSS over start MiB | peak GPU GiB |", "|---|---|---|---|---|---|---|"]
    base_runs = res["runs"]["none"]
    base = statistics.median([t for r in base_runs for t in r["iter_s"]]) if base_runs else None
    for kind, runs in res["runs"].items():
        if not runs:
            continue
        it = [t * 1e3 for r in runs for t in r["iter_s"]]
        bl = [b * 1e3 for r in runs for b in r["blocked_s"]]
        wr = [w * 1e3 for r in runs for w in r.get("write_s", [])]
        over = "-" if kind == "none" or not base else f"{(statistics.median(it) / 1e3 / base - 1) * 100:+.1f}%"
        gpu = runs[0]["peak_gpu_gib"]
        lines.append(f"| {runs[0]['contender']} | {median_spread(it, 1)} | {over} | {median_spread(bl, 1)} | "
                     f"{median_spread(wr, 1)} | {median_spread([r['peak_rss_mib'] for r in runs], 0)} | "
                     f"{'-' if gpu is None else f'{gpu:.1f}'} |")
    return lines + [""]


def _md_crash(c: dict[str, Any]) -> list[str]:
    lines = ["## Crash and resume", "",
             f"Killed with SIGKILL (exit {c['returncode']}) after step {c['killed_after_step']}, "
             f"{'while a checkpoint was being written' if c['killed_mid_write'] else 'NOT during a write'}; resumed "
             f"from committed step {c['resumed_from']}; deterministic algorithms on.", "",
             "| step | uninterrupted loss | resumed loss | same |", "|---|---|---|---|"]
    for s in sorted(c["resumed"]):
        ref, got = c["reference"].get(s), c["resumed"][s]
        lines.append(f"| {s} | {ref} | {got} | {'yes' if ref == got else 'NO'} |")
    lines += ["", f"All {len(c['resumed'])} resumed losses equal the uninterrupted run's, bit for bit: "
              f"{'yes' if c['equal'] else 'NO'}"]
    return lines


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 13's targets, checked against this run's medians."""
    out = []
    for res in report.get("save", []):
        med = {n: statistics.median(s["gbps"]) for n, s in res["series"].items() if s["gbps"]}
        fps = med.get("fastpersist.save")
        dev, tsave = med.get("device write (O_DIRECT)"), med.get("torch.save+fsync")
        if fps and dev:
            out.append({"target": f"{res['gib']:g} GiB save >= 0.9 x device write", "value": fps / dev,
                        "met": fps / dev >= 0.9})
        if fps and tsave:
            out.append({"target": f"{res['gib']:g} GiB save >= 3 x torch.save+fsync", "value": fps / tsave,
                        "met": fps / tsave >= 3})
    fits = report.get("train", {}).get("fits")
    if fits and fits["runs"]["overlap"] and fits["runs"]["none"]:
        bl = statistics.median([b for r in fits["runs"]["overlap"] for b in r["blocked_s"]]) * 1e3
        it = statistics.median([t for r in fits["runs"]["overlap"] for t in r["iter_s"]])
        base = statistics.median([t for r in fits["runs"]["none"] for t in r["iter_s"]])
        out.append({"target": "overlap blocks <= 5 ms per save (write fits)", "value": bl, "met": bl <= 5})
        out.append({"target": "overlap costs <= 3% of iteration time (write fits)", "value": (it / base - 1) * 100,
                    "met": it / base - 1 <= 0.03})
    cfg = fp.get_config()
    pool_mib = cfg.chunk_bytes * cfg.num_buffers / MiB
    for which, res in report.get("train", {}).items():
        runs = res["runs"].get("overlap")
        if runs:  # the staging pool, plus a little for the skeleton and what nothing guards
            rss = max(r["peak_rss_mib"] for r in runs)
            out.append({"target": f"overlap host memory over start <= staging pool ({pool_mib:.0f} MiB) + 25%, "
                                  f"model {which} (MiB)", "value": rss, "met": rss <= pool_mib * 1.25})
    return out


def _md_targets(ts: list[dict[str, Any]], meaningful: bool) -> list[str]:
    lines = ["## Targets (issue 13)", ""]
    if not meaningful:
        lines += ["Not meaningful: this run was a smoke run or had no GPU. The rows only show the checks run.", ""]
    lines += ["| target | this run | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']:.2f} | {'yes' if t['met'] else 'no'} |" for t in ts]
    return lines


def markdown(report: dict[str, Any]) -> str:
    kind = "SMOKE run (tiny sizes: the figures mean nothing)" if report["smoke"] else "full run"
    date = report.get("machine", {}).get("date", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    lines = [f"# fastpersist GPU check: {kind}, {date}", ""]
    if "machine" in report:
        lines += _md_machine(report["machine"]) + [""]
    if "d2h" in report:
        lines += _md_d2h(report["d2h"], report["d2h_bytes"], report["device"]) + [""]
    if "save" in report:
        lines += _md_save(report["save"], report.get("machine", {}))
    if report["train"]:
        lines += ["## Training with a checkpoint every iteration", ""]
    for which in ("fits", "big"):
        if which in report["train"]:
            lines += _md_train(report["train"][which])
    if "crash" in report:
        lines += _md_crash(report["crash"]) + [""]
    lines += _md_targets(report["targets"], not report["smoke"] and report["device"].startswith("cuda")) + [""]
    for part, tb in report.get("errors", {}).items():
        lines += [f"## FAILED: {part}", "", "```", tb.rstrip(), "```", ""]
    if report["cut_short"]:
        lines += ["Cut short to keep to the time budget: " + "; ".join(report["cut_short"]), ""]
    lines.append(f"Time so far: {report['elapsed_s']:.1f} s ({report.get('part_s', {})}).")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------- main


@contextmanager
def _workdir(parent: str) -> Iterator[str]:
    os.makedirs(parent, exist_ok=True)
    d = tempfile.mkdtemp(prefix="fastpersist-gpu-check-", dir=parent)  # ours: the only thing removed
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run(plan: Plan, out: str, workdir_parent: str, budget_s: float, allow_install: bool,
        log: Callable[[str], None]) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    clock = Clock(budget_s, plan.shares)
    report: dict[str, Any] = {"smoke": plan.smoke, "device": str(device), "d2h_bytes": plan.d2h_bytes, "train": {}}
    os.makedirs(out, exist_ok=True)
    with _workdir(workdir_parent) as work:
        steps: list[tuple[str, Callable[[], None]]] = [
            ("machine", lambda: report.__setitem__("machine", part_machine(plan, work, allow_install))),
            ("d2h", lambda: report.__setitem__("d2h", part_d2h(plan, device))),
            ("save", lambda: report.__setitem__("save", part_save(plan, device, work, clock))),
            ("train fits", lambda: report["train"].__setitem__("fits", part_train(plan, "fits", device, work, clock))),
            ("train big", lambda: report["train"].__setitem__("big", part_train(plan, "big", device, work, clock))),
            ("crash", lambda: report.__setitem__("crash", part_crash(plan, work))),
        ]
        for name, step in steps:
            clock.begin(name)
            t0 = time.monotonic()
            log(f"[{time.monotonic() - clock.start:6.1f} s] {name} ...")
            try:
                step()
            except Exception:  # noqa: BLE001 - one run on a lent machine: record it, go on with the next part
                report.setdefault("errors", {})[name] = traceback.format_exc()
                log(f"  {name} FAILED:\n{report['errors'][name]}")
            report.setdefault("part_s", {})[name] = round(time.monotonic() - t0, 2)
            _write(report, out, clock)  # what is done so far survives a later failure or a timeout
    return report


def _write(report: dict[str, Any], out: str, clock: Clock) -> None:
    report["targets"] = targets(report)
    report["cut_short"] = clock.cut
    report["elapsed_s"] = time.monotonic() - clock.start
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(report))


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="fastpersist bench --gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="every part on a tiny state (under 30 s); run it first")
    p.add_argument("--out", default=None, help="where results.json and results.md go (default ./gpu-check-<time>)")
    p.add_argument("--dir", default=None, help="where checkpoints are written, on the disk to measure (default: --out);"
                                               " a subdirectory of it is used and removed")
    p.add_argument("--budget-s", type=float, default=None, help="time budget (default 330 s; smoke 60 s)")
    p.add_argument("--no-install", action="store_true", help="do not try to install fio when it is absent")
    args = p.parse_args(args_in)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP, one process by design
    plan = SMOKE if args.smoke else FULL
    out = args.out or os.path.join(os.getcwd(), time.strftime("gpu-check-%Y%m%d-%H%M%S"))
    budget = args.budget_s or (60.0 if args.smoke else 330.0)
    report = run(plan, out, args.dir or out, budget, not (args.no_install or args.smoke),
                 lambda m: print(m, flush=True))
    with open(os.path.join(out, "results.md")) as f:
        print(f.read(), flush=True)
    print(f"wrote {os.path.join(out, 'results.json')} and results.md", flush=True)
    return 0 if not report.get("errors") and report.get("crash", {}).get("equal") else 1


if __name__ == "__main__":
    sys.exit(main())
