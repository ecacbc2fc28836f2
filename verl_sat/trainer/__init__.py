"""verl-sat's seams in verl's v1 trainer: the actor worker, its engines, the ``sat:`` recipe config,
auto-lag, the sentinel, sample accounting, faults, the supervisor, and the job's console."""
