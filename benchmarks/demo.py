"""The demo (``fastpersist demo``, ``bash scripts/demo.sh``): per-iteration checkpointing of a small
GPT and a small mixture of experts.

Part 1 trains each model on synthetic data on the CPU with no checkpoint, with ``torch.save``
(+fsync) every iteration, and with fastpersist in each mode (a checkpoint every iteration). The
contenders take turns in short blocks, many rounds, so that the machine's noise falls on all of
them; it prints each one's median iteration time with its spread, the overhead against no
checkpoint with a confidence interval ("within noise" when the interval holds 0), and the time
training was blocked per save, and draws the same as a picture (``--plot``, needs matplotlib).

Part 2 runs the training in a subprocess, kills it with SIGKILL while a checkpoint is being
written (the subprocess stalls inside the write and signals it: the kill lands mid-write every
time), resumes from the latest committed checkpoint and compares the losses with an
uninterrupted run: they continue exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from _bench.crash import crash_and_resume
from _bench.models import ModelSpec, build, params_and_state_bytes, train_step
from _bench.savers import FastpersistSaver, TorchSaver, make_saver
from _bench.stats import overhead, quantile
from fastpersist.cli.progress import Progress, wanted

# ------------------------------------------------------------------------------- the models

SIZES = {
    # part 1: the model of part 2 at half its batch, so that 10 rounds fit in a few minutes on 2
    # cores (an iteration is matrix products only: about 32 GFLOP at batch 16); a checkpoint
    # write takes well under half an iteration's compute
    "small": ModelSpec(batch=8),
    "tiny": ModelSpec(vocab=128, d=32, layers=1, heads=2, seq=16, batch=2),  # tests
}
KINDS = {"gpt": "GPT", "moe": "MoE"}  # the moe has 4 experts per layer, top-1


def spec(kind: str, size: ModelSpec) -> ModelSpec:
    """The model ``kind`` (gpt or moe) at ``size``."""
    return dataclasses.replace(size, name=KINDS[kind], experts=4 if kind == "moe" else 0)


# ------------------------------------------------------------------------------- part 1
#
# Every contender trains its own copy of the model. They take turns in short blocks, round after
# round, the order rotated every round, so that a slow minute of this shared machine falls on all
# of them alike; the first round is a warm-up and is dropped. The overhead is paired by round: the
# contender's median iteration in a round over "no checkpoint"'s median in the same round.

CONTENDERS = ("none", "torch.save", "sync", "snapshot", "overlap", "overlap+process")
DEFAULT_PLOT = "fastpersist-demo.png"
SETTLE = 1  # unmeasured iterations at the start of every block (the previous contender's caches)


def label(mode: str) -> str:
    return {"none": "no checkpoint", "torch.save": "torch.save + fsync",
            "overlap+process": "fastpersist overlap, save process"}.get(mode, f"fastpersist {mode}")


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
    size: ModelSpec
    samples: dict[str, Samples]


class _Contender:
    """One contender's training run: its model, optimizer, data and saver, run in blocks."""

    def __init__(self, kind: str, mode: str, size: ModelSpec, workdir: str) -> None:
        self.model, self.opt, self.data = build(spec(kind, size))
        directory = os.path.join(workdir, f"{kind}-{mode}")
        os.makedirs(directory)
        self.saver = make_saver(mode, directory, self.opt, keep=2)
        self.step = 0

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
            self.saver.save(self.step, self.model, self.opt, self.data)
            t2 = time.perf_counter()
            if i >= SETTLE:
                times.append(t2 - t0)
                call_s.append(t2 - t1)
                steps.append(self.step)
            self.step += 1
        ck = self.saver.ck if isinstance(self.saver, FastpersistSaver) else None
        if ck is not None:
            ck.wait()
        if into is None:
            return
        into.rounds.append(times)
        if isinstance(self.saver, TorchSaver):
            into.blocked += call_s[:-1]
        elif ck is not None:
            metrics = {m.step: m for m in ck.history}
            saves = [metrics[s] for s in steps[:-1]]
            into.blocked += [m.blocked_s for m in saves]
            into.copied += [m.bytes_copied for m in saves]
            into.write += [m.write_s for m in saves]
            into.arena = max(into.arena, ck.snapshot_memory)

    def close(self) -> None:
        self.saver.close()


def rotated(items: Sequence[str], r: int) -> list[str]:
    """``items`` starting at position ``r`` (mod len): round ``r``'s order."""
    k = r % len(items)
    return [*items[k:], *items[:k]]


def measure(kind: str, size: ModelSpec, *, rounds: int, warmup: int, block: int, workdir: str,
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
        params, state_bytes = params_and_state_bytes(contenders["none"].model)
        return KindResult(kind, params, state_bytes, size, samples)
    finally:
        for c in contenders.values():
            c.close()


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
    with Progress(len(KINDS) * per_kind, "demo", enabled=wanted(args.quiet), unit="block") as bar:
        def advance(desc: str) -> None:
            bar.describe(desc)
            bar(1)

        for kind in KINDS:
            r = measure(kind, size, rounds=args.rounds, warmup=args.warmup, block=args.block, workdir=workdir,
                        advance=advance)
            print(f"\n{describe(r, torch.get_num_threads())}\n\n{table(r)}", flush=True)
            results.append(r)
    return results


def _plot(results: list[KindResult], path: str, threads: int) -> bool:
    """Draw the picture; False (with a message) when matplotlib is missing."""
    try:
        from _bench import plot  # matplotlib inside

        panels = [plot.Panel(KINDS[r.kind], {label(m): [t * 1e3 for t in r.samples[m].times] for m in CONTENDERS},
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

CRASH = ModelSpec()  # part 2's model: part 1's GPT at twice its batch
CRASH_STEPS, KILL_AFTER = 24, 10  # killed in the write of step 10's checkpoint


def part_crash(workdir: str) -> bool:
    print("\n## Crash and resume: SIGKILL during a checkpoint write, then resume from the latest committed one",
          flush=True)
    r = crash_and_resume(os.path.join(workdir, "crash"), spec=CRASH, steps=CRASH_STEPS,
                         kill_after=KILL_AFTER)
    ref, resumed = r["reference"], r["resumed"]
    same = bool(resumed) and all(resumed[s] == ref[s] for s in resumed)
    where = (f"while step {KILL_AFTER}'s checkpoint was being written" if r["killed_mid_write"]
             else "NOT during a checkpoint write")
    print(f"killed with SIGKILL (exit {r['returncode']}) {where}, after step {max(r['killed'], default=-1)} had "
          f"run; resumed from committed step {r['resumed_from']}")
    print("\n| step | uninterrupted loss | resumed loss | same |\n|---|---|---|---|")
    for s in sorted(resumed)[:6]:
        print(f"| {s} | {float.fromhex(ref[s]):.9f} | {float.fromhex(resumed[s]):.9f} | "
              f"{'yes' if resumed[s] == ref[s] else 'NO'} |")
    print(f"\nall {len(resumed)} resumed losses equal the uninterrupted run's, bit for bit: {'yes' if same else 'NO'}")
    return same and r["killed_mid_write"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
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
        ok = True if args.skip_crash else part_crash(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    explicit = any(a == "--plot" or a.startswith("--plot=") for a in argv)
    return 0 if ok and (drawn or not explicit) else 1


if __name__ == "__main__":
    sys.exit(main())
