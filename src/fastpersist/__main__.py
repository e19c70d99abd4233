"""``python -m fastpersist``: the command line (see :mod:`fastpersist.cli`)."""

import sys

from fastpersist.cli import main

sys.exit(main())
