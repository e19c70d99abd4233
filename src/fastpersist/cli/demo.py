"""``fastpersist demo``: per-iteration checkpointing of a small GPT and a small mixture of experts.

Part 1 trains each model on synthetic data on the CPU with no checkpoint, with ``torch.save``
(+fsync) every iteration, and with fastpersist in each mode (a checkpoint every iteration). The
contenders take turns in short blocks, many rounds, so that the machine's noise falls on all of
them; it prints each one's median iteration time with its spread, the overhead against no
checkpoint with a confidence interval ("within noise" when the interval holds 0), and the time
training was blocked per save, and draws the same as a picture (``--plot``, needs matplotlib).

Part 2 runs the training in a subprocess, kills it with SIGKILL while a checkpoint is being
written, resumes from the latest committed checkpoint and compares the losses with an
uninterrupted run: they continue exactly.

``fastpersist demo train ...`` is the training loop the second part runs (also usable alone).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Size:
    """A model's shape and its batch."""

    vocab: int = 2048
    d: int = 192
    layers: int = 4
    heads: int = 4
    seq: int = 128
    batch: int = BATCH


SIZES = {
    # part 1: the same model as part 2, half its batch, so that 10 rounds fit in a few minutes on
    # 2 cores (an iteration is matrix products only: about 32 GFLOP at batch 16)
    "small": Size(batch=8),
    "tiny": Size(vocab=128, d=32, layers=1, heads=2, seq=16, batch=2),  # tests
}


