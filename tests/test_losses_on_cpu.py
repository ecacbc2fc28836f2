"""The registered losses ``sat`` and ``sat_gspo`` against verl's ``vanilla`` and ``gspo``
(docs/sat.md#the-rule, docs/sat.md#sequence-level).

The property tests draw their batches from ``sat_strategies.sat_cases`` and derive what must
happen from the paper's formulas (docs/sat.md), as ``sat_strategies.spec_rule`` writes them out
(the inverse-CDF q by sorting, the kernel, the radii, the newly clipped bands), not from the code's
output. Each asserts that at least a third of its 500 draws reach a band token, where the property
bites.

Per-token surrogate values are read through verl's own aggregation: with
``loss_agg_mode="token-sum"`` and all-ones ``rollout_is_weights`` that require grad,
d loss / d w_{b,t} is the token's loss -S_{b,t} (masked), for SAT and for the base loss alike.
"""

from __future__ import annotations

import ast
import inspect
import math

import numpy as np
import pytest
import torch
from conftest import actor_config, cached_actor_config, random_batch
from hypothesis import given
from hypothesis import strategies as st
from sat_strategies import (
    AGG_MODES,
    LEVELS,
    PROPERTY,
    UNGATED_MODES,
    SATCase,
    assert_biting_share,
    gate_capacity,
    run_loss,
    sat_cases,
    spec_rule,
    spec_token_loss,
    ungated_variant,
)
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

POISON = (None, float("nan"), float("-inf"))  # what padding may hold


def configs(case: SATCase, **sat: object):
    """(SAT loss config, base loss config) with the case's radii."""
    settings = case.sat_settings()
    base = cached_actor_config(case.base_name, eps_low=case.eps_low, eps_high=case.eps_high)
    return cached_actor_config(case.loss_name, **{**settings, **sat}), base


def spec_tol(case: SATCase) -> float:
    """The spec's float64 values vs the loss's dtype: a few ulps of the dtype."""
    return 1e-5 if case.dtype == torch.float32 else 1e-10


def test_agg_modes_are_all_of_verls():
    """AGG_MODES is every mode verl 0.9.1's agg_loss accepts, read from its source."""
    tree = ast.parse(inspect.getsource(core_algos.agg_loss).lstrip())
    modes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and getattr(node.left, "id", None) == "loss_agg_mode":
            for comparator in node.comparators:
                for const in ast.walk(comparator):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        modes.add(const.value)
    assert modes == set(AGG_MODES)


# ---------------------------------------------------------------------------------------------
# identity (docs/sat.md#the-rule): SAT off, or on with no token gated -> verl's base loss, bit for bit
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
def test_identity_when_off(level):
    """sat_enabled=False: loss, gradient, per-token loss and metrics are verl's vanilla / gspo,
    bit for bit, in every loss_agg_mode; in the draws that bite, SAT on would have changed the
    gradient (so the switch is what makes them equal)."""
    flags = []

    @PROPERTY
    @given(case=sat_cases(level), agg=st.sampled_from(AGG_MODES))
    def check(case: SATCase, agg: str) -> None:
        cfg_on, cfg_base = configs(case)
        cfg_off, _ = configs(case, sat_enabled=False)
        base = run_loss(case.base_name, case.batch(), cfg_base, agg)
        off = run_loss(case.loss_name, case.batch(), cfg_off, agg)
        assert torch.equal(off.loss, base.loss) and torch.equal(off.grad, base.grad)
        assert torch.equal(off.token_loss, base.token_loss)
        assert {k: off.metrics[k] for k in base.metrics} == base.metrics
        assert off.gate is None  # the rule did not run
        spec = spec_rule(case)
        if spec.bites:
            on = run_loss(case.loss_name, case.batch(), cfg_on, agg)
            assert not torch.equal(on.grad, base.grad)
        flags.append(spec.bites)

    check()
    assert_biting_share(flags, f"identity when off [{level}]")


