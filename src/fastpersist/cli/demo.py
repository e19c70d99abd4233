"""``fastpersist demo``: per-iteration checkpointing of a small GPT and a small mixture of experts.

Part 1 trains each model on synthetic data on the CPU and prints the mean iteration time with no
checkpoint, with ``torch.save`` (+fsync) every iteration, and with fastpersist in each mode
(checkpoint every iteration), with the overhead and the time training was blocked per save.

Part 2 runs the training in a subprocess, kills it with SIGKILL while a checkpoint is being
written, resumes from the latest committed checkpoint and compares the losses with an
uninterrupted run: they continue exactly.

``fastpersist demo train ...`` is the training loop the second part runs (also usable alone).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, cast

import torch
from torch import nn

from fastpersist.checkpointer import Checkpointer
from fastpersist.io.backend import FileBackend
from fastpersist.state import RNGState

# ------------------------------------------------------------------------------- the models


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, experts: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.experts = experts
        self.mlp: nn.Module
        if experts:
            self.router = nn.Linear(d, experts)
            self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                     for _ in range(experts))
        else:
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = self.ln2(x)
        if not self.experts:
            return x + self.mlp(h)
        gate = self.router(h).softmax(-1)  # top-1 routing
        weight, choice = gate.max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(cast(nn.ModuleList, self.mlp)):
            sel = choice == e
            if sel.any():
                out[sel] = expert(h[sel]) * weight[sel].unsqueeze(-1)
        return x + out


class TinyGPT(nn.Module):
    """A GPT-like decoder; ``experts > 0`` makes every MLP a top-1 mixture of experts."""

    def __init__(self, vocab: int = 2048, d: int = 192, layers: int = 4, heads: int = 4, seq: int = 128,
                 experts: int = 0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads, experts) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))  # changes in forward

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        x = self.tok(idx) + self.pos(torch.arange(t))
        for b in self.blocks:
            x = b(x, mask)
        if self.training:
            cast(torch.Tensor, self.tokens_seen).add_(idx.numel())
        return self.head(self.ln(x))


class SyntheticData:
    """Batches of random tokens, reproducible from (seed, position); position is its state."""

    def __init__(self, vocab: int, batch: int, seq: int, seed: int = 1234) -> None:
        self.vocab, self.batch, self.seq, self.seed = vocab, batch, seq, seed
        self.position = 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        return torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


BATCH = 16  # sized so that one checkpoint write takes well under half an iteration's compute


def build(kind: str, seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer, SyntheticData]:
    torch.manual_seed(seed)
    model = TinyGPT(experts=4 if kind == "moe" else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, SyntheticData(2048, BATCH, 128)


def train_step(model: TinyGPT, opt: torch.optim.Optimizer, data: SyntheticData) -> float:
    batch = data.next()
    logits = model(batch[:, :-1])
    noise = torch.randn(()) * 1e-9  # consumes the RNG, so a wrongly restored RNG shows in the loss
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)) + noise
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    n += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return n


class SlowBackend(FileBackend):
    """Real files, each write request delayed (to make a checkpoint write last long)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        time.sleep(self.delay_s)


# ------------------------------------------------------------------------------- part 1


