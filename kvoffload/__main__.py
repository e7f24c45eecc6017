"""``python -m kvoffload``: the command-line tools (:mod:`kvoffload.cli`)."""

from __future__ import annotations

import sys

from kvoffload.cli import main

if __name__ == "__main__":
    sys.exit(main())