@pytest.mark.parametrize("level", LEVELS)
def test_identity_when_no_token_is_gated(level):
    """SAT on, no token gated (the step's q at max |d|, q = 0, or all |d| tied at q): verl's loss
    bit for bit, in every loss_agg_mode. Biting draws: the same tokens would be clipped under a
    q a hair lower (their own micro-batch q, q -> 0+, q just below the tie)."""
    flags = []

    @PROPERTY
    @given(case=sat_cases(level), mode=st.sampled_from(UNGATED_MODES), agg=st.sampled_from(AGG_MODES))
    def check(case: SATCase, mode: str, agg: str) -> None:
        variant, step_q, q_bite = ungated_variant(case, mode)
        spec = spec_rule(variant, q=step_q)
        assert not spec.gate.any()  # the construction gates nothing, by the spec's own rule
        cfg_sat, cfg_base = configs(variant)
        sat = run_loss(variant.loss_name, variant.batch(), cfg_sat, agg, step_q=step_q)
        base = run_loss(variant.base_name, variant.batch(), cfg_base, agg)
        assert sat.metrics["actor/sat_gate_rate"] == 0.0 and not sat.gate.any()
        assert sat.metrics["actor/sat_q"] == spec.q
        assert torch.equal(sat.loss, base.loss) and torch.equal(sat.grad, base.grad)
        assert torch.equal(sat.token_loss, base.token_loss)
        flags.append(spec_rule(variant, q=q_bite).bites)

    check()
    assert_biting_share(flags, f"identity when nothing is gated [{level}]")


# ---------------------------------------------------------------------------------------------
# the empty batch (docs/sat.md#the-rule, edge cases)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
def test_empty_batch_in_every_agg_mode(level):
    """No active token: zero loss, all-zero finite gradient and finite metrics in every
    loss_agg_mode, whatever the padding holds (NaN and -inf included). Biting draws: the same
    tensors with their mask would reach a band."""
    flags = []

    @PROPERTY
    @given(case=sat_cases(level), poison=st.sampled_from(POISON))
    def check(case: SATCase, poison: float | None) -> None:
        batch = case.batch()
        batch["response_mask"] = torch.zeros_like(batch["response_mask"])
        if poison is not None:
            batch["log_prob"][0, 0] = poison
            batch["old_log_prob"][-1, -1] = poison
        cfg_sat, _ = configs(case)
        for agg in AGG_MODES:
            out = run_loss(case.loss_name, batch, cfg_sat, agg, weights=False)
            assert out.loss.item() == 0.0, agg
            assert torch.all(out.grad == 0), agg  # finite (NaN != 0) and zero
            assert all(math.isfinite(v) for v in out.metrics.values()), agg
            assert out.metrics["actor/sat_gate_rate"] == 0.0
        flags.append(spec_rule(case).bites)

    check()
    assert_biting_share(flags, f"empty batch [{level}]")


# ---------------------------------------------------------------------------------------------
# pessimism and the exact locus of change (docs/sat.md#the-rule, Proposition 4.1)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
def test_pointwise_pessimism(level):
    """-S_SAT >= -S_PPO on every active token, strictly on the band tokens; ungated tokens keep
    PPO's value bit for bit; every token's value is the spec's min(r A, clip(r, 1 - eps_low~,
    1 + eps_high~) A) (with verl's dual clip at token level)."""
    flags = []

    @PROPERTY
    @given(case=sat_cases(level))
    def check(case: SATCase) -> None:
        cfg_sat, cfg_base = configs(case)
        sat = run_loss(case.loss_name, case.batch(), cfg_sat)
        base = run_loss(case.base_name, case.batch(), cfg_base)
        spec = spec_rule(case)
        mask, clear = case.mask, torch.from_numpy(~spec.ambiguous)
        band, gate = torch.from_numpy(spec.band), torch.from_numpy(spec.gate)
        assert torch.all(sat.token_loss[mask] >= base.token_loss[mask])
        assert torch.all(sat.token_loss[band & clear] > base.token_loss[band & clear])
        assert torch.equal(sat.token_loss[mask & ~gate], base.token_loss[mask & ~gate])
        expected = torch.from_numpy(spec_token_loss(case, spec))
        keep = mask & clear
        tol = spec_tol(case)
        torch.testing.assert_close(sat.token_loss.double()[keep], expected[keep], rtol=tol, atol=tol)
        flags.append(spec.bites)

    check()
    assert_biting_share(flags, f"pointwise pessimism [{level}]")


