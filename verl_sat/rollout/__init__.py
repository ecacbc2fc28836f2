"""HF (transformers) rollout backend for verl 0.9.1: ``actor_rollout_ref.rollout.name=hf``.

Modules: :mod:`.sampling` (per-row temperature/top-k/top-p, log-probs of the sampled
distribution), :mod:`.engine` (batched KV-cache decoding), :mod:`.server` (the Ray rollout server
actor), :mod:`.replica` (``RolloutReplica``), :mod:`.adapter` (``BaseRollout`` adapter),
:mod:`.weights` (expert re-packing).

:func:`register` adds ``"hf"`` to ``RolloutReplicaRegistry`` (lazy loader) and to
``_ROLLOUT_REGISTRY[("hf", "async")]`` (a dotted path). Both happen when verl imports the
corresponding module (a post-import hook), so ``import verl`` stays as cheap as before.

Knobs (``+actor_rollout_ref.rollout.engine_kwargs.hf.<key>=...`` or env ``VERL_SAT_ROLLOUT_<KEY>``,
env wins): ``logit_noise_std`` (default 0.0; Gaussian noise added to rollout logits before
sampling, to induce a rollout/trainer mismatch), ``batch_wait_ms`` (5), ``num_threads`` (1),
``experts_implementation`` (eager), ``seed`` (rollout.seed + 1000 * replica_rank),
``router_noise_std`` (0.0; routing mismatch), ``fault_step`` (-1) and ``fault_logit_noise_std`` (3.0):
an induced collapse, the logit noise jumps for weight versions >= ``fault_step``.
"""

from __future__ import annotations

from types import ModuleType

from verl_sat.hooks import when_imported

ROLLOUT_NAME = "hf"
ADAPTER_PATH = "verl_sat.rollout.adapter.HFServerAdapter"


def _load_replica() -> type:
    from verl_sat.rollout.replica import HFReplica

    return HFReplica


def _register_replica(module: ModuleType) -> None:
    module.RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)


def _register_adapter(module: ModuleType) -> None:
    module._ROLLOUT_REGISTRY.setdefault((ROLLOUT_NAME, "async"), ADAPTER_PATH)


def register() -> None:
    """Register the ``hf`` rollout with verl as soon as verl's registries are imported."""
    when_imported("verl.workers.rollout.replica", _register_replica)
    when_imported("verl.workers.rollout.base", _register_adapter)
