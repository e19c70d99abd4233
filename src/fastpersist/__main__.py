import sys

from fastpersist.cli import main

sys.exit(main())
