"""q over the optimizer step's batch: a scoring pass before the step's first backward (docs/sat.md#the-rule step 2).

"The batch" of SAT's reference q is every active token that one optimizer update accumulates:
every micro-batch of the mini-batch, on every data-parallel rank, scored at that step's weights.
verl calls a policy loss once per micro-batch, so no loss call sees the step. Taking q per
micro-batch breaks SAT-GSPO at the paper's shapes: with dynamic batching (~35k tokens) and
multi-thousand-token responses a micro-batch holds a few sequences, and once its top sequence
holds >= 1 - alpha of the tokens q equals that sequence's own score; the strict |d| > q then
gates nothing and SAT-GSPO silently becomes GSPO.

So, per optimizer step (one ``forward_backward_batch`` of the actor's engine, FSDP or Megatron):

1. scoring pass: log pi_j of every micro-batch at the step's weights (forward only, no grad);
   with ``sat_step_score=old_log_prob`` the recomputed old log-probs instead (no forward);
2. d = the loss's own score (token log-ratio for ``sat``, GSPO's sequence log-ratio for
   ``sat_gspo``, broadcast to |y_b| tokens), |d| over this rank's active tokens;
3. q = exact inverse-CDF alpha-quantile of |d| over all ranks (``verl_sat.sat.quantile``: radix
   selection, histograms all-reduced, no token gathered);
4. the training pass: every micro-batch's loss gates on the scoring pass's d against that q
   (``LossContext.step_q`` / ``score_log_prob``), so at most 1 - alpha of the step's active
   tokens are gated, exactly, even where kernels are not bit-deterministic.

Cost: one forward over the step's tokens (about a third of a forward+backward) with the default
``forward`` scoring; nothing with ``old_log_prob``, and nothing when one micro-batch on one rank
is the whole step (its own q is then the step's: the CPU default). ``benchmarks/step_quantile_cost.py`` measures it.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_sat.sat.config import sat_settings
from verl_sat.sat.quantile import exact_quantile, global_count
from verl_sat.sat.rule import padded_log_ratio, sequence_score

STEP_Q_KEY = "sat_step_q"  # non-tensor entry of the mini-batch (and so of every micro-batch)
SCORE_FIELD = "sat_score_log_probs"  # the scoring pass's log pi, laid out like model_output["log_probs"]
SCORE_FROM_OLD_KEY = "sat_score_from_old_log_probs"  # non-tensor: the score's log pi is old_log_probs
SCORE_PASS_S_KEY = "sat_score_pass_s"  # non-tensor: seconds the scoring pass took
STEP_TOKENS_KEY = "sat_step_tokens"  # non-tensor: active tokens of the step, all ranks
WHOLE_STEP_KEY = "sat_micro_batch_is_step"  # non-tensor: one micro-batch on one rank is the step
SAT_LOSS_MODES = ("sat", "sat_gspo")


def needs_step_q(actor_config: Any) -> bool:
    """A SAT loss, enabled, with ``sat_quantile_scope=step``."""
    policy_loss = actor_config.policy_loss
    loss_mode = policy_loss.get("loss_mode", "vanilla") if hasattr(policy_loss, "get") else policy_loss.loss_mode
    if loss_mode not in SAT_LOSS_MODES:
        return False
    sat = sat_settings(policy_loss)
    return sat.sat_enabled and sat.sat_quantile_scope == "step"


def padded(data: Any, key: str) -> torch.Tensor:
    value = data[key]
    return value.to_padded_tensor(0.0) if getattr(value, "is_nested", False) else value


def step_scores(
    loss_mode: str, score_log_prob: torch.Tensor, ref: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(|d| values, multiplicities) of this rank's share of the step, exactly as the loss scores.

    sat:      |d_{b,t}| = |clamp(log pi - log ref, -20, 20)| over T_act, multiplicity 1
    sat_gspo: |log rho_b| once per response, multiplicity |y_b| (broadcast to its tokens, docs/sat.md#sequence-level)
    Built from the loss's own ops (``rule.padded_log_ratio``, ``rule.sequence_score``): the same bits,
    whatever padding holds and however wide the rows are padded.
    """
    if loss_mode == "sat_gspo":
        lengths = torch.sum(response_mask, dim=-1)
        seq = sequence_score(padded_log_ratio(score_log_prob, ref, response_mask, clamp=False), lengths)
        return seq.abs()[lengths > 0], lengths[lengths > 0]
    d = padded_log_ratio(score_log_prob, ref, response_mask, clamp=True)
    return d.abs()[response_mask.bool()], None


def score_reference_field(actor_config: Any) -> str:
    """The batch field of the score's denominator (docs/sat.md#which-log-probs): old_log_probs, or the rollout's mu."""
    sat = sat_settings(actor_config.policy_loss)
    return "rollout_log_probs" if sat.sat_score_against == "rollout_log_probs" else "old_log_probs"


def compute_step_q(actor_config: Any, data: Any, score_log_prob: torch.Tensor, group: Any = None) -> torch.Tensor:
    """q of the step from this rank's share (``data``: the mini-batch, padded score log pi)."""
    sat = sat_settings(actor_config.policy_loss)
    ref_key = score_reference_field(actor_config)
    if ref_key not in data.keys():
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.sat_score_against={sat.sat_score_against}: the batch has no "
            f"{ref_key!r} (actor_rollout_ref.rollout.calculate_log_probs=true)"
        )
    mask = padded(data, "response_mask")
    ref = padded(data, ref_key).to(device=score_log_prob.device, dtype=score_log_prob.dtype)
    values, weights = step_scores(actor_config.policy_loss.loss_mode, score_log_prob, ref, mask.to(ref.device))
    n_step = global_count(int(mask.bool().sum()), ref.device, group)
    return exact_quantile(values, sat.sat_alpha, weights, group), n_step
