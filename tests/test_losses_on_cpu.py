"""The registered losses ``sat`` and ``sat_gspo`` against verl's ``vanilla`` and ``gspo``.

Per-token surrogate values are read through verl's own aggregation: with
``loss_agg_mode="token-sum"`` and all-ones ``rollout_is_weights`` that require grad,
d loss / d w_{b,t} is the token's loss -S_{b,t} (masked), for SAT and for the base loss alike.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import actor_config, random_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn

PAIRS = [("sat", "vanilla"), ("sat_gspo", "gspo")]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
MANY = settings(max_examples=300, deadline=None)

cases = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31 - 1),
        "batch": st.integers(1, 6),
        "length": st.integers(1, 12),
        "scale": st.sampled_from([0.01, 0.1, 0.3, 1.0]),
        "ties": st.booleans(),
    }
)
radii = st.tuples(st.sampled_from([0.2, 0.1, 3e-4, 0.05]), st.sampled_from([0.2, 0.28, 4e-4, 0.05]))


def run_loss(name: str, b: dict, cfg, agg: str = "token-sum", weights: bool = True):
    """(loss, metrics, d loss/d log_prob, per-token loss -S) for one registered loss."""
    log_prob = b["log_prob"].clone().requires_grad_(True)
    w = torch.ones_like(log_prob, requires_grad=True) if weights else None
    loss, metrics = get_policy_loss_fn(name)(
        b["old_log_prob"], log_prob, b["advantages"], b["response_mask"], agg, cfg, w
    )
    loss.backward()
    return loss.detach(), metrics, log_prob.grad, (w.grad if weights else None)


def ratio_of(name: str, b: dict) -> torch.Tensor:
    """The ratio each loss clips: r_{b,t} (token) or rho_b broadcast (sequence)."""
    d = b["log_prob"] - b["old_log_prob"]
    if name == "sat":
        return torch.exp(d.clamp(-20, 20))
    m = b["response_mask"]
    seq = (d * m).sum(-1) / m.sum(-1).clamp(min=1)
    return torch.exp(seq.clamp(max=10)).unsqueeze(-1).expand_as(d)


@pytest.mark.parametrize("sat_name,base_name", PAIRS)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("seed", range(4))
def test_disabled_is_bit_identical_to_base(sat_name, base_name, agg, seed):
    b = random_batch(seed, 5, 9)
    base = run_loss(base_name, b, actor_config(base_name), agg)
    off = run_loss(sat_name, b, actor_config(sat_name, sat_enabled=False), agg)
    assert torch.equal(off[0], base[0]) and torch.equal(off[2], base[2]) and torch.equal(off[3], base[3])
    for key, value in base[1].items():
        assert off[1][key] == value
    assert "actor/mismatch_abs_mean" in off[1]


@MANY
@given(case=cases, pair=st.sampled_from(PAIRS), agg=st.sampled_from(AGG_MODES))
def test_identity_when_no_token_is_gated(case, pair, agg):
    """SAT on, but every |d| is equal (q = |d|, nothing strictly above) or q = 0: base loss, bitwise."""
    sat_name, base_name = pair
    b = random_batch(case["seed"], case["batch"], case["length"])
    b["old_log_prob"] = -torch.round(-b["old_log_prob"] * 8) / 8  # dyadic: d below is exact
    if case["ties"]:
        b["log_prob"] = b["old_log_prob"] + 0.0625  # all |d| equal: nothing exceeds q
    else:
        b["log_prob"] = b["old_log_prob"].clone()  # d = 0 everywhere: q = 0
    base = run_loss(base_name, b, actor_config(base_name), agg)
    sat = run_loss(sat_name, b, actor_config(sat_name), agg)
    if b["response_mask"].sum() == 0:
        return  # the empty batch has its own test
    assert sat[1]["actor/sat_gate_rate"] == 0.0
    assert torch.equal(sat[0], base[0]) and torch.equal(sat[2], base[2])


@MANY
@given(case=cases, pair=st.sampled_from(PAIRS), eps=radii, alpha=st.sampled_from([0.5, 0.75, 0.9, 0.99]))
def test_pessimism_and_exact_locus_of_change(case, pair, eps, alpha):
    """S_SAT <= S_PPO per token; d/dr differs only on the newly clipped bands, where it is 0."""
    sat_name, base_name = pair
    b = random_batch(case["seed"], case["batch"], case["length"], case["scale"], ties=case["ties"])
    mask = b["response_mask"].bool()
    if not mask.any():
        return  # the empty batch has its own test
    cfg_sat = actor_config(sat_name, eps_low=eps[0], eps_high=eps[1], sat_alpha=alpha)
    cfg_base = actor_config(base_name, eps_low=eps[0], eps_high=eps[1])
    _, metrics, grad_sat, tok_sat = run_loss(sat_name, b, cfg_sat)
    _, _, grad_base, tok_base = run_loss(base_name, b, cfg_base)

    # pointwise pessimism: -S_SAT >= -S_PPO on every token
    assert torch.all(tok_sat[mask] >= tok_base[mask])

    # the newly clipped bands, from the loss's own effective radii
    r, adv = ratio_of(sat_name, b), b["advantages"]
    upper = 1 + eps[1]
    lower = 1 - eps[0]
    tok_gap = tok_sat - tok_base  # > 0 exactly where SAT clips and PPO does not (or clips less)
    changed = grad_sat != grad_base
    boundary = (r == torch.tensor(upper, dtype=r.dtype)) | (r == torch.tensor(lower, dtype=r.dtype))
    band = mask & (((adv > 0) & (r < upper)) | ((adv < 0) & (r > lower))) & (tok_gap > 0)
    # off the bands the gradient is the base gradient, bit for bit
    assert not torch.any(changed & mask & ~band & ~boundary)
    # on the bands SAT's gradient w.r.t. r is zero (clipped), PPO's is not
    assert torch.all(grad_sat[band] == 0)
    assert torch.all(grad_base[band & (adv != 0)] != 0)
    # the reported intercepted fraction counts exactly these tokens
    n = mask.sum().item()
    if n:
        assert metrics["actor/sat_intercepted_frac"] == pytest.approx(band.sum().item() / n, abs=1e-6)


@pytest.mark.parametrize("sat_name", ["sat", "sat_gspo"])
def test_empty_active_set_gives_zero_finite_loss(sat_name):
    b = random_batch(0, 3, 5)
    b["response_mask"] = torch.zeros_like(b["response_mask"])
    b["log_prob"][0, 0] = float("nan")  # padding may hold anything
    loss, metrics, grad, _ = run_loss(sat_name, b, actor_config(sat_name), agg="token-mean", weights=False)
    assert loss.item() == 0.0
    assert torch.all(torch.isfinite(grad)) and torch.all(grad == 0)
    assert all(math.isfinite(v) for v in metrics.values())


def test_gate_moves_only_the_endpoint_on_the_side_of_the_sign():
    """Hand-computed: one stale positive token, A > 0, r inside PPO's range but outside SAT's."""
    d = torch.tensor([[0.0, 0.01, -0.01, 0.01, -0.01, 0.01, -0.01, 0.01, -0.01, 0.15]])
    b = {
        "old_log_prob": torch.full_like(d, -1.0),
        "log_prob": -1.0 + d,
        "advantages": torch.ones_like(d),
        "response_mask": torch.ones_like(d),
    }
    loss, metrics, grad, tok = run_loss("sat", b, actor_config("sat"))
    # |d| sorted: 0, 0.01 x 8, 0.15; alpha 0.9 -> rank 9 -> q = 0.01; only the last token is gated
    assert metrics["actor/sat_q"] == pytest.approx(0.01)
    assert metrics["actor/sat_gate_rate"] == pytest.approx(0.1)
    c_plus = 1 / (1 + (0.15 / 0.01) ** 2)  # = 1/226
    assert metrics["actor/sat_c_min"] == pytest.approx(c_plus, rel=1e-5)
    assert metrics["actor/sat_eps_high_mean"] == pytest.approx((9 * 0.2 + 0.2 * c_plus) / 10, rel=1e-6)
    assert metrics["actor/sat_eps_low_mean"] == pytest.approx(0.2, rel=1e-6)
    # r = e^0.15 = 1.1618 < 1.2 (PPO keeps its gradient) but > 1 + 0.2/226 (SAT clips it)
    assert tok[0, -1].item() == pytest.approx(-(1 + 0.2 * c_plus), rel=1e-6)
    assert grad[0, -1].item() == 0.0
    assert metrics["actor/sat_intercepted_frac"] == pytest.approx(0.1)


def test_gspo_score_is_length_weighted_sequence_ratio():
    """SAT-GSPO broadcasts log rho_b to the tokens before the quantile (SPEC §3)."""
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
    _, metrics, _, _ = run_loss("sat_gspo", b, actor_config("sat_gspo"))
    # length-weighted |d|: 0.01 x1, 0.02 x8, 0.5 x1; rank 9 of 10 -> q = 0.02, one token gated
    assert metrics["actor/sat_q"] == pytest.approx(0.02)
    assert metrics["actor/sat_gate_rate"] == pytest.approx(0.1)


def test_metrics_are_reported():
    b = random_batch(3, 4, 16, scale=0.3)
    for name in ("sat", "sat_gspo"):
        _, metrics, _, _ = run_loss(name, b, actor_config(name))
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
    loss, metrics, grad, _ = run_loss(sat_name, b, actor_config(sat_name))
    assert loss.dtype == dtype and torch.isfinite(loss) and torch.all(torch.isfinite(grad))
    assert 0.0 <= metrics["actor/sat_gate_rate"] <= 0.1 + 1e-6


def test_global_batch_info_is_honoured():
    """Aggregation goes through verl's agg_loss with the global token count (data parallel)."""
    b = random_batch(1, 4, 8)
    n = int(b["response_mask"].sum())
    local = run_loss("sat", b, actor_config("sat"), agg="token-mean", weights=False)[0]
    info = {"dp_size": 2, "batch_num_tokens": 2 * n}
    config = actor_config("sat", global_batch_info=info, sat_quantile_scope="micro_batch")
    dp = run_loss("sat", b, config, agg="token-mean", weights=False)[0]
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
    assert torch.equal(whole[0], direct[0])


def test_registration_refuses_a_different_function():
    from verl_sat import losses

    original = POLICY_LOSS_REGISTRY["sat"]
    try:
        POLICY_LOSS_REGISTRY["sat"] = POLICY_LOSS_REGISTRY["vanilla"]
        with pytest.raises(ValueError, match="'sat' is already registered"):
            losses.register_sat_losses()
    finally:
        POLICY_LOSS_REGISTRY["sat"] = original
    losses.register_sat_losses()  # re-registering the same functions is fine
    assert POLICY_LOSS_REGISTRY["sat"] is losses.compute_policy_loss_sat


@pytest.mark.parametrize("sat_name", ["sat", "sat_gspo"])
def test_property_generator_reaches_the_intercepted_bands(sat_name):
    """Guard against a vacuous locus test: the generated batches do hit the SAT-only bands."""
    hits = 0.0
    for seed in range(30):
        b = random_batch(seed, 6, 12, scale=0.3)
        hits += run_loss(sat_name, b, actor_config(sat_name, sat_alpha=0.5))[1]["actor/sat_intercepted_frac"]
    assert hits > 0
