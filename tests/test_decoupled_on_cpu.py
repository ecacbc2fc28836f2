"""The decoupled option of docs/sat.md#which-log-probs: the ratio against old_log_prob, the SAT score against mu.

``sat_score_against=rollout_log_probs`` takes mu from ``verl_sat.sat.losses.LossContext``, which
verl-sat's worker loss opens with the batch's rollout log-probs. The rule itself is unchanged,
so the properties of docs/sat.md#the-rule hold for whatever score d it is given. The property tests draw from
``sat_strategies.sat_cases(decoupled=True)`` (the staleness in the score against mu, the ratio
against old_log_prob k times it plus noise) and compare with the spec's formulas.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import actor_config, cached_actor_config, random_batch
from hypothesis import given
from sat_strategies import (
    LEVELS,
    PROPERTY,
    SATCase,
    assert_biting_share,
    gate_capacity,
    run_loss,
    sat_cases,
    spec_rule,
)
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from verl_sat import SATPolicyLossConfig
from verl_sat.sat.losses import loss_context
from verl_sat.sat.rule import sat_factors

DECOUPLED = {"sat_score_against": "rollout_log_probs"}


def run(name: str, b: dict, cfg, mu: torch.Tensor | None = None, context: bool = True):
    """(loss, metrics, d loss/d log_prob, per-token loss, context) with ``mu`` in a LossContext."""
    log_prob = b["log_prob"].clone().requires_grad_(True)
    w = torch.ones_like(log_prob, requires_grad=True)
    fn = get_policy_loss_fn(name)
    args = (b["old_log_prob"], log_prob, b["advantages"], b["response_mask"], "token-sum", cfg, w)
    if context:
        with loss_context(mu) as ctx:
            loss, metrics = fn(*args)
    else:
        ctx = None
        loss, metrics = fn(*args)
    loss.backward()
    return loss.detach(), metrics, log_prob.grad, w.grad, ctx


def test_config_names_the_key():
    with pytest.raises(ValueError, match=r"policy_loss.sat_score_against must be one of .*got 'mu'"):
        SATPolicyLossConfig(sat_score_against="mu")


@pytest.mark.parametrize("name", ["sat", "sat_gspo"])
def test_rollout_reference_without_mu_names_the_key(name):
    b = random_batch(0, 2, 4)
    with pytest.raises(ValueError, match="sat_score_against=rollout_log_probs needs the rollout's log-probs"):
        run(name, b, actor_config(name, **DECOUPLED), context=False)
    with pytest.raises(ValueError, match="do not match old_log_prob"):
        run(name, b, actor_config(name, **DECOUPLED), mu=torch.zeros(2, 5))


@pytest.mark.parametrize("level", LEVELS)
def test_mu_equal_to_old_is_bit_identical_to_the_default(level):
    """In bypass mode mu is old_log_prob: the decoupled score changes nothing, bit for bit."""
    flags = []

    @PROPERTY
    @given(case=sat_cases(level))
    def check(case: SATCase) -> None:
        settings = case.sat_settings()
        default = run_loss(case.loss_name, case.batch(), cached_actor_config(case.loss_name, **settings))
        cfg = cached_actor_config(case.loss_name, **settings, **DECOUPLED)
        decoupled = run_loss(case.loss_name, case.batch(), cfg, mu=case.old_log_prob.clone())
        assert torch.equal(default.loss, decoupled.loss) and torch.equal(default.grad, decoupled.grad)
        assert torch.equal(default.token_loss, decoupled.token_loss) and torch.equal(default.gate, decoupled.gate)
        assert default.metrics == pytest.approx(decoupled.metrics, rel=1e-6)
        flags.append(spec_rule(case).bites)

    check()
    assert_biting_share(flags, f"decoupled, mu = old [{level}]")


@pytest.mark.parametrize("level", LEVELS)
def test_decoupled_pessimism_locus_and_gate(level):
    """docs/sat.md#which-log-probs: the gate and q from the score against mu, the bands from the ratio against
    old_log_prob. -S_SAT >= -S_PPO on every token (strictly on the bands); the gradient differs
    from PPO's exactly on the bands; the gate is the spec's and gates at most n - ceil(alpha n)
    tokens; dbar_pi is measured against mu."""
    flags = []

    @PROPERTY
    @given(case=sat_cases(level, decoupled=True))
    def check(case: SATCase) -> None:
        cfg = cached_actor_config(case.loss_name, **case.sat_settings(), **DECOUPLED)
        cfg_base = cached_actor_config(case.base_name, eps_low=case.eps_low, eps_high=case.eps_high)
        sat = run_loss(case.loss_name, case.batch(), cfg, mu=case.mu)
        base = run_loss(case.base_name, case.batch(), cfg_base)
        spec = spec_rule(case)
        mask = case.mask
        n = int(mask.sum())
        assert np.array_equal(sat.gate.numpy(), spec.gate) and sat.metrics["actor/sat_q"] == spec.q
        assert int(spec.gate.sum()) <= gate_capacity(n, case.alpha)
        clear = mask & torch.from_numpy(~spec.ambiguous)
        band = torch.from_numpy(spec.band) & clear
        assert torch.all(sat.token_loss[mask] >= base.token_loss[mask])
        assert torch.all(sat.token_loss[band] > base.token_loss[band])
        changed = sat.grad != base.grad
        assert torch.equal(changed[clear], band[clear])
        assert torch.all(sat.grad[band] == 0)
        dbar = (case.log_prob.double() - case.mu.double()).abs()[mask].mean().item()
        assert sat.metrics["actor/mismatch_abs_mean"] == pytest.approx(dbar, rel=1e-5, abs=1e-9)
        flags.append(spec.bites)

    check()
    assert_biting_share(flags, f"decoupled pessimism and locus [{level}]")


def test_score_against_mu_while_the_ratio_stays_one():
    """old_log_prob = log pi (r = 1): the default gates nothing; the decoupled score gates the stale token."""
    d = torch.tensor([[0.0, 0.01, -0.01, 0.01, -0.01, 0.01, -0.01, 0.01, -0.01, 0.15]])
    log_prob = torch.full_like(d, -1.0)
    b = {"old_log_prob": log_prob.clone(), "log_prob": log_prob, "advantages": torch.ones_like(d)}
    b["response_mask"] = torch.ones_like(d)
    mu = log_prob - d  # d = log pi - log mu
    _, default, _, _, _ = run("sat", b, actor_config("sat"), mu=mu)
    loss, decoupled, grad, _, ctx = run("sat", b, actor_config("sat", **DECOUPLED), mu=mu)
    _, _, base_grad, _, _ = run("vanilla", b, actor_config("vanilla"), context=False)
    assert default["actor/sat_gate_rate"] == 0.0 and default["actor/sat_q"] == 0.0
    assert decoupled["actor/sat_q"] == pytest.approx(0.01) and decoupled["actor/sat_gate_rate"] == pytest.approx(0.1)
    assert ctx.gate.tolist() == [[False] * 9 + [True]]
    # r = 1 lies inside every contracted range: the loss and its gradient are PPO's
    assert torch.equal(grad, base_grad) and loss.item() == pytest.approx(-10.0)
    # dbar_pi is against mu in both modes (the context carries it); the ratio's KL is 0
    assert decoupled["actor/mismatch_abs_mean"] == pytest.approx(d.abs().mean().item(), rel=1e-5)
    assert default["actor/mismatch_abs_mean"] == pytest.approx(d.abs().mean().item(), rel=1e-5)
    assert decoupled["actor/ppo_kl"] == 0.0


@pytest.mark.parametrize("name", ["sat", "sat_gspo"])
def test_context_returns_the_loss_gate(name):
    b = random_batch(5, 4, 12, scale=0.3)
    mask = b["response_mask"].bool()
    _, _, _, _, ctx = run(name, b, actor_config(name), mu=b["old_log_prob"])
    d = (b["log_prob"] - b["old_log_prob"]).clamp(-20, 20)
    if name == "sat_gspo":
        m = b["response_mask"]
        d = ((d * m).sum(-1) / m.sum(-1).clamp(min=1)).unsqueeze(-1).expand_as(d)
    assert torch.equal(ctx.gate, sat_factors(d, mask, 0.9, "hill", 2.0).gate)


def test_disabled_loss_reports_dbar_pi_against_mu():
    b = random_batch(1, 3, 8, scale=0.2)
    mu = b["old_log_prob"] - 0.5
    loss, metrics, _, _, ctx = run("sat", b, actor_config("sat", sat_enabled=False), mu=mu)
    base, _, _, _, _ = run("vanilla", b, actor_config("vanilla"), context=False)
    mask = b["response_mask"].bool()
    assert torch.equal(loss, base) and ctx.gate is None
    expected = (b["log_prob"] - mu).abs()[mask].mean().item()
    assert metrics["actor/mismatch_abs_mean"] == pytest.approx(expected, rel=1e-5)
