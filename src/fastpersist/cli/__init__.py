"""The ``fastpersist`` command line."""

from __future__ import annotations

import sys

_COMMANDS = {
    "bench": ("fastpersist.cli.bench", "benchmark save/load against torch.save, DCP and the device"),
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or args[0] not in _COMMANDS:
        print("usage: fastpersist COMMAND [options]\n\ncommands:")
        for name, (_, help_text) in _COMMANDS.items():
            print(f"  {name:10s} {help_text}")
        return 0 if args and args[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(_COMMANDS[args[0]][0])
    return int(module.main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
