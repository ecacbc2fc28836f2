"""The fused SAT surrogates (``verl_sat/sat/fused.py``) against the autograd form they replace.

The reference below is SAT's loss written as autograd ops (PPO's clamp, then the gated tokens
re-clipped by ``rule.sat_clip``), the form the fused path replaces. The fused path must give the
same loss, gradient and metrics within fp rounding at every dtype, and stay finite when padding
holds -inf or NaN log-probs.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import actor_config, random_batch
from hypothesis import given
from hypothesis import strategies as st
from sat_strategies import AGG_MODES, LEVELS, PROPERTY, SATCase, assert_biting_share, sat_cases, spec_rule
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn

from verl_sat.sat.fused import sequence_score
from verl_sat.sat.rule import adaptive_bounds, intercepted, sat_clip, sat_factors

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(name: str, b: dict, agg: str, eps=(0.2, 0.2), alpha=0.9, kernel=("hill", 2.0), clip_c=3.0):
    """(loss, grad, metrics) of SAT written as autograd ops (docs/sat.md#the-rule, step 7;
    docs/sat.md#sequence-level)."""
    old, adv, rm = b["old_log_prob"], b["advantages"], b["response_mask"]
    lp = b["log_prob"].clone().requires_grad_(True)
    mask = rm.bool()
    if name == "sat":
        d = torch.clamp(lp - old, -20, 20)
        ratio = torch.exp(d)
        score = d
    else:
        seq = torch.sum((lp - old) * rm, -1) / rm.sum(-1).clamp(min=1)
        ratio = torch.exp(torch.clamp(lp - lp.detach() + seq.detach().unsqueeze(-1), max=10.0))
        score = sequence_score((lp - old).detach() * rm, rm.sum(-1)).unsqueeze(-1).expand_as(lp)  # the gate's
        d = lp - old
    f = sat_factors(score, mask, alpha, *kernel)
    pg1 = -adv * ratio
    pg2 = -adv * sat_clip(ratio, f, *eps)
    pg = torch.maximum(pg1, pg2)
    lower = torch.zeros(())
    if name == "sat":
        pg3 = -adv * clip_c
        lower = ((torch.gt(pg, pg3) & (adv < 0)) & mask).sum() / mask.sum()
        pg = torch.where(adv < 0, torch.min(pg3, pg), pg)
    loss = agg_loss(loss_mat=pg, loss_mask=rm, loss_agg_mode=agg)
    loss.backward()
    n = mask.sum()
    lo, hi = adaptive_bounds(f, *eps, like=ratio)
    metrics = {
        "actor/pg_clipfrac": ((pg2 > pg1) & mask).sum() / n,
        "actor/ppo_kl": -(d.detach() * rm).sum() / n,
        "actor/pg_clipfrac_lower": lower,
        "actor/sat_q": f.q,
        "actor/sat_gate_rate": (f.gate & mask).sum() / n,
        "actor/sat_c_min": torch.minimum(f.c_plus, f.c_minus)[mask].min(),
        "actor/sat_eps_low_mean": (1 - lo)[mask].mean(),
        "actor/sat_eps_high_mean": (hi - 1)[mask].mean(),
        "actor/sat_intercepted_frac": intercepted(ratio, adv, f, *eps) / n,
        "actor/mismatch_abs_mean": (d.detach().abs() * rm).sum() / n,
    }
    return loss.detach(), lp.grad, {k: float(v) for k, v in metrics.items()}


def fused(name: str, b: dict, agg: str, **kw):
    lp = b["log_prob"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(name)(
        b["old_log_prob"], lp, b["advantages"], b["response_mask"], agg, actor_config(name, **kw)
    )
    loss.backward()
    return loss.detach(), lp.grad, metrics


# bf16 only with radii it can resolve near 1 (spacing 2^-7): GSPO's 3e-4 rounds onto 1 itself
FUSED_CASES = {
    level: st.one_of(
        sat_cases(level),
        sat_cases(level, dtypes=(torch.bfloat16,), radii=((0.2, 0.2), (0.2, 0.28))),
    )
    for level in LEVELS
}


@pytest.mark.parametrize("level", LEVELS)
def test_fused_equals_autograd_form(level):
    flags = []

    @PROPERTY
    @given(case=FUSED_CASES[level], agg=st.sampled_from(AGG_MODES))
    def check(case: SATCase, agg: str) -> None:
        name, b = case.loss_name, case.batch()
        dtype = case.dtype
        rule = {"eps": (case.eps_low, case.eps_high), "alpha": case.alpha, "kernel": (case.kernel, case.exponent)}
        ref_loss, ref_grad, ref_metrics = reference(name, b, agg, **rule)
        loss, grad, metrics = fused(name, b, agg, **case.sat_settings())
        tol = TOL[dtype]
        assert loss.dtype == ref_loss.dtype
        torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
        if dtype == torch.bfloat16:
            # bf16 rounds -A r and -A b equal where r is an ulp from a clip bound: autograd's max/min
            # then halves the gradient, the fused backward gives it whole (docs/sat.md, "rounding ties")
            tie = ~torch.isclose(grad, ref_grad, rtol=tol, atol=tol)
            torch.testing.assert_close(grad[tie], 2 * ref_grad[tie], rtol=tol, atol=tol)
            grad, ref_grad = grad[~tie], ref_grad[~tie]
        torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)
        for key, value in ref_metrics.items():
            mtol = max(tol, 1e-6)  # verl divides by n + 1e-8
            assert metrics[key] == pytest.approx(value, rel=mtol, abs=mtol), key
        flags.append(spec_rule(case).bites)

    check()
    assert_biting_share(flags, f"fused = autograd form [{level}]")


@pytest.mark.parametrize("name", ["sat", "sat_gspo"])
def test_fused_is_exact_off_the_gated_tokens(name):
    """fp32, a batch with a gate: every token's loss and gradient equal the autograd form's, bitwise."""
    b = random_batch(11, 32, 64, scale=0.3)
    ref_loss, ref_grad, _ = reference(name, b, "token-sum", alpha=0.5)
    loss, grad, metrics = fused(name, b, "token-sum", sat_alpha=0.5)
    assert metrics["actor/sat_gate_rate"] > 0
    assert torch.equal(grad, ref_grad)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name,base", [("sat", "vanilla"), ("sat_gspo", "gspo")])
@pytest.mark.parametrize("pad", [float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["log_prob", "old_log_prob", "both"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_padding_holding_inf_or_nan_keeps_everything_finite(name, base, pad, where, gated, agg):
    """SAT on: loss, gradient and every metric finite, and equal to those of clean padding."""
    b = random_batch(5, 16, 16, scale=0.3 if gated else 0.0)
    b["response_mask"][:, -3:] = 0  # every row has padding
    clean = fused(name, b, agg, sat_alpha=0.5)
    assert (clean[2]["actor/sat_gate_rate"] > 0) == gated
    dirty = {k: v.clone() for k, v in b.items()}
    pad_at = ~b["response_mask"].bool()
    for key in ["log_prob", "old_log_prob"] if where == "both" else [where]:
        dirty[key][pad_at] = pad
    loss, grad, metrics = fused(name, dirty, agg, sat_alpha=0.5)
    assert torch.isfinite(loss) and torch.all(torch.isfinite(grad))
    assert all(math.isfinite(v) for v in metrics.values())
    assert torch.equal(loss, clean[0]) and torch.equal(grad, clean[1])
    assert metrics == pytest.approx(clean[2])


@pytest.mark.parametrize("name,base", [("sat", "vanilla"), ("sat_gspo", "gspo")])
def test_sat_off_keeps_verls_loss_with_nan_padding(name, base):
    """SAT off: verl's own loss, NaN where verl gives NaN (documented in docs/sat.md)."""
    b = random_batch(5, 4, 16)
    b["response_mask"][:, -3:] = 0
    b["log_prob"][:, -3:] = float("nan")
    off = fused(name, b, "seq-mean-token-mean", sat_enabled=False)[0]
    lp = b["log_prob"].clone().requires_grad_(True)
    verl = get_policy_loss_fn(base)(
        b["old_log_prob"], lp, b["advantages"], b["response_mask"], "seq-mean-token-mean", actor_config(base)
    )[0]
    # verl's seq-mean aggregation multiplies the padding by 0: NaN * 0 is NaN, for both losses
    assert torch.isnan(verl) and torch.isnan(off)
