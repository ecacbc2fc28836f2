"""The preflight: a run checked against the node it is about to run on, or against every node of a
Ray cluster started beforehand, before it launches (docs/reproduce.md, docs/cluster.md).

``python -m verl_sat.preflight [<method> <lag>] [overrides...]`` (``cli``) resolves the run as the
launch does, gathers the facts once per node (``facts.gather``: NVML, ``importlib.metadata``,
psutil, verl's registries, the model and data files; here, or as a Ray task pinned to each node
through ``cluster``) and runs pure checks ``(config, facts) -> findings`` over them (``checks``,
with the sizes of ``estimates``). Every failure is one line naming the key or package and the fix;
the exit code is 1 when any check fails. ``run.sh`` runs it before the launch
(``SAT_SKIP_PREFLIGHT=1`` skips it). ``python -m verl_sat.preflight --memory-table`` prints
docs/reproduce.md's host-memory table from the same estimates (``cli.memory_rows``).

``cluster.prepare_cluster`` is the driver's own check before training on a cluster (every path the
config names, on every node).
"""
