"""``python -m verl_sat.preflight <method> <lag> [--run-dir DIR] [--json] [overrides...]``: see ``cli``."""

import sys

from verl_sat.preflight.cli import main

if __name__ == "__main__":
    sys.exit(main())
