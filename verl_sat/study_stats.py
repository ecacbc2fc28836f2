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

from verl_sat.sentinel import CollapseSentinel, SentinelConfig

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

    from verl_sat.paths import hydra_config_dir

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
