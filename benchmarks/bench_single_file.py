"""Single-file save/load benchmark; same as ``fastpersist bench``. See --help."""

import sys

from fastpersist.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