def _fsync_save(obj: Any, path: str) -> None:
    torch.save(obj, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _run_mode(kind: str, mode: str, iters: int, warmup: int, workdir: str) -> dict[str, float]:
    model, opt, data = build(kind)
    ck = None
    if mode not in ("none", "torch.save"):
        ck = Checkpointer(os.path.join(workdir, f"{kind}-{mode}"), mode=mode, keep=2)
        if mode == "overlap":
            ck.protect(opt)
    times, blocked = [], []
    for it in range(warmup + iters):
        t0 = time.perf_counter()
        train_step(model, opt, data)
        t1 = time.perf_counter()
        state = {"model": model, "optim": opt, "data": data, "step": it}
        if mode == "torch.save":
            _fsync_save({"model": model.state_dict(), "optim": opt.state_dict(), "step": it},
                        os.path.join(workdir, f"{kind}-torch.pt"))
        elif ck is not None:
            ck.save(it, state, rank_state={"rng": RNGState()})
        t2 = time.perf_counter()
        if it >= warmup:
            times.append(t2 - t0)
            if mode != "none":
                blocked.append(t2 - t1)
    out = {"iter": statistics.mean(times), "iter_sd": statistics.pstdev(times)}
    if ck is not None:
        ck.close()
        hist = [m for m in ck.history if m.step >= warmup and not m.skipped]
        out["blocked_ms"] = statistics.median(m.blocked_s for m in hist) * 1e3
        out["copied_mb"] = statistics.median(m.bytes_copied for m in hist) / 1e6
        out["write_ms"] = statistics.median(m.write_s for m in hist) * 1e3
        out["arena_mb"] = ck.snapshot_memory / 1e6
    elif blocked:
        out["blocked_ms"] = statistics.median(blocked) * 1e3
    return out


def part_overhead(args: argparse.Namespace, workdir: str) -> None:
    modes = ["none", "torch.save", "sync", "snapshot", "overlap"]
    for kind in ("gpt", "moe"):
        model, opt, data = build(kind)
        train_step(model, opt, data)
        nparams = sum(p.numel() for p in model.parameters())
        print(f"\n## {kind}: {nparams / 1e6:.1f} M parameters, checkpoint {state_bytes(model, opt) / 1e6:.0f} MB "
              f"(weights + AdamW moments), batch {BATCH} x 128 tokens, training threads: {torch.get_num_threads()}", flush=True)
        results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for r in range(args.rounds):  # modes alternate, so a noisy moment does not hit one mode
            for mode in modes if r % 2 == 0 else list(reversed(modes)):
                print(f"  round {r + 1}/{args.rounds}: {mode} ...", end="\r", flush=True)
                results[mode].append(_run_mode(kind, mode, args.iters, args.warmup, workdir))
        base = statistics.median(x["iter"] for x in results["none"])
        print("\n| checkpoint every iteration | mean iteration (ms) | overhead | blocked per save (ms) | "
              "copied at save (MB) | snapshot memory (MB) | background write (ms) |")
        print("|---|---|---|---|---|---|---|")
        for mode in modes:
            rs = results[mode]
            it = statistics.median(x["iter"] for x in rs)
            label = {"none": "no checkpoint", "torch.save": "torch.save + fsync"}.get(mode, f"fastpersist {mode}")

            def col(key: str, rs: list[dict[str, float]] = rs) -> str:
                return f"{statistics.median(x[key] for x in rs):.1f}" if key in rs[0] else "-"

            print(f"| {label} | {it * 1e3:.1f} | {'-' if mode == 'none' else f'{(it / base - 1) * 100:+.1f}%'} | "
                  f"{col('blocked_ms')} | {col('copied_mb')} | {col('arena_mb')} | {col('write_ms')} |", flush=True)


# ------------------------------------------------------------------------------- part 2


def train_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fastpersist demo train")
    p.add_argument("--dir", required=True)
    p.add_argument("--kind", default="gpt", choices=["gpt", "moe"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--mode", default="overlap", choices=["sync", "snapshot", "overlap", "none"])
    p.add_argument("--resume", action="store_true")
    p.add_argument("--slow-write-ms", type=float, default=0.0, help="delay every write request (to crash mid-write)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # bit-reproducible losses across runs
    model, opt, data = build(args.kind)
    rng = RNGState()
    start = 0
    ck = None
    if args.mode != "none":
        backend = SlowBackend(args.slow_write_ms / 1e3) if args.slow_write_ms else None
        ck = Checkpointer(args.dir, mode=args.mode, keep=2, backend=backend)
        if args.mode == "overlap":
            ck.protect(opt)
        if args.resume and ck.latest_step() is not None:
            state = ck.load("latest", into={"model": model, "optim": opt, "data": data})
            ck.load_rank_state(into={"rng": rng})
            start = int(state["step"]) + 1
            print(f"resumed from step {state['step']}", flush=True)
    for step in range(start, args.steps):
        loss = train_step(model, opt, data)
        print(f"step {step} loss {loss:.9f}", flush=True)
        if ck is not None:
            ck.save(step, {"model": model, "optim": opt, "data": data, "step": step}, rank_state={"rng": rng})
    if ck is not None:
        ck.close()
    return 0


def _losses(lines: list[str]) -> dict[int, str]:
    out = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and parts[0] == "step" and parts[2] == "loss":
            out[int(parts[1])] = parts[3]
    return out


def _train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fastpersist.cli.demo", "train", *args]


def _in_progress(run_dir: str) -> list[str]:
    """Checkpoint directories holding data but no manifest: saves being written."""
    out = []
    for n in os.listdir(run_dir):
        d = os.path.join(run_dir, n)
        if n.startswith("step-") and os.path.isdir(d) and not os.path.exists(os.path.join(d, "manifest.json")):
            if any(f.endswith(".bin") for f in os.listdir(d)):
                out.append(n)
    return out


def _wait_for_a_write(run_dir: str, step: int, timeout: float) -> None:
    """Until a checkpoint of ``step`` or later is being written (its data files exist, its
    manifest does not): the instant to kill. Polls; gives up after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(int(n.split("-")[1]) >= step for n in _in_progress(run_dir)):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.002)


def crash_and_resume(directory: str, steps: int = 24, kill_after: int = 10, slow_ms: float = 20.0,
                     kind: str = "gpt") -> dict[str, Any]:
    """Kill a training run with SIGKILL during a checkpoint write, resume it, compare losses.

    Returns the losses of the reference run, the killed run and the resumed run, whether the
    kill hit a write in progress, and the step the run resumed from.
    """
    ref = subprocess.run(_train_cmd("--dir", os.path.join(directory, "ref"), "--kind", kind, "--steps", str(steps),
                                    "--mode", "none"), capture_output=True, text=True, check=True)
    reference = _losses(ref.stdout.splitlines())
    run_dir = os.path.join(directory, "run")
    proc = subprocess.Popen(_train_cmd("--dir", run_dir, "--kind", kind, "--steps", str(steps), "--mode", "overlap",
                                       "--slow-write-ms", str(slow_ms)), stdout=subprocess.PIPE, text=True)
    killed_lines = []
    for line in proc.stdout or ():
        killed_lines.append(line)
        if line.startswith(f"step {kill_after} "):
            _wait_for_a_write(run_dir, kill_after, timeout=30.0)  # a checkpoint's data is being written
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    in_progress = _in_progress(run_dir)
    resumed = subprocess.run(_train_cmd("--dir", run_dir, "--kind", kind, "--steps", str(steps), "--mode", "overlap",
                                        "--resume"), capture_output=True, text=True, check=True)
    lines = resumed.stdout.splitlines()
    start = next((int(x.split()[-1]) for x in lines if x.startswith("resumed from step")), None)
    return {"reference": reference, "killed": _losses(killed_lines), "resumed": _losses(lines),
            "resumed_from": start, "killed_mid_write": bool(in_progress), "returncode": proc.returncode}


def part_crash(args: argparse.Namespace, workdir: str) -> bool:
    print("\n## Crash and resume: SIGKILL during a checkpoint write, then resume from the latest committed one",
          flush=True)
    r = crash_and_resume(os.path.join(workdir, "crash"))
    ref, resumed = r["reference"], r["resumed"]
    same = bool(resumed) and all(resumed[s] == ref[s] for s in resumed)
    print(f"killed with SIGKILL (exit {r['returncode']}) after step {max(r['killed'])}, "
          f"{'while a checkpoint was being written' if r['killed_mid_write'] else 'between writes'}; "
          f"resumed from committed step {r['resumed_from']}")
    print("\n| step | uninterrupted loss | resumed loss | same |\n|---|---|---|---|")
    for s in sorted(resumed)[:6]:
        print(f"| {s} | {ref[s]} | {resumed[s]} | {'yes' if resumed[s] == ref[s] else 'NO'} |")
    print(f"\nall {len(resumed)} resumed losses equal the uninterrupted run's, bit for bit: {'yes' if same else 'NO'}")
    return same


def main(argv: list[str]) -> int:
    if argv and argv[0] == "train":
        return train_main(argv[1:])
    p = argparse.ArgumentParser(prog="fastpersist demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=15, help="measured iterations per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="runs of every mode (alternating order)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--threads", type=int, default=1,
                   help="training's intra-op threads (default 1: leaves a core for I/O, as a GPU job leaves "
                        "its CPU cores; with every core computing, any I/O competes with training)")
    p.add_argument("--skip-crash", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="fastpersist-demo-", dir=args.dir)
    print(f"# fastpersist demo: checkpoint every iteration ({os.cpu_count()} cores, torch {torch.__version__}, "
          f"checkpoints in {workdir})", flush=True)
    try:
        part_overhead(args, workdir)
        ok = True if args.skip_crash else part_crash(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
