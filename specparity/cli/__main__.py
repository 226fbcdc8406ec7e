"""``python -m specparity.cli``: the ``specparity`` console script."""

import sys

from specparity.cli.entry import main

sys.exit(main())
