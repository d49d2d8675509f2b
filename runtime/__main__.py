"""``python -m runtime model.py --plan plan.yaml``: one worker of a plan (see runtime.launch)."""

import sys

from runtime.launch import main

if __name__ == "__main__":
    sys.exit(main())
