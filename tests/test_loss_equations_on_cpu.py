"""The registered losses ``sat`` and ``sat_gspo`` (``verl_sat/sat/losses.py``) against the paper's equations.

The reference below uses no verl_sat code: q, the gate, the factors and the radii come from
``sat_strategies.spec_rule`` (docs/sat.md#the-rule, steps 1-6, in float64 numpy), each token's
loss and its derivative are written out from step 7 (and docs/sat.md#sequence-level), and only
verl's ``agg_loss`` weighs the tokens. The loss must give that loss, gradient and those metrics
within fp rounding at every dtype, and stay finite when padding holds -inf or NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import actor_config, random_batch
from hypothesis import given
from hypothesis import strategies as st
from sat_strategies import (
    AGG_MODES,
    DUAL_CLIP_C,
    LEVELS,
    PROPERTY,
    SATCase,
    assert_biting_share,
    sat_cases,
    spec_rule,
    spec_token_loss,
)
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn

from verl_sat.sat.losses import loss_context

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def agg_weights(mask: torch.Tensor, agg: str) -> np.ndarray:
    """w with agg_loss(L) = sum w * L: verl's aggregation is linear in the loss matrix, so its
    gradient at any L is the weight of each token (float64)."""
    x = torch.zeros(mask.shape, dtype=torch.float64, requires_grad=True)
    agg_loss(loss_mat=x, loss_mask=mask.double(), loss_agg_mode=agg).backward()
    return x.grad.numpy()


def reference(case: SATCase, agg: str) -> dict:
    """The loss, its gradient and metrics from docs/sat.md in float64 numpy, no verl_sat code.

    Per active token, -S = -min(r A, clip(r, 1 - eps_low~, 1 + eps_high~) A) (``spec_token_loss``;
    verl's dual clip min(-S, -A c) where A < 0 at token level). Its derivative w.r.t. log pi is
    -A r where -S moves with r and 0 where the clip holds it at a bound: A > 0 and r > 1 + eps_high~,
    A < 0 and r < 1 - eps_low~, or the dual clip (r > c, A < 0). Token level: r = pi / pi_old, so
    dr / dlog pi = r. Sequence level: GSPO-token's s = sg(rho_b) pi / sg(pi) has value rho_b and
    ds / dlog pi = rho_b. ``ambiguous``: r within rounding of a bound, where the dtype decides the clip
    and, at an exact tie of the max/min, autograd splits the gradient (a subgradient of the kink).
    """
    spec = spec_rule(case)
    mask = case.mask.numpy()
    r, adv = spec.ratio, case.advantages.double().numpy()
    w = agg_weights(case.response_mask, agg)
    token_loss = spec_token_loss(case, spec)
    clipped = ((adv > 0) & (r > spec.upper)) | ((adv < 0) & (r < spec.lower))
    held = clipped | ((adv < 0) & (r > DUAL_CLIP_C)) if case.level == "token" else clipped
    moving = np.where(mask, -adv * r, 0.0)
    lower_held = (adv < 0) & (-np.minimum(r * adv, np.clip(r, spec.lower, spec.upper) * adv) > -adv * DUAL_CLIP_C)
    margin = 8 * torch.finfo(case.dtype).eps
    ambiguous = spec.ambiguous | (mask & (np.abs(r - DUAL_CLIP_C) <= margin))
    log_ratio = np.where(mask, (case.log_prob - case.old_log_prob).double().numpy(), 0.0)
    n = mask.sum()
    c_min = np.minimum(spec.c_plus, spec.c_minus)[mask]
    metrics = {
        "actor/pg_clipfrac": (clipped & mask).sum() / n,
        "actor/ppo_kl": -log_ratio.sum() / n,
        "actor/pg_clipfrac_lower": (lower_held & mask).sum() / n if case.level == "token" else 0.0,
        "actor/sat_q": spec.q,
        "actor/sat_gate_rate": spec.gate.sum() / n,
        "actor/sat_c_min": c_min.min(),
        "actor/sat_eps_low_mean": (1 - spec.lower)[mask].mean(),
        "actor/sat_eps_high_mean": (spec.upper - 1)[mask].mean(),
        "actor/sat_intercepted_frac": spec.band.sum() / n,
        "actor/mismatch_abs_mean": np.abs(log_ratio).sum() / n,
    }
    return {
        "loss": float((w * token_loss).sum()),
        "grad": w * np.where(held, 0.0, moving),  # d loss / d log pi
        "moving": w * moving,  # the same where nothing is held
        "scale": float((np.abs(w) * np.abs(adv) * np.maximum(r, 1.0) * mask).sum()),  # sum |terms|, for rounding
        "metrics": {k: float(v) for k, v in metrics.items()},
        "ambiguous": ambiguous,
        "count_slack": ambiguous.sum() / n,  # a count metric may differ by one per ambiguous token
        "bites": spec.bites,
    }


def run(name: str, b: dict, agg: str, **kw):
    lp = b["log_prob"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(name)(
        b["old_log_prob"], lp, b["advantages"], b["response_mask"], agg, actor_config(name, **kw)
    )
    loss.backward()
    return loss.detach(), lp.grad, metrics


# bf16 only with radii it can resolve near 1 (spacing 2^-7): GSPO's 3e-4 rounds onto 1 itself
CASES = {
    level: st.one_of(
        sat_cases(level),
        sat_cases(level, dtypes=(torch.bfloat16,), radii=((0.2, 0.2), (0.2, 0.28))),
    )
    for level in LEVELS
}


@pytest.mark.parametrize("level", LEVELS)
def test_loss_equals_the_equations(level):
    """The loss, its gradient w.r.t. log pi and its metrics equal ``reference`` (docs/sat.md,
    step 7 written out per token), in every loss_agg_mode and dtype (bf16 included): the loss
    within the dtype's rounding of its terms, the gradient token by token (where r is within
    rounding of a bound, a subgradient of the kink: between 0 and that token's moving gradient),
    padding's gradient 0. Bites where a band token (clipped by SAT, not by PPO) is present."""
    flags = []

    @PROPERTY
    @given(case=CASES[level], agg=st.sampled_from(AGG_MODES))
    def check(case: SATCase, agg: str) -> None:
        ref = reference(case, agg)
        loss, grad, metrics = run(case.loss_name, case.batch(), agg, **case.sat_settings())
        tol = TOL[case.dtype]
        zeros = torch.zeros_like(case.log_prob)
        assert loss.dtype == agg_loss(loss_mat=zeros, loss_mask=case.response_mask, loss_agg_mode=agg).dtype  # verl's
        slack = tol + 2 * torch.finfo(case.dtype).eps * ref["scale"]  # rounding of each term, summed
        assert float(loss) == pytest.approx(ref["loss"], rel=tol, abs=slack)
        grad = grad.double().numpy()
        clear = case.mask.numpy() & ~ref["ambiguous"]
        np.testing.assert_allclose(grad[clear], ref["grad"][clear], rtol=tol, atol=tol)
        assert np.all(grad[~case.mask.numpy()] == 0)
        near, moving = ref["ambiguous"], ref["moving"][ref["ambiguous"]]
        between = (grad[near] * moving >= 0) & (np.abs(grad[near]) <= np.abs(moving) * (1 + tol) + tol)
        assert between.all()
        for key, value in ref["metrics"].items():
            mtol = max(tol, 1e-6)  # verl divides by n + 1e-8
            if key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/sat_intercepted_frac"):
                mtol += ref["count_slack"]
            assert metrics[key] == pytest.approx(value, rel=mtol, abs=mtol), key
        flags.append(ref["bites"])

    check()
    # half the draws are bf16, where the 8-ulp rounding margin around each endpoint is 1/16 in r:
    # about 20% of those draws bite against about 40% in fp32/fp64, so the floor is a quarter
    assert_biting_share(flags, f"loss = the equations [{level}]", minimum=0.25)


@pytest.mark.parametrize("name,base", [("sat", "vanilla"), ("sat_gspo", "gspo")])
def test_exact_off_the_gated_tokens(name, base):
    """fp32, a batch with a gate: off the gated tokens (token level) or responses (sequence level)
    every gradient is verl's vanilla / gspo, bit for bit."""
    b = random_batch(11, 32, 64, scale=0.3)
    with loss_context() as ctx:
        _, grad, metrics = run(name, b, "token-sum", sat_alpha=0.5)
    lp = b["log_prob"].clone().requires_grad_(True)
    loss = get_policy_loss_fn(base)(
        b["old_log_prob"], lp, b["advantages"], b["response_mask"], "token-sum", actor_config(base)
    )[0]
    loss.backward()
    assert metrics["actor/sat_gate_rate"] > 0
    off = b["response_mask"].bool() & ~ctx.gate
    if name == "sat_gspo":
        off = b["response_mask"].bool() & ~ctx.gate.any(-1, keepdim=True)
    assert off.any() and torch.equal(grad[off], lp.grad[off])


@pytest.mark.parametrize("name,base", [("sat", "vanilla"), ("sat_gspo", "gspo")])
@pytest.mark.parametrize("pad", [float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["log_prob", "old_log_prob", "both"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_padding_holding_inf_or_nan_keeps_everything_finite(name, base, pad, where, gated, agg):
    """SAT on: loss, gradient and every metric finite, and equal to those of clean padding."""
    b = random_batch(5, 16, 16, scale=0.3 if gated else 0.0)
    b["response_mask"][:, -3:] = 0  # every row has padding
    clean = run(name, b, agg, sat_alpha=0.5)
    assert (clean[2]["actor/sat_gate_rate"] > 0) == gated
    dirty = {k: v.clone() for k, v in b.items()}
    pad_at = ~b["response_mask"].bool()
    for key in ["log_prob", "old_log_prob"] if where == "both" else [where]:
        dirty[key][pad_at] = pad
    loss, grad, metrics = run(name, dirty, agg, sat_alpha=0.5)
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
    off = run(name, b, "seq-mean-token-mean", sat_enabled=False)[0]
    lp = b["log_prob"].clone().requires_grad_(True)
    verl = get_policy_loss_fn(base)(
        b["old_log_prob"], lp, b["advantages"], b["response_mask"], "seq-mean-token-mean", actor_config(base)
    )[0]
    # verl's seq-mean aggregation multiplies the padding by 0: NaN * 0 is NaN, for both losses
    assert torch.isnan(verl) and torch.isnan(off)
