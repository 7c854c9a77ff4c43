"""``python -m fedforget``: the console script."""

import sys

from .cli import main

sys.exit(main())
