"""``python -m promptcache.cli``: the same as the ``promptcache`` console script."""

import sys

from . import main

sys.exit(main())
