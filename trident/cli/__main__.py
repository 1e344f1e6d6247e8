"""``python -m trident.cli``: the ``trident`` command."""

import sys

from trident.cli.main import main

sys.exit(main())
