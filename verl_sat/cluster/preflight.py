"""``python -m verl_sat.cluster.preflight``: an alias of ``python -m verl_sat.preflight``, which
checks every node of the cluster when it joins one (docs/cluster.md)."""

from verl_sat.preflight.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
