"""``python -m graphslot.cli``: the ``graphslot`` command."""

import sys

from . import main

sys.exit(main())
