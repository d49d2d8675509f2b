"""`python -m planner` is the `planner` command."""

import sys

from planner.cli import main

__all__: list[str] = []

sys.exit(main())
