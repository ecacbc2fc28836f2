"""verl plugin entry point (group ``verl.plugins``).

Every ``import verl`` loads this module, in the driver and in every Ray worker, so the SAT
losses are registered wherever verl resolves ``policy_loss.loss_mode``. Keep it light: verl is
only half-imported when this runs.
"""

import verl_sat.losses  # noqa: F401  (registers "sat" and "sat_gspo")


def _register_cpu_and_rollout() -> None:
    """CPU platform (``VERL_PLATFORM=cpu``), ``hf`` rollout and ``ray_object_store`` weight sync.

    Light: the platform class is registered now; the rollout and the checkpoint engine register
    themselves when verl imports the corresponding registries (post-import hooks).
    """
    import verl_sat.cpu
    import verl_sat.rollout

    verl_sat.cpu.register()
    verl_sat.rollout.register()


_register_cpu_and_rollout()
