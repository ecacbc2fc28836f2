"""Data for the paper's experiment: ``python -m verl_sat.data.prepare_math`` (see its docstring)."""
