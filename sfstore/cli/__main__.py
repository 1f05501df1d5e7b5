"""``python -m sfstore.cli``: the ``sfstore`` command."""

import sys

from sfstore.cli import main

sys.exit(main())
