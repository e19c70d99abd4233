"""What the demo and the benchmarks share; not part of the installed package.

The programs in benchmarks/ (``demo.py``, ``gpu_check.py``, ``bench_single_file.py``, the other
``bench_*.py``) import from here; running ``python benchmarks/X.py`` puts benchmarks/ on the
path. Modules, each importing only those above it in this list and the library (never the
reverse: fastpersist imports nothing from benchmarks/):

- ``stats``: medians with their spread, quantiles, a paired overhead with its interval (pure);
- ``plot``: the demo's picture (matplotlib, imported when drawing);
- ``measure``: units, wall/CPU/peak-RSS timing, the page cache, the device's own speed, machine facts;
- ``state``: a GPT-like state dict of a given size, and its tensor bytes;
- ``models``: the GPT-like model (optionally a mixture of experts) that the demo and the GPU
  check train, its synthetic tokens and its training step;
- ``savers``: the baselines a save is compared with (``torch.save`` + fsync, DCP), and the ways
  a training loop checkpoints every iteration (none, ``torch.save``, DCP ``async_save``, fastpersist);
- ``crash_child``: that model's training as a program, which can stall at a chosen checkpoint write;
- ``crash``: the crash harness: run ``crash_child``, SIGKILL it mid-write, resume, compare losses;
- ``deepspeed_writer``: DeepSpeed's FastPersist writer set up as its checkpoint engine does, a
  contender of the write-path benchmark (where DeepSpeed is installed).
"""
