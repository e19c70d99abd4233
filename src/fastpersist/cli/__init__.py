"""The ``fastpersist`` command line."""

from __future__ import annotations

import sys

_COMMANDS = {
    "demo": ("fastpersist.cli.demo", "main", "train small models with a checkpoint every iteration; crash and resume"),
    "bench": ("fastpersist.cli.bench", "main", "benchmark save/load against torch.save, DCP and the device"),
    "ls": ("fastpersist.cli.checkpoints", "ls_main", "list the checkpoints under a root"),
    "convert": ("fastpersist.cli.checkpoints", "convert_main", "write a sharded checkpoint as one torch.load file"),
    "verify": ("fastpersist.cli.checkpoints", "verify_main", "read a checkpoint and check every checksum"),
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or args[0] not in _COMMANDS:
        print("usage: fastpersist COMMAND [options]\n\ncommands:")
        for name, (_, _, help_text) in _COMMANDS.items():
            print(f"  {name:10s} {help_text}")
        return 0 if args and args[0] in ("-h", "--help") else 2
    import importlib

    module_name, function, _ = _COMMANDS[args[0]]
    return int(getattr(importlib.import_module(module_name), function)(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