@pytest.mark.parametrize("level", LEVELS)
def test_exact_locus_of_change(level):
    """d loss / d log pi differs from PPO's (verl's vanilla / gspo) exactly on the spec's bands
    {A > 0, 1 + eps_high~ < r < 1 + eps_high} and {A < 0, 1 - eps_low < r < 1 - eps_low~}, where
    SAT's is 0 and PPO's is not; it is PPO's, bit for bit, on every other token, in every
    loss_agg_mode. The gate, q, the gate rate (<= 1 - alpha) and the intercepted fraction are the
    spec's too."""
    flags = []

    @PROPERTY
    @given(case=sat_cases(level), agg=st.sampled_from(AGG_MODES))
    def check(case: SATCase, agg: str) -> None:
        cfg_sat, cfg_base = configs(case)
        sat = run_loss(case.loss_name, case.batch(), cfg_sat, agg, weights=False)
        base = run_loss(case.base_name, case.batch(), cfg_base, agg, weights=False)
        spec = spec_rule(case)
        mask = case.mask.numpy()
        clear = mask & ~spec.ambiguous  # r within a few ulps of an endpoint: rounding decides
        changed = (sat.grad != base.grad).numpy()
        assert np.array_equal(changed[clear], spec.band[clear])
        band = torch.from_numpy(spec.band & clear)
        assert torch.all(sat.grad[band] == 0) and torch.all(base.grad[band] != 0)
        assert torch.all(sat.grad[~case.mask] == 0)
        # the rule as the loss applied it
        n = int(mask.sum())
        assert np.array_equal(sat.gate.numpy(), spec.gate)
        assert sat.metrics["actor/sat_q"] == spec.q
        assert int(spec.gate.sum()) <= gate_capacity(n, case.alpha) <= (1 - case.alpha) * n + 1e-9
        assert sat.metrics["actor/sat_gate_rate"] == pytest.approx(spec.gate.sum() / n, abs=1e-12)
        if not spec.ambiguous.any():
            assert sat.metrics["actor/sat_intercepted_frac"] == pytest.approx(spec.band.sum() / n, abs=1e-12)
        flags.append(spec.bites)

    check()
    assert_biting_share(flags, f"exact locus of change [{level}]")


# ---------------------------------------------------------------------------------------------
# hand-computed cases and plumbing
# ---------------------------------------------------------------------------------------------
def test_gate_moves_only_the_endpoint_on_the_side_of_the_sign():
    """Hand-computed: one stale positive token, A > 0, r inside PPO's range but outside SAT's."""
    d = torch.tensor([[0.0, 0.01, -0.01, 0.01, -0.01, 0.01, -0.01, 0.01, -0.01, 0.15]])
    b = {
        "old_log_prob": torch.full_like(d, -1.0),
        "log_prob": -1.0 + d,
        "advantages": torch.ones_like(d),
        "response_mask": torch.ones_like(d),
    }
    out = run_loss("sat", b, actor_config("sat"))
    metrics = out.metrics
    # |d| sorted: 0, 0.01 x 8, 0.15; alpha 0.9 -> rank 9 -> q = 0.01; only the last token is gated
    assert metrics["actor/sat_q"] == pytest.approx(0.01)
    assert metrics["actor/sat_gate_rate"] == pytest.approx(0.1)
    c_plus = 1 / (1 + (0.15 / 0.01) ** 2)  # = 1/226
    assert metrics["actor/sat_c_min"] == pytest.approx(c_plus, rel=1e-5)
    assert metrics["actor/sat_eps_high_mean"] == pytest.approx((9 * 0.2 + 0.2 * c_plus) / 10, rel=1e-6)
    assert metrics["actor/sat_eps_low_mean"] == pytest.approx(0.2, rel=1e-6)
    # r = e^0.15 = 1.1618 < 1.2 (PPO keeps its gradient) but > 1 + 0.2/226 (SAT clips it)
    assert out.token_loss[0, -1].item() == pytest.approx(-(1 + 0.2 * c_plus), rel=1e-6)
    assert out.grad[0, -1].item() == 0.0
    assert metrics["actor/sat_intercepted_frac"] == pytest.approx(0.1)


def test_gspo_score_is_length_weighted_sequence_ratio():
    """SAT-GSPO broadcasts log rho_b to the tokens before the quantile (docs/sat.md#sequence-level)."""
    # three responses: lengths 8, 1, 1; the long one carries 8 of 10 active tokens
    mask = torch.zeros(3, 8)
    mask[0, :] = 1
    mask[1, 0] = 1
    mask[2, 0] = 1
    d = torch.zeros(3, 8)
    d[0, :] = 0.02  # log rho_0 = 0.02 on 8 tokens
    d[1, 0] = 0.5  # log rho_1 = 0.5 on 1 token
    d[2, 0] = -0.01
    b = {"old_log_prob": torch.full_like(d, -1.0), "log_prob": -1.0 + d, "advantages": torch.ones_like(d)}
    b["response_mask"] = mask
    metrics = run_loss("sat_gspo", b, actor_config("sat_gspo")).metrics
    # length-weighted |d|: 0.01 x1, 0.02 x8, 0.5 x1; rank 9 of 10 -> q = 0.02, one token gated
    assert metrics["actor/sat_q"] == pytest.approx(0.02)
    assert metrics["actor/sat_gate_rate"] == pytest.approx(0.1)