def build(kind: str, seed: int = 0, size: Size = Size()) -> tuple[TinyGPT, torch.optim.Optimizer, SyntheticData]:
    torch.manual_seed(seed)
    model = TinyGPT(size.vocab, size.d, size.layers, size.heads, size.seq, experts=4 if kind == "moe" else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, SyntheticData(size.vocab, size.batch, size.seq)


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
#
# Every contender trains its own copy of the model. They take turns in short blocks, round after
# round, the order rotated every round, so that a slow minute of this shared machine falls on all
# of them alike; the first round is a warm-up and is dropped. The overhead is paired by round: the
# contender's median iteration in a round over "no checkpoint"'s median in the same round.

CONTENDERS = ("none", "torch.save", "sync", "snapshot", "overlap")
DEFAULT_PLOT = "fastpersist-demo.png"
SETTLE = 1  # unmeasured iterations at the start of every block (the previous contender's caches)


def label(mode: str) -> str:
    return {"none": "no checkpoint", "torch.save": "torch.save + fsync"}.get(mode, f"fastpersist {mode}")


def _fsync_save(obj: Any, path: str) -> None:
    torch.save(obj, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Samples:
    """What one contender measured over the measured rounds."""

    mode: str
    rounds: list[list[float]] = field(default_factory=list)  # per round, its iteration times (s)
    blocked: list[float] = field(default_factory=list)  # per save, the time training was blocked (s)
    copied: list[int] = field(default_factory=list)  # per save, bytes copied at save time
    write: list[float] = field(default_factory=list)  # per save, the background write (s)
    arena: int = 0  # snapshot memory (bytes)

    @property
    def times(self) -> list[float]:
        return [t for r in self.rounds for t in r]


@dataclass
class KindResult:
    kind: str
    params: int
    state_bytes: int
    size: Size
    samples: dict[str, Samples]


class _Contender:
    """One contender's training run: its model, optimizer, data and checkpointer, run in blocks."""

    def __init__(self, kind: str, mode: str, size: Size, workdir: str) -> None:
        self.mode = mode
        self.model, self.opt, self.data = build(kind, size=size)
        self.path = os.path.join(workdir, f"{kind}-{mode}")
        self.rng = RNGState()
        self.step = 0
        self.ck: Checkpointer | None = None
        if mode not in ("none", "torch.save"):
            self.ck = Checkpointer(self.path, mode=mode, keep=2)
            if mode == "overlap":
                self.ck.protect(self.opt)

    def _save(self) -> None:
        if self.mode == "torch.save":
            _fsync_save({"model": self.model.state_dict(), "optim": self.opt.state_dict(),
                         "data": self.data.state_dict(), "step": self.step}, self.path + ".pt")
        elif self.ck is not None:
            self.ck.save(self.step, {"model": self.model, "optim": self.opt, "data": self.data, "step": self.step},
                         rank_state={"rng": self.rng})

    def block(self, measured: int, into: Samples | None) -> None:
        """Train ``SETTLE + measured`` iterations, each followed by its checkpoint; add the measured
        iterations' times and their saves' blocked times to ``into`` (None: a warm-up block).

        Waits for the writes at the end (untimed), so that none spills into the next contender's
        block. The block's last save is left out of the blocked times: in overlap mode a save
        blocks the next iteration's optimizer step, and that step is not in this block.
        """
        times, call_s, steps = [], [], []
        for i in range(SETTLE + measured):
            t0 = time.perf_counter()
            train_step(self.model, self.opt, self.data)
            t1 = time.perf_counter()
            self._save()
            t2 = time.perf_counter()
            if i >= SETTLE:
                times.append(t2 - t0)
                call_s.append(t2 - t1)
                steps.append(self.step)
            self.step += 1
        if self.ck is not None:
            self.ck.wait()
        if into is None:
            return
        into.rounds.append(times)
        if self.mode == "torch.save":
            into.blocked += call_s[:-1]
        elif self.ck is not None:
            metrics = {m.step: m for m in self.ck.history}
            saves = [metrics[s] for s in steps[:-1]]
            into.blocked += [m.blocked_s for m in saves]
            into.copied += [m.bytes_copied for m in saves]
            into.write += [m.write_s for m in saves]
            into.arena = max(into.arena, self.ck.snapshot_memory)

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()


def rotated(items: Sequence[str], r: int) -> list[str]:
    """``items`` starting at position ``r`` (mod len): round ``r``'s order."""
    k = r % len(items)
    return [*items[k:], *items[:k]]


def measure(kind: str, size: Size, *, rounds: int, warmup: int, block: int, workdir: str,
            advance: Callable[[str], None] = lambda desc: None) -> KindResult:
    """Part 1 for one model: every contender, ``warmup + rounds`` rounds of one block each."""
    contenders: dict[str, _Contender] = {}
    try:
        for mode in CONTENDERS:
            contenders[mode] = _Contender(kind, mode, size, workdir)
        samples = {mode: Samples(mode) for mode in CONTENDERS}
        for r in range(warmup + rounds):
            for mode in rotated(CONTENDERS, r):
                advance(f"{kind} round {r + 1}/{warmup + rounds} {mode}")
                contenders[mode].block(block, samples[mode] if r >= warmup else None)
        first = contenders["none"]
        params = sum(p.numel() for p in first.model.parameters())
        return KindResult(kind, params, state_bytes(first.model, first.opt), size, samples)
    finally:
        for c in contenders.values():
            c.close()


# ---------------------------------------------------------------- statistics (pure functions)


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between order statistics, as numpy's default)."""
    if not xs:
        raise ValueError("quantile of no samples")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Overhead:
    """A relative overhead (0.05 is +5%) with its confidence interval."""

    estimate: float
    low: float
    high: float

    @property
    def within_noise(self) -> bool:
        """The interval holds 0: this run cannot tell the contender from the baseline."""
        return self.low <= 0.0 <= self.high

    def __str__(self) -> str:
        ci = f"95% CI {self.low * 100:+.1f}% to {self.high * 100:+.1f}%"
        if self.within_noise:
            return f"within noise ({ci})"
        return f"{self.estimate * 100:+.1f}% ({ci})"


def overhead(base: Sequence[float], other: Sequence[float], *, level: float = 0.95, resamples: int = 4000,
             seed: int = 0) -> Overhead:
    """The overhead of ``other`` over ``base``, paired by round (``base[i]`` and ``other[i]`` were
    measured in the same round): the median of the ratios ``other[i] / base[i]``, minus 1, with a
    bootstrap percentile interval (rounds resampled with replacement; seeded, so the same samples
    give the same interval)."""
    if len(base) != len(other) or not base:
        raise ValueError(f"overhead needs paired rounds, got {len(base)} and {len(other)}")
    ratios = [o / b for o, b in zip(other, base)]
    rng = random.Random(seed)
    boot = [statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)]
    tail = (1 - level) / 2
    return Overhead(statistics.median(ratios) - 1, quantile(boot, tail) - 1, quantile(boot, 1 - tail) - 1)


def round_medians(s: Samples) -> list[float]:
    return [statistics.median(r) for r in s.rounds]


# ---------------------------------------------------------------- the table


def _ms(xs: Sequence[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f}" if xs else "-"


def table_rows(result: KindResult) -> list[list[str]]:
    """One row per contender: label, median iteration [IQR], overhead, blocked per save (median /
    p90), copied at save (MB), snapshot memory (MB), background write (ms)."""
    base = round_medians(result.samples["none"])
    rows = []
    for mode in CONTENDERS:
        s = result.samples[mode]
        t = s.times
        it = f"{statistics.median(t) * 1e3:.1f} [{quantile(t, 0.25) * 1e3:.1f}-{quantile(t, 0.75) * 1e3:.1f}]"
        over = "-" if mode == "none" else str(overhead(base, round_medians(s)))
        blocked = f"{_ms(s.blocked)} / {quantile(s.blocked, 0.9) * 1e3:.1f}" if s.blocked else "-"
        copied = f"{statistics.median(s.copied) / 1e6:.1f}" if s.copied else "-"
        arena = f"{s.arena / 1e6:.1f}" if s.copied else "-"
        rows.append([label(mode), it, over, blocked, copied, arena, _ms(s.write)])
    return rows


TABLE_HEADER = ["checkpoint every iteration", "iteration (ms): median [IQR]", "overhead vs no checkpoint",
                "blocked per save (ms): median / p90", "copied at save (MB)", "snapshot memory (MB)",
                "background write (ms)"]


def table(result: KindResult) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
    return "\n".join(lines)


def describe(result: KindResult, threads: int) -> str:
    s = result.size
    return (f"## {result.kind}: {result.params / 1e6:.1f} M parameters, checkpoint {result.state_bytes / 1e6:.0f} MB "
            f"(weights + AdamW moments), batch {s.batch} x {s.seq} tokens, training threads: {threads}")


def part_overhead(args: argparse.Namespace, workdir: str) -> list[KindResult]:
    size = SIZES[args.size]
    per_kind = (args.warmup + args.rounds) * len(CONTENDERS)
    print(f"\nEvery contender trains its own copy of the model; they take turns in blocks of {SETTLE} + "
          f"{args.block} iterations (the first not timed), the order rotated every round; {args.rounds} rounds "
          f"after {args.warmup} warm-up. Overhead: median over rounds of the contender's median iteration over "
          "no checkpoint's in the same round, with a 95% bootstrap interval.", flush=True)
    results = []
    with _progress(2 * per_kind, enabled=not args.quiet) as advance:
        for kind in ("gpt", "moe"):
            r = measure(kind, size, rounds=args.rounds, warmup=args.warmup, block=args.block, workdir=workdir,
                        advance=advance)
            print(f"\n{describe(r, torch.get_num_threads())}\n\n{table(r)}", flush=True)
            results.append(r)
    return results


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (tqdm) when stderr is a terminal and tqdm is installed."""
    bar: Any = None
    if enabled and sys.stderr.isatty():
        try:
            bar = importlib.import_module("tqdm").tqdm(total=total, file=sys.stderr, leave=False, unit="block")
        except ImportError:
            bar = None

    def advance(desc: str) -> None:
        if bar is not None:
            bar.set_description(desc, refresh=False)
            bar.update(1)

    try:
        yield advance
    finally:
        if bar is not None:
            bar.close()


def _plot(results: list[KindResult], path: str, threads: int) -> bool:
    """Draw the picture; False (with a message) when matplotlib is missing."""
    try:
        from fastpersist.cli import _plot as plot  # matplotlib inside
        panels = [plot.Panel(r.kind.upper() if r.kind == "gpt" else "MoE",
                             {label(m): [t * 1e3 for t in r.samples[m].times] for m in CONTENDERS},
                             {label(m): [b * 1e3 for b in r.samples[m].blocked] for m in CONTENDERS[1:]})
                  for r in results]
        sizes = ", ".join(f"{p.name} {r.params / 1e6:.1f} M params / {r.state_bytes / 1e6:.0f} MB checkpoint"
                          for p, r in zip(panels, results))
        title = (f"fastpersist demo: a checkpoint every iteration, CPU training ({os.cpu_count()} cores, "
                 f"{threads} training thread{'s' if threads > 1 else ''}, torch {torch.__version__})\n{sizes}")
        plot.write_plot(path, title, panels)
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("matplotlib"):
            raise
        print("\nno picture: matplotlib is not installed; install the plot extra: pip install 'fastpersist[plot]'",
              flush=True)
        return False
    print(f"\npicture: {os.path.abspath(path)}", flush=True)
    return True


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
    p.add_argument("--rounds", type=int, default=10, help="measured rounds (every contender one block each)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds, not measured")
    p.add_argument("--block", type=int, default=3,
                   help=f"measured iterations per block (after {SETTLE} untimed one); at least 2")
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="the models' size (tiny: for tests)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--threads", type=int, default=1,
                   help="training's intra-op threads, the same for every contender (default 1: leaves a core "
                        "for I/O, as a GPU job leaves its CPU cores; with every core computing, any I/O competes "
                        "with training)")
    p.add_argument("--plot", default=DEFAULT_PLOT, metavar="FILE.png",
                   help=f"where to draw the picture (default: {DEFAULT_PLOT} in the current directory; needs "
                        "matplotlib: pip install 'fastpersist[plot]')")
    p.add_argument("--no-plot", action="store_true", help="draw no picture")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--skip-crash", action="store_true", help="part 1 only")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.block < 2 or args.threads < 1:
        p.error("--rounds and --threads must be at least 1, --block at least 2, --warmup at least 0")
    torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="fastpersist-demo-", dir=args.dir)
    print(f"# fastpersist demo: checkpoint every iteration ({os.cpu_count()} cores, torch {torch.__version__}, "
          f"checkpoints in {workdir})", flush=True)
    try:
        results = part_overhead(args, workdir)
        drawn = True if args.no_plot else _plot(results, args.plot, args.threads)
        ok = True if args.skip_crash else part_crash(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    explicit = any(a == "--plot" or a.startswith("--plot=") for a in argv)
    return 0 if ok and (drawn or not explicit) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
