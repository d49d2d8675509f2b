"""``python -m runtime model.py --plan plan.yaml``: one worker of a plan (see runtime.worker)."""

import sys

from runtime.worker import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
