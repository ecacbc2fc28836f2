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
