"""The study loop's packed micro-batches and DPPO-TV composition (studies/lib/loop.py, issue 46).

Packing by a token budget is verl's dynamic batching (``rearrange_micro_batches``); with
``sat_quantile_scope=step`` the accumulated gradient is the whole-step one, with ``micro_batch`` a
micro-batch of fewer than 1 / (1 - alpha) responses starves SAT-GSPO's gate (it becomes GSPO).
DPPO-TV's mask is verl's ``dppo_tv`` loss's, and the intercepted-token mask counts what the rule counts.
"""

from __future__ import annotations

import pytest
import torch

import verl_sat  # noqa: F401  (registers the SAT losses)
from studies.lib.loop import LoopConfig, StudyLoop, dppo_tv_valid, intercepted_tokens

SMALL = {"prompts_per_step": 4, "rollout_n": 3, "max_response_length": 4, "routing_replay": "R3", "seed": 7}


def gradient(model_and_tokenizer, batch, **overrides) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The gradient one update accumulates on ``batch`` (the optimizer step disabled), and its metrics."""
    loop = StudyLoop(LoopConfig(**{**SMALL, **overrides}), *model_and_tokenizer)
    loop.optimizer.step = lambda: None
    metrics = loop.update(batch)
    return [p.grad.clone() for p in loop.policy.parameters() if p.grad is not None], metrics


def a_batch(model_and_tokenizer):
    loop = StudyLoop(LoopConfig(**SMALL), *model_and_tokenizer)
    return loop, loop.generate()


def budget(batch, responses: int) -> int:
    """A token budget holding about ``responses`` of this batch's longest sequences."""
    return responses * int(batch.attention_mask.sum(-1).max())


def test_packing_is_verls_dynamic_batching_within_the_budget(model_and_tokenizer):
    loop, batch = a_batch(model_and_tokenizer)
    limit = budget(batch, 2)
    loop.cfg.max_token_len = limit
    parts = loop.micro_batches(batch)
    assert sorted(i for part in parts for i in part) == list(range(batch.input_ids.shape[0]))
    assert len(parts) > 1
    lengths = batch.attention_mask.sum(-1)
    assert all(int(lengths[part].sum()) <= limit for part in parts)
    assert all(1 <= len(part) <= 2 for part in parts)
    loop.cfg.max_token_len = 0
    assert loop.micro_batches(batch) == [list(range(batch.input_ids.shape[0]))]


def test_a_rows_log_probs_do_not_depend_on_the_other_rows(model_and_tokenizer):
    """One forward over the step gives each micro-batch the log-probs its own forward would (R3 on)."""
    from studies.lib.loop import _rows

    loop, batch = a_batch(model_and_tokenizer)
    loop.cfg.max_token_len = budget(batch, 2)
    with torch.no_grad():
        whole = loop.log_probs(batch)[0]
        for rows in loop.micro_batches(batch):
            alone = loop.log_probs(_rows(batch, rows))[0]
            assert float((alone - whole[rows]).abs().max()) < 1e-5


@pytest.mark.parametrize(
    "arm",
    [
        {"loss_mode": "sat_gspo"},
        {"loss_mode": "sat_gspo", "sat_enabled": False},
        {"loss_mode": "sat_gspo", "dppo_tv_mask": 1e-3},
        {"loss_mode": "dppo_tv", "loss_agg_mode": "token-mean", "eps_low": 1e-3, "eps_high": 1e-3},
    ],
)
def test_packed_step_scope_accumulates_the_whole_step_gradient(model_and_tokenizer, varied_reward, arm):
    """q over the step (the scoring pass) and verl's global-batch loss scaling: packing changes
    nothing but float rounding, for SAT-GSPO, GSPO, SAT-GSPO + DPPO-TV's mask and DPPO-TV."""
    _, batch = a_batch(model_and_tokenizer)
    whole, whole_metrics = gradient(model_and_tokenizer, batch, **arm)
    packed, packed_metrics = gradient(model_and_tokenizer, batch, max_token_len=budget(batch, 2), **arm)
    assert packed_metrics["study/micro_batches"] > 1
    assert max(float((a - b).abs().max()) for a, b in zip(whole, packed, strict=True)) < 1e-5
    assert max(float(g.abs().max()) for g in whole) > 1e-4  # a real gradient, not two zeros
    if arm.get("sat_enabled", True) and arm["loss_mode"] == "sat_gspo":
        assert packed_metrics["study/mb_gate_rate"] == pytest.approx(whole_metrics["actor/sat_gate_rate"])


