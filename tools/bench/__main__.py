"""``python -m tools.bench SUITE [options]``: see :mod:`tools.bench`."""

import sys

from tools.bench.cli import main

sys.exit(main())
