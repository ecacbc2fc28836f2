"""Old module paths of the preflight's cluster half, kept as aliases: ``verl_sat.cluster.paths``
(``prepare_cluster``) and ``python -m verl_sat.cluster.preflight``. The code is in
``verl_sat.preflight.cluster`` and ``verl_sat.preflight.cli``."""