def test_micro_batch_q_starves_sat_gspos_gate_into_gspo(model_and_tokenizer, varied_reward):
    """With at most 2 responses per micro-batch (< 1 / (1 - 0.9)), q is the top response's own
    score, the strict |d| > q gates nothing, and SAT-GSPO's gradient is GSPO's."""
    _, batch = a_batch(model_and_tokenizer)
    packed = {"max_token_len": budget(batch, 2)}
    # a mismatch so that q > 0 (without one SAT-GSPO's score is 0 and nothing gates either way)
    batch.rollout_log_prob = batch.rollout_log_prob - 0.05 * torch.rand_like(batch.rollout_log_prob)
    batch.rollout_log_prob *= batch.response_mask
    step_grad, step_metrics = gradient(model_and_tokenizer, batch, **packed)
    micro_grad, micro_metrics = gradient(model_and_tokenizer, batch, sat_quantile_scope="micro_batch", **packed)
    gspo_grad, _ = gradient(model_and_tokenizer, batch, sat_enabled=False, **packed)
    assert micro_metrics["study/mb_starved_frac"] == 1.0
    assert micro_metrics["study/mb_gate_rate"] == 0.0
    assert step_metrics["study/mb_gate_rate"] > 0.0  # the step's q gates the top tenth
    assert max(float((a - b).abs().max()) for a, b in zip(micro_grad, gspo_grad, strict=True)) < 1e-6


@pytest.mark.parametrize("seed", range(5))
def test_dppo_tv_valid_is_verls_dppo_tv_mask(seed):
    """The composed mask masks exactly the tokens verl's dppo_tv loss masks (its pg_clipfrac)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config.actor import ActorConfig

    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(6, 5, generator=g).clamp(min=0.05))
    new = old + 0.02 * torch.randn(6, 5, generator=g)
    adv = torch.randn(6, 1, generator=g).expand(6, 5)
    mask = (torch.rand(6, 5, generator=g) > 0.2).float()
    radii = {"clip_ratio": 1e-3, "clip_ratio_low": 1e-3, "clip_ratio_high": 1e-3, "clip_ratio_c": 20.0}
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **radii)
    _, metrics = get_policy_loss_fn("dppo_tv")(old, new, adv, mask, "token-mean", config, None)
    valid = dppo_tv_valid(new, old, adv, 1e-3)
    assert float(((1 - valid) * mask).sum() / mask.sum()) == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
    assert 0 < float(((1 - valid) * mask).sum()) < float(mask.sum())  # the draw masks some tokens, not all


@pytest.mark.parametrize("seed", range(5))
def test_the_intercepted_mask_counts_what_the_rule_counts(seed):
    from verl_sat.sat.rule import intercepted, sat_factors

    g = torch.Generator().manual_seed(seed)
    d = 0.3 * torch.randn(8, 6, generator=g)
    mask = (torch.rand(8, 6, generator=g) > 0.1).float()
    ratio = torch.exp(0.15 * torch.randn(8, 6, generator=g))
    adv = torch.randn(8, 6, generator=g)
    f = sat_factors(d, mask, 0.7, "hill", 2.0)
    tokens = intercepted_tokens(ratio, adv, f, 0.2, 0.2)
    assert int(tokens.sum()) == int(intercepted(ratio, adv, f, 0.2, 0.2))
    assert not bool((tokens & ~f.gate.bool()).any())  # only gated tokens are intercepted


def test_bad_packing_settings_name_the_field():
    for field, value in (("sat_quantile_scope", "batch"), ("max_token_len", -1), ("dppo_tv_mask", 1.5)):
        with pytest.raises(ValueError, match=field):
            LoopConfig(**{field: value})