@pytest.mark.parametrize("sat_name", ["sat", "sat_gspo"])
@pytest.mark.parametrize("poison", POISON)
def test_empty_active_set_gives_zero_finite_loss(sat_name, poison):
    b = random_batch(0, 3, 5)
    b["response_mask"] = torch.zeros_like(b["response_mask"])
    if poison is not None:
        b["log_prob"][0, 0] = poison  # padding may hold anything
    out = run_loss(sat_name, b, actor_config(sat_name), agg="token-mean", weights=False)
    assert out.loss.item() == 0.0
    assert torch.all(torch.isfinite(out.grad)) and torch.all(out.grad == 0)
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_metrics_are_reported():
    b = random_batch(3, 4, 16, scale=0.3)
    for name in ("sat", "sat_gspo"):
        metrics = run_loss(name, b, actor_config(name)).metrics
        for key in (
            "actor/pg_clipfrac",
            "actor/ppo_kl",
            "actor/sat_q",
            "actor/sat_gate_rate",
            "actor/sat_c_min",
            "actor/sat_eps_low_mean",
            "actor/sat_eps_high_mean",
            "actor/sat_intercepted_frac",
            "actor/mismatch_abs_mean",
        ):
            assert isinstance(metrics[key], float), key
        mask = b["response_mask"].bool()
        dbar = (b["log_prob"] - b["old_log_prob"]).abs()[mask].mean().item()
        assert metrics["actor/mismatch_abs_mean"] == pytest.approx(dbar, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("sat_name", ["sat", "sat_gspo"])
def test_any_dtype(sat_name, dtype):
    b = random_batch(7, 4, 12, scale=0.3, dtype=dtype)
    out = run_loss(sat_name, b, actor_config(sat_name))
    assert out.loss.dtype == dtype and torch.isfinite(out.loss) and torch.all(torch.isfinite(out.grad))
    assert 0.0 <= out.metrics["actor/sat_gate_rate"] <= 0.1 + 1e-6


def test_global_batch_info_is_honoured():
    """Aggregation goes through verl's agg_loss with the global token count (data parallel)."""
    b = random_batch(1, 4, 8)
    n = int(b["response_mask"].sum())
    local = run_loss("sat", b, actor_config("sat"), agg="token-mean", weights=False).loss
    info = {"dp_size": 2, "batch_num_tokens": 2 * n}
    config = actor_config("sat", global_batch_info=info, sat_quantile_scope="micro_batch")
    dp = run_loss("sat", b, config, agg="token-mean", weights=False).loss
    assert dp.item() == pytest.approx(local.item(), rel=1e-6)


@pytest.mark.parametrize("sat_name", ["sat", "sat_gspo"])
def test_step_scope_refuses_a_micro_batch_without_the_steps_q(sat_name):
    """Through verl's plain ppo_loss (global_batch_info set) a micro-batch that is not the whole
    step cannot take the step's q by itself: a clear error naming the key, not a silent
    per-micro-batch quantile. One micro-batch that is the whole step is fine."""
    b = random_batch(2, 4, 8)
    n = int(b["response_mask"].sum())
    for info in ({"dp_size": 2, "batch_num_tokens": 2 * n}, {"dp_size": 1, "batch_num_tokens": 3 * n}):
        with pytest.raises(ValueError, match=r"policy_loss.sat_quantile_scope=step: this micro-batch holds"):
            run_loss(sat_name, b, actor_config(sat_name, global_batch_info=info))
    whole = run_loss(sat_name, b, actor_config(sat_name, global_batch_info={"dp_size": 1, "batch_num_tokens": n}))
    direct = run_loss(sat_name, b, actor_config(sat_name))
    assert torch.equal(whole.loss, direct.loss)


def test_registration_refuses_a_different_function():
    from verl_sat.sat import losses

    original = POLICY_LOSS_REGISTRY["sat"]
    try:
        POLICY_LOSS_REGISTRY["sat"] = POLICY_LOSS_REGISTRY["vanilla"]
        with pytest.raises(ValueError, match="'sat' is already registered"):
            losses.register_sat_losses()
    finally:
        POLICY_LOSS_REGISTRY["sat"] = original
    losses.register_sat_losses()  # re-registering the same functions is fine
    assert POLICY_LOSS_REGISTRY["sat"] is losses.compute_policy_loss_sat
