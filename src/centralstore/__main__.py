"""``python -m centralstore``: the same command line as ``centralstore``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
