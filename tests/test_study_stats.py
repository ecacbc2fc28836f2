"""Study statistics: final mean, bootstrap intervals (property tests), the replayed sentinel."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_sat.study.stats import bootstrap_ci, final_mean, replay_sentinel
from verl_sat.trainer.sentinel import SentinelConfig

values = st.lists(st.floats(min_value=-10, max_value=10, allow_nan=False), min_size=1, max_size=12)


@settings(max_examples=50, deadline=None)
@given(values)
def test_bootstrap_interval_lies_within_the_sample_and_is_ordered(xs):
    lo, hi = bootstrap_ci(xs, resamples=200)
    assert min(xs) - 1e-9 <= lo <= hi <= max(xs) + 1e-9


@settings(max_examples=25, deadline=None)
@given(st.floats(min_value=-5, max_value=5, allow_nan=False), st.integers(min_value=1, max_value=8))
def test_bootstrap_of_identical_seeds_has_zero_width(x, n):
    lo, hi = bootstrap_ci([x] * n, resamples=100)
    assert lo == pytest.approx(x) and hi == pytest.approx(x)


def test_bootstrap_narrows_with_more_seeds_and_rejects_a_bad_level():
    few, many = [0.0, 1.0] * 2, [0.0, 1.0] * 20
    (a, b), (c, d) = bootstrap_ci(few), bootstrap_ci(many)
    assert d - c < b - a
    assert bootstrap_ci([]) is None
    with pytest.raises(ValueError, match="level"):
        bootstrap_ci([1.0], level=1.5)


def test_final_mean_is_the_last_quarter():
    assert final_mean([0.0] * 6 + [1.0, 1.0]) == 1.0
    assert final_mean([2.0]) == 2.0 and final_mean([]) is None


def test_replayed_sentinel_alarms_on_a_reward_drop_with_a_mismatch_spike_only():
    config = SentinelConfig(enabled=True, window=20, warmup=6, patience=3, mismatch_keys=["actor/mismatch_abs_mean"])
    steady = [
        {"step": s, "critic/score/mean": 0.6 + 0.01 * (s % 3), "actor/mismatch_abs_mean": 0.05} for s in range(1, 21)
    ]
    collapse = [{"step": s, "critic/score/mean": 0.1, "actor/mismatch_abs_mean": 1.0} for s in range(21, 27)]
    alarms, scored = replay_sentinel(steady + collapse, config)
    assert alarms and alarms[0] >= 21 and scored > 0
    quiet, _ = replay_sentinel(list(reversed(steady)), config)  # step order, not list order
    assert quiet == []


def test_holm_against_its_textbook_example():
    # Holm (1979) step-down on m = 4: sorted p 0.01, 0.02, 0.03, 0.04 -> 0.04, 0.06, 0.06, 0.06
    from verl_sat.study.stats import holm

    assert holm([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and holm([]) == []


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8))
@settings(max_examples=500, deadline=None)
def test_holm_is_monotone_bounded_and_above_the_raw_p(ps):
    from verl_sat.study.stats import holm

    adj = holm(ps)
    assert all(p <= q <= 1.0 for p, q in zip(ps, adj, strict=True))
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    assert all(adj[order[i]] <= adj[order[i + 1]] for i in range(len(ps) - 1))  # the order is kept


def test_exact_mcnemar_on_discordant_pairs():
    from verl_sat.study.stats import mcnemar_exact

    # 6 seeds where only b collapses, none where only a does: p = 2 / 2^6
    a = dict.fromkeys(range(16), False)
    b = {k: k < 6 for k in range(16)}
    r = mcnemar_exact(a, b)
    assert (r["a_only"], r["b_only"], r["p"]) == (0, 6, pytest.approx(2 / 64)) and r["b_rate"] == 6 / 16
    assert mcnemar_exact(a, a)["p"] == 1.0  # no discordant pair
    assert mcnemar_exact({1: True, 2: False}, {1: False, 2: True})["p"] == 1.0
