"""verl plugin entry point (group ``verl.plugins``).

Every ``import verl`` loads this module, in the driver and in every Ray worker, so the SAT
losses are registered wherever verl resolves ``policy_loss.loss_mode``, and the work-arounds for
verl bugs (``verl_sat.verl_fixes``) are installed on every platform. Keep it light: verl is only
half-imported when this runs.
"""

import verl_sat.verl_fixes

# Work-arounds for verl bugs that are not about CPUs, on every platform; first, so that nothing
# below can keep them from being installed (verl swallows a plugin's errors).
verl_sat.verl_fixes.install()

import verl_sat.sat.losses  # noqa: E402, F401  (registers "sat" and "sat_gspo")


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


def _register_sat_trainers() -> None:
    """``trainer.v1.trainer_mode=sat_<mode>`` (AsyncSATActor), once verl's v1 trainers are imported."""
    import importlib

    from verl_sat.hooks import when_imported

    def register(_module: object) -> None:
        importlib.import_module("verl_sat.trainer.actor").register_sat_trainers()

    when_imported("verl.trainer.ppo.v1", register)


_register_sat_trainers()
