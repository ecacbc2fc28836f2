"""``python -m verl_sat.eval``: sample, verify and summarise (see ``verl_sat.eval.sampling``)."""

from verl_sat.eval.sampling import main

if __name__ == "__main__":
    main()
