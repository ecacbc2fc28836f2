"""Statistics of multi-seed studies: final reward, replayed sentinel, the paired tests (SciPy).

    final reward  = mean of the last ceil(frac * n) logged rewards of a run (frac 0.25)
    collapsed     = the collapse sentinel (docs/sentinel.md), replayed step by step on the run's
                    logged metrics, alarms at least once: a rule fixed before any run
    paired tests  = per-seed differences: t interval, exact Wilcoxon, exact sign-flip permutation;
                    collapses: exact McNemar; a family of p-values: Holm's step-down adjustment

The sentinel is pure Python over per-step metric dicts, so replaying it on ``metrics.jsonl`` is
what it would have done online.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from verl_sat.config_node import config_from_node
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


def cpu_sentinel_config() -> SentinelConfig:
    """The CPU default's ``sat.sentinel`` (``hydra_configs/sat_gspo_cpu.yaml``), as the main job runs it."""
    from omegaconf import OmegaConf

    from verl_sat.files import hydra_config_dir

    return config_from_node(
        SentinelConfig, OmegaConf.load(Path(hydra_config_dir()) / "sat_gspo_cpu.yaml").sat.sentinel, "sat.sentinel"
    )


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


# -- the confirmatory study's paired tests (studies/confirmatory/study_protocol.md), from scipy.stats
EXACT_MAX_N = 20
"""the most differences an exact sign-flip test enumerates (2^20 sign patterns)"""


def paired_t_interval(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi): mean of the per-seed differences +- t_{(1+level)/2, n-1} * sd / sqrt(n)
    (scipy.stats.ttest_1samp's confidence interval; zero width when every difference is equal)."""
    n = len(diffs)
    if n < 2:
        raise ValueError(f"a paired t-interval needs at least 2 differences, got {n}")
    mean = sum(diffs) / n
    if min(diffs) == max(diffs):  # sd = 0: scipy warns of precision loss; the interval is the point
        return mean, mean, mean
    ci = stats.ttest_1samp(diffs, 0.0).confidence_interval(confidence_level=level)
    return mean, float(ci.low), float(ci.high)


def _sign_flip_p(values: Sequence[float], statistic: Any) -> float:
    """Exact two-sided p of ``statistic`` over all 2^n sign flips of ``values`` (n <= EXACT_MAX_N):
    scipy.stats.permutation_test, which enumerates them all when n_resamples is infinite."""
    n = len(values)
    if not 1 <= n <= EXACT_MAX_N:
        raise ValueError(f"exact sign-flip tests take 1..{EXACT_MAX_N} values, got {n}")
    if n == 1:  # both signs of one value are as extreme (scipy wants two values)
        return 1.0
    data = (np.asarray(values, dtype=float),)
    return float(stats.permutation_test(data, statistic, permutation_type="samples", n_resamples=np.inf).pvalue)


def wilcoxon_p(diffs: Sequence[float]) -> float:
    """Exact two-sided p of the Wilcoxon signed-rank test: zero differences dropped, ties given
    mid-ranks (scipy.stats.rankdata), the signed-rank sum against all sign flips of the ranks.

    This is scipy.stats.wilcoxon's own exact test with a PermutationMethod, run vectorised: that
    one scores each of the 2^n flips in a Python call (18 s at n = 16), and its method="exact"
    table rounds a tied statistic (a conservative p, not the exact one).
    """
    nonzero = np.asarray([d for d in diffs if d != 0.0], dtype=float)
    if nonzero.size == 0:
        return 1.0
    return _sign_flip_p(np.sign(nonzero) * stats.rankdata(np.abs(nonzero)), np.sum)


def _mean(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """The mean to 12 decimals: flips whose means are equal in exact arithmetic (0.01 + 0.02 - 0.03
    against 0) tie in floats too, as scipy's relative tolerance alone does not make them."""
    return np.round(np.mean(x, axis=axis), 12)


def permutation_p(diffs: Sequence[float]) -> float:
    """Exact two-sided p of the paired permutation (sign-flip) test on the mean difference."""
    return _sign_flip_p(diffs, _mean)


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
        "wilcoxon_p": wilcoxon_p(diffs),
        "permutation_p": permutation_p(diffs) if len(diffs) <= EXACT_MAX_N else None,
        "diffs": diffs,
    }


def p_text(p: float) -> str:
    """A p-value as the tables print it: three decimals, or "< 0.001" (16 pairs reach 2 / 2^16)."""
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def contrast_cells(r: Mapping[str, Any]) -> str:
    """One Holm-adjusted paired contrast's table cells, as every study prints them: arm and reference
    means, the difference with its paired t 95% interval, Wilcoxon and Holm p, the positive pairs."""
    lo, hi = r["ci"]
    positive = sum(d > 0 for d in r["diffs"])
    return (
        f"{r['arm_mean']:.3f} | {r['ref_mean']:.3f} | {r['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
        f"{p_text(r['wilcoxon_p'])} | {p_text(r['holm_p'])} | {positive} of {r['seeds']}"
    )


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
    p = the exact two-sided binomial test of b10 successes in n at 1/2 (scipy.stats.binomtest),
    = min(1, 2 sum_{i <= min(b10, b01)} C(n, i) / 2^n) (1 when n = 0)."""
    seeds = sorted(k for k in a if k in b)
    if not seeds:
        return None
    b10 = sum(bool(a[k]) and not bool(b[k]) for k in seeds)
    b01 = sum(bool(b[k]) and not bool(a[k]) for k in seeds)
    n = b10 + b01
    p = 1.0 if n == 0 else float(stats.binomtest(b10, n, 0.5).pvalue)
    return {
        "seeds": len(seeds),
        "a_rate": sum(bool(a[k]) for k in seeds) / len(seeds),
        "b_rate": sum(bool(b[k]) for k in seeds) / len(seeds),
        "a_only": b10,
        "b_only": b01,
        "p": p,
    }
