"""avg@k and pass@k over per-problem (samples, correct) counts.

- avg@k (the paper's "avg@8" / "avg@16", docs/reproduce.md): for each problem the fraction of its k
  samples that are correct, averaged over problems. It estimates pass@1 with k samples.
- pass@k: the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, Codex, Eq. 1),
  ``1 - C(n - c, k) / C(n, k)`` per problem, averaged over problems.

Both return fractions in [0, 1]; reports print percentages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _check_counts(n: int, c: int) -> None:
    if n < 1:
        raise ValueError(f"a problem needs at least one sample, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"correct count must be in [0, n={n}], got c={c}")


def pass_at_k_per_problem(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples (1 <= k <= n)."""
    _check_counts(n, c)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got k={k}")
    # Chen et al.'s Eq. 1 in exact integers (math.comb; C(n-c, k) = 0 when n - c < k), then one
    # correctly rounded division, so pass@1 is c / n to the last bit.
    return (math.comb(n, k) - math.comb(n - c, k)) / math.comb(n, k)


def pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """Mean over problems of the unbiased pass@k; ``counts`` holds ``(n_samples, n_correct)``."""
    if not counts:
        raise ValueError("pass_at_k needs at least one problem")
    return sum(pass_at_k_per_problem(n, c, k) for n, c in counts) / len(counts)


def avg_at_k(counts: Sequence[tuple[int, int]]) -> float:
    """Mean over problems of the per-problem accuracy ``c / n`` (the paper's avg@k): pass@1, exactly."""
    return pass_at_k(counts, 1)
