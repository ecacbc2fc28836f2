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
from verl.utils.torch_functional import masked_mean

from verl_sat.sat.config import POLICY_LOSS_KEY, SATPolicyLossConfig, sat_settings
from verl_sat.sat.rule import LOG_RATIO_CLAMP, SATFactors, intercepted, sat_clip, sat_factors, staleness_score

GSPO_LOG_RATIO_MAX = 10.0  # verl's gspo clamps log s_{b,t} at 10 before exp


# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------
def clip_radii(config: Any) -> tuple[float, float]:
    """(eps_low, eps_high): ``actor.clip_ratio_low/high``, falling back to ``actor.clip_ratio``."""
    eps_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    eps_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return float(eps_low), float(eps_high)


def mismatch_metric(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """dbar_pi = mean over T_act of |log pi - log mu| (docs/sat.md#setting, token level for every method).

    verl's ``masked_mean``: padding may hold -inf or NaN (its ``masked_sum`` zeroes it first).
    """
    d = (log_prob.detach() - old_log_prob.detach()).abs()
    return {"actor/mismatch_abs_mean": masked_mean(d, mask.bool()).item()}


def sat_metrics(
    f: SATFactors, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float
) -> dict[str, float]:
    """SAT's diagnostics over the n active tokens (docs/metrics.md, "SAT's loss"); ``mask`` bool.

    c_plus and c_minus are 1 off the gated tokens, so mean(eps c) = eps (1 - sum over the gated
    tokens on that side of (1 - c) / n): sums over the gated tokens only.
    """
    n = float(mask.sum())
    shrink = 1.0 - f.c  # (G,) how far each gated token's radius contracts
    shrink_high, shrink_low = float(shrink[f.positive].sum()), float(shrink[~f.positive].sum())
    return {
        "actor/sat_q": float(f.q),
        "actor/sat_gate_rate": f.idx.numel() / n,  # mean 1{q > 0, |d| > q} over T_act
        "actor/sat_c_min": float(f.c.min()) if f.idx.numel() else 1.0,
        "actor/sat_eps_low_mean": eps_low * (1.0 - shrink_low / n),  # mean(eps_low c_minus)
        "actor/sat_eps_high_mean": eps_high * (1.0 - shrink_high / n),  # mean(eps_high c_plus)
        "actor/sat_intercepted_frac": float(intercepted(ratio, advantages, f, eps_low, eps_high)) / n,
    }


def empty_batch(log_prob: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """No active token: zero loss that still backpropagates (zeros), no NaN (docs/sat.md#the-rule,
    edge cases); verl's three loss metrics 0, SAT's those of a batch it gates nothing in, with q = 0."""
    loss = log_prob.masked_fill(torch.ones_like(log_prob, dtype=torch.bool), 0.0).sum()
    return loss, {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": 0.0,
        "actor/pg_clipfrac_lower": 0.0,
        "actor/sat_q": 0.0,
        "actor/sat_gate_rate": 0.0,
        "actor/sat_c_min": 1.0,
        "actor/sat_eps_low_mean": eps_low,
        "actor/sat_eps_high_mean": eps_high,
        "actor/sat_intercepted_frac": 0.0,
        "actor/mismatch_abs_mean": 0.0,
    }


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


def scope_metrics(log_prob: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """What the batch reference q was taken over (docs/sat.md#the-rule, step 2; the q-scope metrics):

    actor/sat_seqs_per_micro_batch = #responses with an active token in this micro-batch
        (SAT-GSPO with per-micro-batch q gates nothing once the top one holds 1 - alpha of its tokens)
    actor/sat_score_drift = mean over T_act of |log pi - log pi_score|: 0 when the score was
        taken at this step's weights (forward scoring pass), > 0 when it lags (old log-probs)
    """
    metrics = {"actor/sat_seqs_per_micro_batch": float((response_mask.sum(dim=-1) > 0).sum())}
    ctx = _CONTEXT.get()
    if ctx is not None and ctx.score_log_prob is not None:
        drift = (log_prob.detach() - ctx.score_log_prob.to(log_prob.dtype)).abs()
        metrics["actor/sat_score_drift"] = masked_mean(drift, response_mask.bool()).item()
    return metrics


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: verl's vanilla and gspo with SAT's clip interval (docs/sat.md#the-rule, step 7)
# ---------------------------------------------------------------------------------------------
def clean_padding(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both log-probs with 0 at padding: an engine's padding may hold -inf or NaN, which
    ``loss * mask`` would turn into a NaN loss; active tokens keep their bits."""
    mask = response_mask.bool()
    return torch.where(mask, old_log_prob, 0.0), torch.where(mask, log_prob, 0.0)


def sat_gate(
    sat: SATPolicyLossConfig,
    level: str,
    config: Any,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mask: torch.Tensor,
) -> SATFactors:
    """The rule (docs/sat.md#the-rule, steps 1-5) on this micro-batch's score, against the step's q
    when it was taken over the optimizer step; the gate goes back to the worker's context."""
    scored = score_log_prob(log_prob)
    d = staleness_score(level, log_prob if scored is None else scored, score_reference(sat, old_log_prob), mask)
    q = step_reference(sat, config, mask)
    f = sat_factors(d, mask, sat.sat_alpha, sat.sat_kernel, sat.sat_kernel_exponent, q=q)
    _record(f)
    return f


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, f: SATFactors, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-S = max(-A r, -A clip(r, 1 - eps_low~, 1 + eps_high~)) per token, and verl's pg_clipfrac.

    The ops of verl's ``vanilla`` / ``gspo`` with ``rule.sat_clip`` for their clamp: ungated tokens
    are verl's bit for bit, so with no token gated the whole loss is.
    """
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * sat_clip(ratio, f, eps_low, eps_high)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    return torch.maximum(pg_losses1, pg_losses2), pg_clipfrac


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
    Written as verl's ``vanilla``, whose clamp becomes ``rule.sat_clip``; autograd takes the gradient.
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
    if not response_mask.any():
        return empty_batch(log_prob, eps_low, eps_high)
    mu = mu_log_prob(old_log_prob)
    old_log_prob, log_prob = clean_padding(old_log_prob, log_prob, response_mask)
    f = sat_gate(sat, "token", config, log_prob, old_log_prob, response_mask)

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(negative_approx_kl)  # r
    ppo_kl = masked_mean(-negative_approx_kl.detach(), response_mask)
    clip_pg_losses1, pg_clipfrac = clipped_surrogate(ratio, advantages, response_mask, f, eps_low, eps_high)
    pg_losses3 = -advantages * clip_ratio_c  # verl's dual clip: -S <= -A c where A < 0
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)

    base = {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": pg_clipfrac_lower}
    metrics = sat_metrics(f, ratio, advantages, response_mask.bool(), eps_low, eps_high)
    return _aggregate(pg_losses, args, base, metrics, mu)


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
    Written as verl's ``gspo``, whose clamp becomes ``rule.sat_clip``; autograd takes the gradient.
    """
    assert config is not None, "the sat_gspo loss needs the actor config (clip ratios, policy_loss)"
    sat: SATPolicyLossConfig = sat_settings(config.policy_loss)
    args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
    if not sat.sat_enabled:
        return _disabled(compute_policy_loss_gspo, args, response_mask)
    eps_low, eps_high = clip_radii(config)
    if not response_mask.any():
        return empty_batch(log_prob, eps_low, eps_high)
    mu = mu_log_prob(old_log_prob)
    old_log_prob, log_prob = clean_padding(old_log_prob, log_prob, response_mask)
    f = sat_gate(sat, "sequence", config, log_prob, old_log_prob, response_mask)

    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)  # |y_b|
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths  # log rho_b
    # log s_{b,t} = sg[log rho_b] + log pi_{b,t} - sg[log pi_{b,t}], clamped at 10 as verl does
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=GSPO_LOG_RATIO_MAX))  # s
    pg_losses, pg_clipfrac = clipped_surrogate(seq_importance_ratio, advantages, response_mask, f, eps_low, eps_high)
    ppo_kl = masked_mean(-negative_approx_kl.detach(), response_mask)

    base = {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": 0.0}
    metrics = sat_metrics(f, seq_importance_ratio, advantages, response_mask.bool(), eps_low, eps_high)
    return _aggregate(pg_losses, args, base, metrics, mu)


def _aggregate(
    pg_losses: torch.Tensor, args: tuple, base: dict[str, Any], metrics: dict[str, float], mu: torch.Tensor
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``agg_loss`` over -S (times ``rollout_is_weights``), and every metric as a float."""
    _, log_prob, _, response_mask, loss_agg_mode, config, rollout_is_weights = args
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    metrics = {**{k: float(v) for k, v in base.items()}, **metrics, **mismatch_metric(log_prob, mu, response_mask)}
    return pg_loss, {**metrics, **scope_metrics(log_prob, response_mask)}


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
