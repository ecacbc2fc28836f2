"""Study statistics (studies/lib/stats.py): final mean, the replayed sentinel, and the paired tests
that scipy.stats computes, held against published tables, exact small-n counts and invariants."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from studies.lib.stats import (
    final_mean,
    holm,
    mcnemar_exact,
    paired_comparison,
    paired_t_interval,
    permutation_p,
    replay_sentinel,
    wilcoxon_p,
)
from verl_sat.trainer.sentinel import SentinelConfig

# distinct magnitudes, none zero: no ties, so the rank statistics' extremes are sharp
distinct = st.lists(st.integers(1, 1000).map(lambda k: k / 100), min_size=2, max_size=10, unique=True).flatmap(
    lambda xs: st.tuples(st.just(xs), st.lists(st.booleans(), min_size=len(xs), max_size=len(xs)))
)
diffs = st.lists(st.floats(-1, 1, allow_nan=False).map(lambda x: round(x, 3)), min_size=2, max_size=10)


def signed(pair: tuple[list[float], list[bool]]) -> list[float]:
    magnitudes, negative = pair
    return [-m if neg else m for m, neg in zip(magnitudes, negative, strict=True)]


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


# -- the paired t-interval: mean +- t_{(1+level)/2, n-1} * sd / sqrt(n)
@pytest.mark.parametrize(
    ("n", "level", "quantile"),
    # Student's t table (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2), to its three printed decimals
    [(2, 0.95, 12.706), (3, 0.95, 4.303), (5, 0.95, 2.776), (10, 0.95, 2.262), (16, 0.95, 2.131), (5, 0.90, 2.132)]
    + [(5, 0.99, 4.604), (31, 0.95, 2.042)],
)
def test_the_t_interval_half_width_is_the_tabled_quantile_times_the_standard_error(n, level, quantile):
    diffs = [float(k) for k in range(n)]  # sd = sqrt(n (n + 1) / 12)
    mean, lo, hi = paired_t_interval(diffs, level)
    se = math.sqrt(n * (n + 1) / 12) / math.sqrt(n)
    assert mean == pytest.approx((n - 1) / 2) and hi - mean == pytest.approx(mean - lo)
    assert (hi - lo) / 2 / se == pytest.approx(quantile, abs=5e-4)


def test_the_t_interval_of_a_textbook_sample():
    # 1..5: mean 3, sd sqrt(2.5), t_{0.975, 4} = 2.7764: 3 -+ 2.7764 * sqrt(2.5) / sqrt(5) = [1.0368, 4.9632]
    mean, lo, hi = paired_t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (mean, lo, hi) == pytest.approx((3.0, 1.0368, 4.9632), abs=1e-4)
    assert paired_t_interval([0.25, 0.25, 0.25]) == (0.25, 0.25, 0.25)  # sd 0: the point, no warning
    with pytest.raises(ValueError, match="at least 2"):
        paired_t_interval([1.0])


@settings(max_examples=60, deadline=None)
@given(diffs, st.floats(-5, 5), st.floats(0.1, 10))
def test_the_t_interval_moves_and_scales_with_the_data(xs, shift, scale):
    assume(max(xs) - min(xs) > 1e-3)
    mean, lo, hi = paired_t_interval(xs)
    moved = paired_t_interval([scale * x + shift for x in xs])
    assert moved == pytest.approx((scale * mean + shift, scale * lo + shift, scale * hi + shift), abs=1e-6)
    _, lo90, hi90 = paired_t_interval(xs, 0.90)
    assert lo < lo90 < mean < hi90 < hi  # a lower level, a narrower interval around the mean


# -- the exact Wilcoxon signed-rank test: zeros dropped, mid-ranks, all 2^n sign flips
def test_wilcoxon_exact_p_of_small_samples():
    # all n = 5 positive: W+ = 15, only all-plus and all-minus are as extreme: 2 / 2^5
    assert wilcoxon_p([0.01, 0.02, 0.03, 0.04, 0.05]) == pytest.approx(2 / 32)
    # n = 8, W- = 3 (ranks 1 and 2 negative): #{subsets of 1..8 summing <= 3} = 5, two-sided 10 / 256
    assert wilcoxon_p([-1.0, -2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) == pytest.approx(10 / 256)
    # ties: |d| = 1, 1, 2, 2 get mid-ranks 1.5, 1.5, 3.5, 3.5; signed sum 3; P(|S| >= 3) = 1/4 + 1/2
    assert wilcoxon_p([1.0, 1.0, 2.0, -2.0]) == pytest.approx(3 / 4)
    # zeros are dropped (Wilcoxon's rule): three positive values left, 2 / 2^3
    assert wilcoxon_p([0.0, 0.0, 1.0, 2.0, 3.0]) == pytest.approx(2 / 8)
    # -1, -1, -1, 2 rank -2, -2, -2, +4 (S = -2) and every flip reaches |S| >= 2; Pratt's rule, which
    # ranks the zero too (-3, -3, -3, +5), would find 6 of 16 flips below |S| = 4
    assert wilcoxon_p([0.0, -1.0, -1.0, -1.0, 2.0]) == 1.0
    assert wilcoxon_p([0.0, 0.0]) == 1.0  # nothing left to rank
    with pytest.raises(ValueError, match="1..20"):
        wilcoxon_p([float(k) for k in range(1, 22)])


@settings(max_examples=40, deadline=None)
@given(distinct)
def test_wilcoxon_p_depends_only_on_the_signs_and_the_order_of_the_magnitudes(pair):
    xs = signed(pair)
    p = wilcoxon_p(xs)
    assert 2 / 2 ** len(xs) - 1e-12 <= p <= 1.0
    assert wilcoxon_p([-x for x in xs]) == pytest.approx(p)  # two-sided: symmetric in the sign
    assert wilcoxon_p([math.copysign(abs(x) ** 3, x) for x in xs]) == pytest.approx(p)  # ranks only
    assert wilcoxon_p([abs(x) for x in xs]) == pytest.approx(2 / 2 ** len(xs))  # all one sign: the extreme


# -- the exact sign-flip permutation test on the mean difference
def test_permutation_exact_p_of_small_samples():
    assert permutation_p([0.01, 0.02, 0.03, 0.04, 0.05]) == pytest.approx(2 / 32)
    # 3, 1, 1, 1: only all-plus and all-minus reach |sum| >= 6: 2 / 16
    assert permutation_p([3.0, 1.0, 1.0, 1.0]) == pytest.approx(2 / 16)
    # 3, -1, 1, 1: |sum| >= 4 when the 3 keeps its sign and at most one 1 is flipped against it: 8 / 16
    assert permutation_p([3.0, -1.0, 1.0, 1.0]) == pytest.approx(8 / 16)
    assert permutation_p([1.0, -1.0]) == 1.0


@settings(max_examples=40, deadline=None)
@given(distinct, st.floats(0.1, 10))
def test_permutation_p_is_symmetric_scale_free_and_extreme_for_one_sign(pair, scale):
    xs = signed(pair)
    p = permutation_p(xs)
    assert 2 / 2 ** len(xs) - 1e-12 <= p <= 1.0
    assert permutation_p([-scale * x for x in xs]) == pytest.approx(p)
    assert permutation_p([abs(x) for x in xs]) == pytest.approx(2 / 2 ** len(xs))


def test_paired_comparison_pairs_by_seed():
    a = {1: 0.6, 2: 0.7, 3: 0.8, 4: 0.9, 9: 0.0}  # seed 9: a alone, left out
    b = {1: 0.5, 2: 0.55, 3: 0.6, 4: 0.65}
    r = paired_comparison(a, b)
    assert r["seeds"] == 4 and r["diffs"] == pytest.approx([0.1, 0.15, 0.2, 0.25])
    assert r["diff"] == pytest.approx(0.175) and r["a_mean"] == pytest.approx(0.75)
    assert r["ci"][0] > 0 and r["wilcoxon_p"] == pytest.approx(2 / 16) == r["permutation_p"]
    assert paired_comparison({1: 0.5}, {1: 0.4}) is None


# -- Holm's step-down adjustment, and the exact McNemar test (two-sided binomial at 1/2)
def test_holm_against_its_textbook_example():
    # Holm (1979) step-down on m = 4: sorted p 0.01, 0.02, 0.03, 0.04 -> 0.04, 0.06, 0.06, 0.06
    assert holm([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and holm([]) == []


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8))
@settings(max_examples=500, deadline=None)
def test_holm_is_monotone_bounded_and_above_the_raw_p(ps):
    adj = holm(ps)
    assert all(p <= q <= 1.0 for p, q in zip(ps, adj, strict=True))
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    assert all(adj[order[i]] <= adj[order[i + 1]] for i in range(len(ps) - 1))  # the order is kept


def test_exact_mcnemar_on_discordant_pairs():
    # 6 seeds where only b collapses, none where only a does: p = 2 / 2^6
    a = dict.fromkeys(range(16), False)
    b = {k: k < 6 for k in range(16)}
    r = mcnemar_exact(a, b)
    assert (r["a_only"], r["b_only"], r["p"]) == (0, 6, pytest.approx(2 / 64)) and r["b_rate"] == 6 / 16
    # 1 against 7 discordant pairs: 2 (C(8,0) + C(8,1)) / 2^8 = 18 / 256
    one = {k: k == 0 for k in range(8)}
    seven = {k: k > 0 for k in range(8)}
    assert mcnemar_exact(one, seven)["p"] == pytest.approx(18 / 256) == mcnemar_exact(seven, one)["p"]
    assert mcnemar_exact(a, a)["p"] == 1.0  # no discordant pair
    assert mcnemar_exact({1: True, 2: False}, {1: False, 2: True})["p"] == 1.0
    assert mcnemar_exact({1: True}, {2: True}) is None  # no shared seed
