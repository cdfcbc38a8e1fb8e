"""``python -m shardspec``: the same as the ``shardspec`` command."""

import sys

from shardspec.cli import main

sys.exit(main())
