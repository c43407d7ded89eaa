"""``python -m qwengyre``: the same as the ``qwengyre`` command."""

import sys

from qwengyre.cli import main

sys.exit(main())
