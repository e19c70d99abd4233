"""The ``fastpersist`` command line.

Each command lives in its own module, imported only when that command runs: ``fastpersist
--help`` and ``fastpersist --version`` import neither torch nor the library. Every command
parses its own options (``fastpersist COMMAND --help``); this parser only picks the command
and forwards the rest of the arguments unchanged.

Exit status: 0 success; 1 a problem was found (``verify`` found damage, ``convert`` could not
read the checkpoint); 2 a usage error or a path that is missing or of the wrong kind.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name: (module, function, one-line help)
COMMANDS = {
    # demo and bench run the programs of a source checkout's benchmarks/ (see programs)
    "demo": ("fastpersist.cli.programs", "demo_main",
             "train small models with a checkpoint every iteration; crash and resume"),
    "bench": ("fastpersist.cli.programs", "bench_main", "benchmark save/load against torch.save, DCP and the device"),
    "ls": ("fastpersist.cli.checkpoints", "ls_main", "list the checkpoints under a root"),
    "inspect": ("fastpersist.cli.checkpoints", "inspect_main",
                "describe a checkpoint and list its tensors (key, dtype, shape, bytes)"),
    "convert": ("fastpersist.cli.checkpoints", "convert_main", "write a sharded checkpoint as one torch.load file"),
    "verify": ("fastpersist.cli.checkpoints", "verify_main", "read a checkpoint and check every checksum"),
}

_EPILOG = """\
Run `fastpersist COMMAND --help` for a command's options.
exit status: 0 success, 1 a problem found (e.g. verify found damage),
2 usage error or a missing or wrong path."""


def version() -> str:
    """The installed package's version (without importing the package, which imports torch)."""
    from importlib import metadata

    try:
        return metadata.version("fastpersist")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        from fastpersist import __version__  # imports torch: only on this fallback

        return __version__


class _VersionAction(argparse.Action):
    """``--version``: the version is looked up only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"fastpersist {version()}")
        parser.exit(0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastpersist", epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Fast PyTorch checkpoints: benchmark, inspect, verify, convert.")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    for name, (_, _, help_text) in COMMANDS.items():
        # add_help=False: `fastpersist demo --help` reaches the demo's own parser
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (see the module docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        ns, rest = parser().parse_known_args(args)
    except SystemExit as e:  # --help, --version, or a usage error (already reported on stderr)
        return e.code if isinstance(e.code, int) else 2
    # parse_known_args puts the command's own options in `rest`, in their order; a stray option
    # before the command name (`fastpersist --bogus ls`) would land there too: refuse it.
    command = ns.command
    if args and args[0] != command and args.index(command) > 0:
        print(f"fastpersist: unrecognized arguments before {command!r}: "
              f"{' '.join(args[:args.index(command)])}", file=sys.stderr)
        return 2
    module_name, function, _ = COMMANDS[command]
    return int(getattr(importlib.import_module(module_name), function)(rest))


if __name__ == "__main__":
    sys.exit(main())
