"""Statistics of multi-seed studies: final and best reward, bootstrap intervals, replayed sentinel.

    final reward  = mean of the last ceil(frac * n) logged rewards of a run (frac 0.25)
    best reward   = max over the run's logged rewards
    95% interval  = percentile bootstrap of the mean over seeds (resampling seeds with replacement)
    collapsed     = the collapse sentinel (docs/sentinel.md), replayed step by step on the run's
                    logged metrics, alarms at least once: a rule fixed before any run

The sentinel is pure Python over per-step metric dicts, so replaying it on ``metrics.jsonl`` is
what it would have done online.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_sat.trainer.sentinel import CollapseSentinel, SentinelConfig

FINAL_FRAC = 0.25
Rows = Sequence[Mapping[str, Any]]
"""per-step metric dicts, each with an integer ``step``"""


def final_mean(values: Sequence[float], frac: float = FINAL_FRAC) -> float | None:
    """Mean of the last ``ceil(frac * n)`` values (at least one); None for no values."""
    if not values:
        return None
    k = max(1, math.ceil(frac * len(values)))
    tail = values[-k:]
    return sum(tail) / len(tail)


def bootstrap_ci(
    values: Sequence[float], level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of ``values`` (None for no values).

    One value gives a zero-width interval: the seeds, not the steps, are the unit resampled.
    """
    if not values:
        return None
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap level must be in (0, 1), got {level}")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(resamples))
    lo = means[int(math.floor((1.0 - level) / 2.0 * (resamples - 1)))]
    hi = means[int(math.ceil((1.0 + level) / 2.0 * (resamples - 1)))]
    return lo, hi


def cpu_sentinel_config() -> SentinelConfig:
    """The CPU default's ``sat.sentinel`` (``hydra_configs/sat_gspo_cpu.yaml``), as the main job runs it."""
    from omegaconf import OmegaConf

    from verl_sat.files import hydra_config_dir

    return SentinelConfig.from_node(OmegaConf.load(Path(hydra_config_dir()) / "sat_gspo_cpu.yaml").sat.sentinel)


def replay_sentinel(rows: Rows, config: SentinelConfig) -> tuple[list[int], int]:
    """(alarm steps, scored steps) of the collapse sentinel replayed over ``rows`` in step order.

    A step is scored once the sentinel's reward band exists (after its warm-up).
    """
    sentinel = CollapseSentinel(config)
    alarms: list[int] = []
    scored = 0
    for row in sorted(rows, key=lambda r: int(r["step"])):
        step = int(row["step"])
        scored += math.isfinite(sentinel.reward_band())
        metrics = {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, int | float)}
        if sentinel.update(step, metrics) is not None:
            alarms.append(step)
    return alarms, scored


# -- the confirmatory study's paired tests (studies/confirmatory/study_protocol.md): exact, no SciPy
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom: 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (bisection on the CDF; 1e-12 absolute)."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"need 0 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = -1e3, 1e3
    while hi - lo > 1e-12:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def paired_t_interval(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi): mean of the per-seed differences +- t_{(1+level)/2, n-1} * sd / sqrt(n)."""
    n = len(diffs)
    if n < 2:
        raise ValueError(f"a paired t-interval needs at least 2 differences, got {n}")
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = student_t_quantile((1.0 + level) / 2.0, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _sign_flip_p(values: Sequence[float], statistic) -> float:
    """Exact two-sided p of ``statistic`` under the 2^n sign flips of ``values`` (n <= 20)."""
    n = len(values)
    if not 1 <= n <= 20:
        raise ValueError(f"exact sign-flip tests take 1..20 values, got {n}")
    observed = abs(statistic(values)) - 1e-12
    extreme = 0
    for bits in range(1 << n):
        flipped = [-v if bits >> i & 1 else v for i, v in enumerate(values)]
        extreme += abs(statistic(flipped)) >= observed
    return extreme / (1 << n)


def wilcoxon_signed_rank(diffs: Sequence[float]) -> tuple[float, float]:
    """(W+, exact two-sided p) of the Wilcoxon signed-rank test; zero differences dropped, ties
    given mid-ranks, p from the exact distribution over sign flips of the ranks."""
    nonzero = [d for d in diffs if d != 0.0]
    if not nonzero:
        return 0.0, 1.0
    order = sorted(range(len(nonzero)), key=lambda i: abs(nonzero[i]))
    ranks = [0.0] * len(nonzero)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and abs(nonzero[order[j + 1]]) == abs(nonzero[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    signed = [r if d > 0 else -r for r, d in zip(ranks, nonzero, strict=True)]
    w_plus = sum(r for r in signed if r > 0)
    return w_plus, _sign_flip_p(signed, sum)


def permutation_p(diffs: Sequence[float]) -> float:
    """Exact two-sided p of the paired permutation (sign-flip) test on the mean difference."""
    return _sign_flip_p(list(diffs), lambda v: sum(v) / len(v))


def paired_comparison(a: Mapping[Any, float], b: Mapping[Any, float]) -> dict[str, Any] | None:
    """Per-seed differences a - b over the seeds both hold (seed k of both shares data and
    sampling): mean, paired t 95% interval, exact Wilcoxon and (up to 20 seeds) permutation p;
    None with fewer than 2 shared seeds."""
    seeds = sorted(k for k in a if k in b)
    if len(seeds) < 2:
        return None
    diffs = [a[k] - b[k] for k in seeds]
    mean, lo, hi = paired_t_interval(diffs)
    return {
        "seeds": len(seeds),
        "a_mean": sum(a[k] for k in seeds) / len(seeds),
        "b_mean": sum(b[k] for k in seeds) / len(seeds),
        "diff": mean,
        "ci": (lo, hi),
        "wilcoxon_p": wilcoxon_signed_rank(diffs)[1],
        "permutation_p": permutation_p(diffs) if len(diffs) <= 20 else None,
        "diffs": diffs,
    }


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of m p-values, in their given order:
    p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)) over the ascending order p_(1) <= ... <= p_(m)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def mcnemar_exact(a: Mapping[Any, bool], b: Mapping[Any, bool]) -> dict[str, Any] | None:
    """Exact McNemar test of paired binary outcomes (a collapse) over the seeds both hold: with
    b10 = #(a and not b), b01 = #(b and not a), n = b10 + b01,
    p = min(1, 2 sum_{i <= min(b10, b01)} C(n, i) / 2^n) (1 when n = 0)."""
    seeds = sorted(k for k in a if k in b)
    if not seeds:
        return None
    b10 = sum(bool(a[k]) and not bool(b[k]) for k in seeds)
    b01 = sum(bool(b[k]) and not bool(a[k]) for k in seeds)
    n = b10 + b01
    p = 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(min(b10, b01) + 1)) / 2**n)
    return {
        "seeds": len(seeds),
        "a_rate": sum(bool(a[k]) for k in seeds) / len(seeds),
        "b_rate": sum(bool(b[k]) for k in seeds) / len(seeds),
        "a_only": b10,
        "b_only": b01,
        "p": p,
    }
