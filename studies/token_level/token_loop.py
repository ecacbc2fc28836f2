"""The study loop (studies/lib/loop.py) with SAT's kernel exponent and the token-level instruments.

:class:`TokenLoop` is :class:`studies.lib.loop.StudyLoop` unchanged except that (1) its SAT loss
takes ``sat_kernel_exponent`` and (2) its loss call is wrapped: before the arm's loss runs on the
step's forward, the step's tokens are classified and SAT's gate, intercepted tokens and removed
gradient are measured (studies/token_level/instrument.py), on the same log-probs the loss sees.
Every step logs the per-token measures (``token/*``); every ``grad_every``-th step also the
parameter-space shares (two extra backward passes through the step's graph).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from studies.lib.loop import LoopConfig, StudyLoop, actor_config
from studies.token_level import instrument


@dataclass
class TokenLoopConfig(LoopConfig):
    """LoopConfig plus SAT's kernel exponent and the instruments' cadence."""

    sat_kernel_exponent: float = 2.0
    """the Hill kernel's exponent p (docs/sat.md#the-rule, step 4; the paper's 2)"""
    grad_every: int = 4
    """the parameter-space shares on every grad_every-th optimizer step (0: never)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_mode != "sat":
            raise ValueError(f"TokenLoopConfig.loss_mode must be 'sat' (the token level), got {self.loss_mode!r}")
        if not self.sat_kernel_exponent > 0:
            raise ValueError(f"TokenLoopConfig.sat_kernel_exponent must be > 0, got {self.sat_kernel_exponent!r}")
        if self.grad_every < 0:
            raise ValueError(f"TokenLoopConfig.grad_every must be >= 0, got {self.grad_every!r}")
        if self.correction != "none":
            raise ValueError(f"TokenLoopConfig.correction must be 'none' (ratio against mu), got {self.correction!r}")


def sat_actor_config(cfg: TokenLoopConfig, enabled: bool) -> Any:
    """The loop's ActorConfig with SAT on or off and the arm's alpha and kernel exponent."""
    from verl_sat import SATPolicyLossConfig

    policy_loss = SATPolicyLossConfig(
        loss_mode="sat",
        sat_enabled=enabled,
        sat_alpha=cfg.sat_alpha,
        sat_kernel_exponent=cfg.sat_kernel_exponent,
    )
    return dataclasses.replace(actor_config(cfg), policy_loss=policy_loss)


COUNTERFACTUAL = {"a95": (0.95, 2.0), "a99": (0.99, 2.0), "p4": (0.9, 4.0), "p2": (0.9, 2.0)}
"""the rule's settings measured on every arm's steps (alpha, exponent): the variants' counterfactuals"""


def counterfactual(
    d: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, cfg: TokenLoopConfig
) -> dict[str, float]:
    """q and the intercepted count SAT would have on this step at each of ``COUNTERFACTUAL``'s
    settings (``token/q_<name>``, ``token/icpt_<name>``); eps from the arm's config."""
    from verl_sat.sat.rule import intercepted, sat_factors

    out = {}
    for name, (alpha, exponent) in COUNTERFACTUAL.items():
        f = sat_factors(d, mask, alpha, "hill", exponent)
        out[f"token/q_{name}"] = float(f.q)
        out[f"token/icpt_{name}"] = float(intercepted(ratio, advantages, f, cfg.eps_low, cfg.eps_high))
    return out


class TokenLoop(StudyLoop):
    """StudyLoop whose loss call is measured first (module docstring)."""

    def __init__(self, cfg: TokenLoopConfig, model: Any, tokenizer: Any) -> None:
        super().__init__(cfg, model, tokenizer)
        self.actor_config = sat_actor_config(cfg, cfg.sat_enabled)
        self.base_config = sat_actor_config(cfg, False)
        self.sat_config = sat_actor_config(cfg, True)
        self.table = instrument.class_table(tokenizer, self.eos)
        self._arm_loss = self.loss_fn
        self.loss_fn = self._measured_loss
        self._batch: Any = None
        self._pending: dict[str, float] = {}
        self._measured = 0

    def update(self, batch: Any) -> dict[str, float]:
        self._batch, self._pending = batch, {}
        self._measured += 1
        metrics = super().update(batch)
        metrics.update(self._pending)
        return metrics

    def _measured_loss(self, old, log_prob, advantages, mask, agg, config, weights):  # noqa: ANN001, ANN202
        """The arm's loss, after measuring the step on the very tensors it receives."""
        self._pending = self.measure(old, log_prob, advantages, mask, agg)
        return self._arm_loss(old, log_prob, advantages, mask, agg, config, weights)

    def measure(
        self, old: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, agg: str
    ) -> dict[str, float]:
        """instrument's per-token measures on this step; the parameter shares on the cadence's steps."""
        from verl_sat.sat.losses import compute_policy_loss_sat, loss_context
        from verl_sat.sat.rule import sat_factors, staleness_score

        cfg = self.cfg
        mu = self._batch.rollout_log_prob
        step = (old, log_prob, advantages, mask, agg)
        with loss_context(rollout_log_prob=mu, whole_step=True):
            g_base = instrument.token_gradient(compute_policy_loss_sat, *step, self.base_config)
            g_sat = instrument.token_gradient(compute_policy_loss_sat, *step, self.sat_config)
        delta = g_base - g_sat
        d = staleness_score("token", log_prob, mu, mask)
        f = sat_factors(d, mask, cfg.sat_alpha, "hill", cfg.sat_kernel_exponent)
        classes = instrument.classify(self._batch.response_ids, self.table)
        out = instrument.class_metrics(classes, mask, f.gate, d, advantages, g_base, delta)
        out["token/q"] = float(f.q)
        out.update(counterfactual(d, mask, torch.exp(log_prob.detach() - old), advantages, cfg))
        if cfg.grad_every and self._measured % cfg.grad_every == 0 and log_prob.requires_grad:
            out.update(instrument.parameter_shares(log_prob, g_base, delta, list(self.policy.parameters())))
        return out
