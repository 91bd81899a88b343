"""`python -m manualpar ...`: dispatches to the command line in manualpar.cli."""

import sys

from manualpar.cli import main

if __name__ == "__main__":
    sys.exit(main())
