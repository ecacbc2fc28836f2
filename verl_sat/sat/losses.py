"""The registered SAT policy losses: ``"sat"`` (SAT-GRPO/PPO) and ``"sat_gspo"`` (SAT-GSPO).

Both keep verl's ``PolicyLossFn`` signature and return verl's metrics plus ``actor/sat_*``
diagnostics (docs/sat.md#diagnostics). ``old_log_prob`` is the ratio's denominator: in the async
recipes it is the rollout engine's log-prob mu (docs/sat.md#which-log-probs), so d = log pi_j - log
mu carries the staleness. With ``sat_score_against=rollout_log_probs`` (the decoupled option of
docs/sat.md#which-log-probs) the ratio keeps ``old_log_prob`` and the score d takes mu from
``LossContext``, which verl-sat's worker loss (``verl_sat.trainer.actor.sat_ppo_loss``) opens
around each call; the context also carries the gate back out, so per-staleness metrics need no
second quantile.

Paper: https://arxiv.org/abs/2607.18722 (SAT); GSPO: https://arxiv.org/abs/2507.18071
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_gspo, compute_policy_loss_vanilla

from verl_sat.sat.config import POLICY_LOSS_KEY, SATPolicyLossConfig, sat_settings
from verl_sat.sat.fused import StepScore, Surrogate, sequence_surrogate, token_surrogate, ungated_metrics
from verl_sat.sat.rule import RuleSettings, SATFactors


# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------
def clip_radii(config: Any) -> tuple[float, float]:
    """(eps_low, eps_high): ``actor.clip_ratio_low/high``, falling back to ``actor.clip_ratio``."""
    eps_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    eps_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return float(eps_low), float(eps_high)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def mismatch_metric(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """dbar_pi = mean over T_act of |log pi - log mu| (docs/sat.md#setting, token level for every method)."""
    d = (log_prob.detach() - old_log_prob.detach()).abs()
    return {"actor/mismatch_abs_mean": masked_mean(d, mask.to(d.dtype)).item()}


def empty_batch(log_prob: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """No active token: zero loss that still backpropagates (zeros), no NaN (docs/sat.md#the-rule,
    edge cases); verl's three loss metrics 0, SAT's those of a batch it gates nothing in, with q = 0."""
    loss = log_prob.masked_fill(torch.ones_like(log_prob, dtype=torch.bool), 0.0).sum()
    base = {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}
    return loss, {**base, **ungated_metrics(eps_low, eps_high)}


def _disabled(base_fn, args: tuple, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """SAT off: the base loss itself (bit-identical), plus the mismatch metric (against mu)."""
    old_log_prob, log_prob = args[0], args[1]
    loss, metrics = base_fn(*args)
    return loss, {**metrics, **mismatch_metric(log_prob, mu_log_prob(old_log_prob), mask)}


# ---------------------------------------------------------------------------------------------
# the worker's context: mu in, the gate out (docs/sat.md#which-log-probs)
# ---------------------------------------------------------------------------------------------
@dataclass
class LossContext:
    """Opened by ``verl_sat.trainer.actor.sat_ppo_loss`` around one call of verl's ``ppo_loss``.

    In: ``rollout_log_prob`` = log mu, padded like ``old_log_prob`` (None: not in the batch);
    ``step_q`` = the optimizer step's batch reference q and ``score_log_prob`` = log pi of the
    score at the step's weights, both from ``verl_sat.sat.step_q`` (None: not computed);
    ``whole_step``: this micro-batch is the whole optimizer step (its own q is the step's).
    Out: the ``gate`` the SAT loss applied (None for other losses and with SAT off).
    """

    rollout_log_prob: torch.Tensor | None = None
    step_q: float | None = None
    score_log_prob: torch.Tensor | None = None
    whole_step: bool = False
    gate: torch.Tensor | None = None


_CONTEXT: ContextVar[LossContext | None] = ContextVar("sat_loss_context", default=None)


@contextlib.contextmanager
def loss_context(
    rollout_log_prob: torch.Tensor | None = None,
    step_q: float | None = None,
    score_log_prob: torch.Tensor | None = None,
    whole_step: bool = False,
) -> Iterator[LossContext]:
    """Make mu and the step's q visible to the SAT losses called inside; yields the context."""
    ctx = LossContext(rollout_log_prob, step_q, score_log_prob, whole_step)
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def mu_log_prob(old_log_prob: torch.Tensor) -> torch.Tensor:
    """log mu for dbar_pi: the rollout's log-probs when the worker passed them, else ``old_log_prob``
    (which is mu in bypass mode, and the only log-prob a plain verl worker passes)."""
    ctx = _CONTEXT.get()
    mu = None if ctx is None else ctx.rollout_log_prob
    if mu is None or mu.shape != old_log_prob.shape:
        return old_log_prob
    return mu.to(device=old_log_prob.device, dtype=old_log_prob.dtype)


def score_reference(sat: SATPolicyLossConfig, old_log_prob: torch.Tensor) -> torch.Tensor:
    """The score's denominator (docs/sat.md#which-log-probs): ``old_log_prob``, or mu for
    ``sat_score_against=rollout_log_probs``."""
    if sat.sat_score_against == "old_log_prob":
        return old_log_prob
    ctx = _CONTEXT.get()
    mu = None if ctx is None else ctx.rollout_log_prob
    if mu is None:
        raise ValueError(
            f"{POLICY_LOSS_KEY}.sat_score_against=rollout_log_probs needs the rollout's log-probs in the batch "
            "(actor_rollout_ref.rollout.calculate_log_probs=true) and verl-sat's worker loss (sat.actor=true)"
        )
    if mu.shape != old_log_prob.shape:
        raise ValueError(
            f"{POLICY_LOSS_KEY}.sat_score_against=rollout_log_probs: rollout log-probs of shape "
            f"{tuple(mu.shape)} do not match old_log_prob {tuple(old_log_prob.shape)}"
        )
    return mu.to(device=old_log_prob.device, dtype=old_log_prob.dtype)


def score_log_prob(log_prob: torch.Tensor) -> torch.Tensor | None:
    """log pi of the SAT score from the step's scoring pass (``step_quantile``), or None: this
    micro-batch's own log pi scores (the same weights: no optimizer step inside a step)."""
    ctx = _CONTEXT.get()
    scored = None if ctx is None else ctx.score_log_prob
    if scored is None:
        return None
    if scored.shape != log_prob.shape:
        shapes = f"{tuple(scored.shape)} vs log_prob {tuple(log_prob.shape)}"
        raise ValueError(f"the step's score log-probs do not match the micro-batch: {shapes}")
    return scored.to(device=log_prob.device, dtype=log_prob.dtype)


def step_reference(sat: SATPolicyLossConfig, config: Any, response_mask: torch.Tensor) -> torch.Tensor | None:
    """The batch reference q of ``sat_quantile_scope=step`` (docs/sat.md#the-rule, step 2), or None: take q here.

    None for ``micro_batch`` scope, and for ``step`` scope when this call's tokens are the whole
    step: a direct call (no verl ``global_batch_info``), or one micro-batch on one rank holding
    all of the step's active tokens. Otherwise the step's q must come from verl-sat's worker.
    """
    if sat.sat_quantile_scope == "micro_batch":
        return None
    ctx = _CONTEXT.get()
    if ctx is not None and ctx.step_q is not None:
        return torch.tensor(ctx.step_q, dtype=torch.float64)
    if ctx is not None and ctx.whole_step:
        return None
    info = getattr(config, "global_batch_info", None) or {}
    step_tokens, dp_size = info.get("batch_num_tokens"), info.get("dp_size") or 1
    if step_tokens is None:
        return None
    n_active = int(response_mask.sum().item())
    if int(step_tokens) == n_active and int(dp_size) == 1:
        return None
    raise ValueError(
        f"{POLICY_LOSS_KEY}.sat_quantile_scope=step: this micro-batch holds {n_active} of the step's "
        f"{int(step_tokens)} active tokens (dp_size {dp_size}) and no step-level q was computed; run verl-sat's "
        f"worker (sat.actor=true, trainer.v1.trainer_mode=sat_<mode>) or set {POLICY_LOSS_KEY}.sat_quantile_scope="
        "micro_batch (per-micro-batch q; docs/sat.md)"
    )


def _record(f: SATFactors) -> None:
    """Hand the gate back to the worker loss (per-staleness metrics), if it opened a context."""
    ctx = _CONTEXT.get()
    if ctx is not None:
        ctx.gate = f.gate


def scope_metrics(log_prob: torch.Tensor, response_mask: torch.Tensor, known: dict[str, float]) -> dict[str, float]:
    """What the batch reference q was taken over (docs/sat.md#the-rule, step 2; the q-scope metrics):

    actor/sat_seqs_per_micro_batch = #responses with an active token in this micro-batch
        (SAT-GSPO with per-micro-batch q gates nothing once the top one holds 1 - alpha of its tokens)
    actor/sat_score_drift = mean over T_act of |log pi - log pi_score|: 0 when the score was
        taken at this step's weights (forward scoring pass), > 0 when it lags (old log-probs)
    ``known``: the loss's own metrics (the sequence loss counts the responses itself).
    """
    metrics = {}
    if "actor/sat_seqs_per_micro_batch" not in known:
        metrics["actor/sat_seqs_per_micro_batch"] = float((response_mask.sum(dim=-1) > 0).sum())
    ctx = _CONTEXT.get()
    if ctx is not None and ctx.score_log_prob is not None:
        mask = response_mask.bool()
        drift = torch.where(mask, (log_prob.detach() - ctx.score_log_prob.to(log_prob.dtype)).abs(), 0.0)
        metrics["actor/sat_score_drift"] = (drift.sum() / mask.sum().clamp(min=1)).item()
    return metrics


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: SAT on verl's vanilla (token level, docs/sat.md#the-rule)
# ---------------------------------------------------------------------------------------------
def compute_policy_loss_sat(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """SAT-GRPO / SAT-PPO: PPO's clipped surrogate with staleness-contracted radii (docs/sat.md#the-rule).

    d   = clamp(log pi - log mu, -20, 20),  r = exp(d)                     (docs/sat.md#setting)
          (decoupled, docs/sat.md#which-log-probs: r = exp(clamp(log pi - log pi_old)), d against mu)
    eps_low~ = eps_low * c_minus(d),  eps_high~ = eps_high * c_plus(d)     (docs/sat.md#the-rule, steps 1-6)
    S   = min(r A, clip(r, 1 - eps_low~, 1 + eps_high~) A);  loss = -S     (docs/sat.md#the-rule, step 7)
    plus verl's dual clip for A < 0: loss = min(loss, -A * clip_ratio_c).
    Computed by ``fused.token_surrogate``; with no token gated, verl's ``vanilla`` itself.
    """
    assert config is not None, "the sat loss needs the actor config (clip ratios, policy_loss)"
    sat: SATPolicyLossConfig = sat_settings(config.policy_loss)
    args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
    if not sat.sat_enabled:
        return _disabled(compute_policy_loss_vanilla, args, response_mask)
    eps_low, eps_high = clip_radii(config)
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1.0 (dual clip), got {clip_ratio_c}")
    rule = RuleSettings(sat.sat_alpha, sat.sat_kernel, sat.sat_kernel_exponent)
    ref = score_reference(sat, old_log_prob)
    mu = mu_log_prob(old_log_prob)
    step = StepScore(score_log_prob(log_prob), step_reference(sat, config, response_mask))
    out = token_surrogate(
        log_prob, old_log_prob, advantages, response_mask, ref, mu, rule, eps_low, eps_high, clip_ratio_c, step
    )
    return _finish(out, compute_policy_loss_vanilla, args, eps_low, eps_high)


def compute_policy_loss_sat_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """SAT-GSPO: GSPO's sequence ratio in the objective and in the SAT score (docs/sat.md#sequence-level).

    log rho_b = (1/|y_b|) sum_t (log pi_{b,t} - log mu_{b,t})             (length-normalised)
    d_{b,t}   = log rho_b for every active t of response b                 (broadcast, then quantile)
                (decoupled, docs/sat.md#which-log-probs: rho_b against pi_old, d_{b,t} from the same mean against mu)
    s_{b,t}   = sg[rho_b] * pi_{b,t} / sg[pi_{b,t}]                         (GSPO-token gradient form)
    S = min(s A, clip(s, 1 - eps_low~, 1 + eps_high~) A);  loss = -S
    Computed by ``fused.sequence_surrogate``; with no token gated, verl's ``gspo`` itself.
    """
    assert config is not None, "the sat_gspo loss needs the actor config (clip ratios, policy_loss)"
    sat: SATPolicyLossConfig = sat_settings(config.policy_loss)
    args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
    if not sat.sat_enabled:
        return _disabled(compute_policy_loss_gspo, args, response_mask)
    eps_low, eps_high = clip_radii(config)
    rule = RuleSettings(sat.sat_alpha, sat.sat_kernel, sat.sat_kernel_exponent)
    ref = score_reference(sat, old_log_prob)
    mu = mu_log_prob(old_log_prob)
    step = StepScore(score_log_prob(log_prob), step_reference(sat, config, response_mask))
    out = sequence_surrogate(log_prob, old_log_prob, advantages, response_mask, ref, mu, rule, eps_low, eps_high, step)
    return _finish(out, compute_policy_loss_gspo, args, eps_low, eps_high)


def _finish(
    out: Surrogate | None, base_fn, args: tuple, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Aggregate -S as verl does, or, with no token gated, return verl's own loss (bit-identical)."""
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights = args
    if out is None:
        return empty_batch(log_prob, eps_low, eps_high)
    _record(out.factors)
    metrics = {**out.metrics, **scope_metrics(log_prob, response_mask, out.metrics)}
    if out.loss is None:  # no token gated: verl's own loss, bit for bit, and its three metrics
        if not out.clean_padding:  # -inf / NaN log-probs at padding: keep verl's loss finite
            mask = response_mask.bool()
            old_log_prob, log_prob = torch.where(mask, old_log_prob, 0.0), torch.where(mask, log_prob, 0.0)
        args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        loss, base = base_fn(*args)
        return loss, {**base, **metrics}
    pg_losses = out.loss if rollout_is_weights is None else out.loss * rollout_is_weights
    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    return pg_loss, metrics


# ---------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------
SAT_LOSSES = {"sat": compute_policy_loss_sat, "sat_gspo": compute_policy_loss_sat_gspo}


def _same_function(a: Any, b: Any) -> bool:
    """True for the same function, or the same one re-imported (module reload)."""
    key = ("__module__", "__qualname__")
    return a is b or all(getattr(a, k, None) == getattr(b, k, None) for k in key)


def register_sat_losses() -> None:
    """Register ``sat`` and ``sat_gspo`` in verl's ``POLICY_LOSS_REGISTRY``.

    Refuses to replace a different function already registered under one of these names
    (as verl's ``register_adv_est`` does), instead of silently shadowing it.
    """
    for name, fn in SAT_LOSSES.items():
        existing = core_algos.POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and not _same_function(existing, fn):
            raise ValueError(
                f"policy loss {name!r} is already registered to {existing.__module__}.{existing.__qualname__}; "
                "verl-sat will not replace it"
            )
        core_algos.register_policy_loss(name)(fn)


register_sat_losses()
