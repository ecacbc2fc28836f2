"""Dataclass configs of verl-sat, validated on construction.

``SATPolicyLossConfig`` extends verl's ``PolicyLossConfig`` (the node
``actor_rollout_ref.actor.policy_loss``) with the settings of the SAT rule (docs/sat.md#the-rule, §4).
Select it from Hydra with::

    actor_rollout_ref.actor.policy_loss._target_=verl_sat.SATPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=sat_gspo

(our ``hydra_configs`` declare the ``sat_*`` keys, so no ``+`` is needed there: the ConfigStore node
``sat_policy_loss_defaults``, registered from this dataclass's own defaults on import).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from verl.workers.config.actor import PolicyLossConfig

from verl_sat.config_node import check_fields, checked, flag, number, one_of

POLICY_LOSS_KEY = "actor_rollout_ref.actor.policy_loss"

# The kernels psi(u; q) the rule may use; each has psi(0) = 1, psi(q) = 1/2, non-increasing.
KERNELS = ("hill", "exponential")
# The denominator of the SAT score d = log pi - log(.) (docs/sat.md#which-log-probs): the ratio's own old_log_prob
# (mu itself in bypass mode, the default), or the rollout's mu while the ratio uses old_log_prob.
SCORE_REFERENCES = ("old_log_prob", "rollout_log_probs")
# Over which tokens q is taken (docs/sat.md#the-rule step 2): the optimizer step's (every micro-batch, every
# data-parallel rank), or each micro-batch's own (degenerates for SAT-GSPO on few long sequences).
QUANTILE_SCOPES = ("step", "micro_batch")
# Where the step-scope score's log pi comes from: a forward pass at the step's weights before
# its first backward, or the trainer's recomputed old log-probs (free, decoupled mode only; at
# the step's weights only for the first optimizer step after they were computed).
STEP_SCORES = ("forward", "old_log_prob")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SATPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config plus the SAT rule (docs/sat.md#the-rule).

    Args:
        sat_enabled: apply the SAT contraction; False makes ``sat`` / ``sat_gspo`` bit-identical
            to verl's ``vanilla`` / ``gspo`` (docs/sat.md#the-rule, identity when off).
        sat_alpha: quantile level alpha of the batch reference q, in (0, 1). Paper: 0.90.
        sat_kernel: the kernel psi(u; q): ``"hill"`` = 1 / (1 + (u/q)^p) (paper) or
            ``"exponential"`` = 2^(-(u/q)^p).
        sat_kernel_exponent: the exponent p > 0 of the kernel. Paper: 2.
        sat_score_against: the score's denominator (docs/sat.md#which-log-probs). ``"old_log_prob"`` (default): the
            ratio's, which is the rollout's mu in bypass mode. ``"rollout_log_probs"``: the
            decoupled option, the ratio against the trainer's recomputed old log-probs and the
            score against mu (needs rollout log-probs in the batch and verl-sat's worker loss).
        sat_quantile_scope: the tokens q is taken over (docs/sat.md#the-rule step 2). ``"step"`` (default):
            every active token of the optimizer step, on every data-parallel rank, scored at the
            step's weights; needs verl-sat's worker (``sat.actor=true``) unless one micro-batch
            is the whole step. ``"micro_batch"``: each micro-batch's own tokens (the pre-0.2
            behaviour; SAT-GSPO gates nothing once a micro-batch's top sequence holds 1 - alpha
            of its tokens).
        sat_step_score: with ``step`` scope, where log pi of the score comes from:
            ``"forward"`` (default) a forward pass over the step's micro-batches at its weights
            before the first backward (about a third of a forward+backward); ``"old_log_prob"``
            the trainer's recomputed old log-probs (free; decoupled mode only, and at the step's
            weights only for the first optimizer step after they were computed:
            ``actor/sat_score_drift`` says how far).
    """

    sat_enabled: bool = flag(True)
    sat_alpha: float = checked(0.9, lambda value: _is_number(value) and 0.0 < value < 1.0, "a number in (0, 1)")
    sat_kernel: str = one_of("hill", KERNELS)
    sat_kernel_exponent: float = number(2.0, strictly_positive=True)
    sat_score_against: str = one_of("old_log_prob", SCORE_REFERENCES)
    sat_quantile_scope: str = one_of("step", QUANTILE_SCOPES)
    sat_step_score: str = one_of("forward", STEP_SCORES)

    def __post_init__(self) -> None:
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        check_fields(self, POLICY_LOSS_KEY)
        if self.sat_step_score == "old_log_prob" and self.sat_score_against != "rollout_log_probs":
            raise ValueError(
                f"{POLICY_LOSS_KEY}.sat_step_score=old_log_prob scores log pi_old - log mu, which needs "
                f"{POLICY_LOSS_KEY}.sat_score_against=rollout_log_probs (the decoupled option; in bypass mode "
                f"old_log_prob is mu and the score would be 0), got sat_score_against={self.sat_score_against!r}"
            )


# The SAT rule's keys of the policy-loss node: the fields SATPolicyLossConfig adds to verl's.
SAT_FIELDS = tuple(f.name for f in dataclasses.fields(SATPolicyLossConfig) if f.name.startswith("sat_"))
# The ConfigStore name of their defaults, listed in ``algorithm/sat_grpo.yaml`` and ``algorithm/sat_gspo.yaml``
# (``- /sat_policy_loss_defaults@actor_rollout_ref.actor.policy_loss``).
POLICY_LOSS_DEFAULTS_NODE = "sat_policy_loss_defaults"


def register_policy_loss_defaults() -> None:
    """The ``sat_*`` fields' defaults as the ConfigStore node ``sat_policy_loss_defaults``, so that the
    YAML repeats none of them and an override needs no ``+`` (verl builds the dataclass from ``_target_``).

    Called when this module is imported (``import verl_sat`` does), before anything composes.
    """
    from hydra.core.config_store import ConfigStore

    defaults = {f.name: f.default for f in dataclasses.fields(SATPolicyLossConfig) if f.name in SAT_FIELDS}
    ConfigStore.instance().store(name=POLICY_LOSS_DEFAULTS_NODE, node=defaults)


def sat_settings(policy_loss: object) -> SATPolicyLossConfig:
    """The SAT settings carried by an actor's ``policy_loss`` node.

    Accepts our dataclass, verl's plain ``PolicyLossConfig`` (defaults apply), a DictConfig or a
    dict; any ``sat_*`` keys found are validated by ``SATPolicyLossConfig``.
    """
    if isinstance(policy_loss, SATPolicyLossConfig):
        return policy_loss
    if policy_loss is None:
        return SATPolicyLossConfig()
    getter = policy_loss.get if hasattr(policy_loss, "get") else lambda k, d=None: getattr(policy_loss, k, d)
    found = {name: getter(name, None) for name in SAT_FIELDS}
    return SATPolicyLossConfig(**{name: value for name, value in found.items() if value is not None})


register_policy_loss_defaults()
