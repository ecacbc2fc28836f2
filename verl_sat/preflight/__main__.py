"""``python -m verl_sat.preflight [<method> <lag>] [overrides...]``: see ``cli``."""

import sys

from verl_sat.preflight.cli import main

if __name__ == "__main__":
    sys.exit(main())
