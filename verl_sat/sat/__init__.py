"""The SAT method (docs/sat.md): the rule, the exact quantile, the step's q, the registered
losses ``sat`` / ``sat_gspo`` and their config."""
