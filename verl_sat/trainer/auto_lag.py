"""Mismatch-driven lag, ``sat.lag=auto``: broadcast the weights when the mismatch asks for it (docs/sat.md#setting, §2).

A fixed lag n broadcasts after every n-th optimizer step, whatever the policy did in between.
SAT already measures, every step, how far the rollout's policy mu has drifted from the trained
pi_theta on the batch it just trained. ``auto`` broadcasts on that measurement. After optimizer
step j, with k the optimizer steps since the last broadcast (k = 1 right after one) and s_j the
chosen signal of step j's batch:

    broadcast after step j  <=>  k >= min  and  (s_j > target and fresh_j  or  k >= max)

fresh_j: step j's batch was drawn by the rollout's current weights (its newest weight version is
that of the last broadcast). With a batch in flight, the step right after a broadcast still
trains on a batch drawn before it, whose mismatch speaks of the weights the rollout no longer
holds; counting it would broadcast again at once (``fresh=false``, the rule of the first auto-lag
study, did: 41% of its broadcasts came one step after the previous one; docs/study.md).

signals (all logged by SAT's losses every step, docs/sat.md#the-rule):
    dbar_pi      = mean over the batch's tokens of |log pi_theta - log mu|   (default; paper Eq. 52)
    q            = the step's alpha-quantile of |d|, d = log pi_theta - log mu
    intercepted  = share of tokens SAT clips that PPO alone does not

Every broadcast goes through verl's own weight sync, as a fixed lag's does; between two of them
the rollout keeps sampling with the weights it has, so a sample's staleness (verl_sat.trainer.actor
.staleness_in_steps) is at most ``max``: that stays the staleness bound. ``min`` caps how often the
rollout pauses for a sync. docs/async.md ("Mismatch-driven lag") says why dbar_pi is a sound
trigger and where it is not, and how to choose ``target`` (``suggest_targets``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_sat.config_node import check_fields, config_from_node, flag, integer, number, one_of

AUTO = "auto"
SIGNALS: dict[str, str] = {
    "dbar_pi": "actor/mismatch_abs_mean",
    "q": "actor/sat_q",
    "intercepted": "actor/sat_intercepted_frac",
}
"""signal name -> the step metric it reads (verl's names, as SAT's losses log them)"""
PREFIX = "training/sat/auto_lag"
BROADCAST_KEY, LAG_KEY, SIGNAL_KEY = f"{PREFIX}/broadcast", f"{PREFIX}/lag", f"{PREFIX}/signal"
BY_STALENESS = "actor/sat_by_staleness"


@dataclass
class AutoLagConfig:
    """``sat.auto_lag``: read only with ``sat.lag=auto``.

    Args:
        target: broadcast once the signal of the latest batch exceeds it (> 0).
        min: never broadcast sooner than ``min`` optimizer steps after the last broadcast (>= 1).
        max: always broadcast ``max`` steps after the last one (>= min): the staleness bound.
        signal: ``dbar_pi`` | ``q`` | ``intercepted`` (``SIGNALS``).
        fresh: only a batch drawn by the rollout's current weights can trigger (module docstring);
            false: any batch (the first auto-lag study's rule).
    """

    target: float = number(0.02, strictly_positive=True, expected="a number")
    min: int = integer(1, low=1)
    max: int = integer(8, low=1)
    signal: str = one_of("dbar_pi", sorted(SIGNALS))
    fresh: bool = flag(True, expected="true or false")

    def __post_init__(self) -> None:
        check_fields(self, "sat.auto_lag")
        if self.min > self.max:
            raise ValueError(f"sat.auto_lag.min={self.min} must be <= sat.auto_lag.max={self.max}")

    @property
    def key(self) -> str:
        """The step metric the signal reads."""
        return SIGNALS[self.signal]


class AutoLag:
    """The rule of the module docstring, one decision per optimizer step."""

    def __init__(self, config: AutoLagConfig) -> None:
        self.config = config
        self.since = 0  # optimizer steps since the last broadcast
        self.broadcasts = 0
        self.force = False

    def decide(self, signal: float | None, fresh: bool = True) -> tuple[bool, int]:
        """After an optimizer step: (broadcast now?, k = steps since the last broadcast, this one
        included). ``fresh``: the step's batch was drawn by the rollout's current weights. A
        missing or non-finite signal counts as below target (only ``max`` triggers);
        ``force_next`` (after a sentinel rollback) broadcasts regardless."""
        self.since += 1
        k, cfg = self.since, self.config
        above = signal is not None and math.isfinite(signal) and signal > cfg.target
        above = above and (fresh or not cfg.fresh)
        broadcast = self.force or (k >= cfg.min and (above or k >= cfg.max))
        if broadcast:
            self.since, self.force = 0, False
            self.broadcasts += 1
        return broadcast, k

    def force_next(self) -> None:
        """The next decision broadcasts (the trainer's weights changed under the rollout)."""
        self.force = True

    def step_metrics(self, broadcast: bool, k: int, signal: float | None) -> dict[str, float]:
        """What each step logs: whether it broadcast, the lag it ran at (k) and the signal read."""
        out = {BROADCAST_KEY: float(broadcast), LAG_KEY: float(k)}
        if signal is not None:
            out[SIGNAL_KEY] = float(signal)
        return out


def signal_of(metrics: Mapping[str, Any], config: AutoLagConfig) -> float | None:
    """The signal's value in a step's metrics (None when the step did not log it)."""
    value = metrics.get(config.key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def suggest_targets(rows: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """dbar_pi by staleness from a fixed-lag run's metrics: {s: mean over steps of
    ``actor/sat_by_staleness/<s>/mismatch_abs_mean``}. ``target = D(s)`` broadcasts about when the
    batch's mismatch reaches what s steps of staleness gave in that run (docs/async.md)."""
    import pandas as pd

    frame = pd.DataFrame(list(rows)).filter(regex=rf"^{BY_STALENESS}/\d+/mismatch_abs_mean$")
    frame = frame.apply(pd.to_numeric, errors="coerce").replace([math.inf, -math.inf], math.nan)
    means = {int(key.split("/")[-2]): mean for key, mean in frame.mean().items()}  # NaN skipped
    return {s: float(means[s]) for s in sorted(means) if math.isfinite(means[s])}


def suggestion_line(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The end-of-run line of a fixed-lag run: the dbar_pi targets its staleness levels suggest."""
    table = suggest_targets(rows)
    positive = {s: v for s, v in table.items() if s > 0 and v > 0}
    if not positive:
        return None
    pairs = ", ".join(f"s={s}: {v:.3g}" for s, v in positive.items())
    return (
        f"[verl-sat] sat.lag=auto: dbar_pi by staleness in this run {pairs}; sat.auto_lag.target=D(s) "
        f"broadcasts about when a batch is as far off as s steps of staleness made it here (docs/async.md)"
    )


# ---------------------------------------------------------------------------------------------
# the hook on verl's v1 trainer (SATTrainerMixin)
# ---------------------------------------------------------------------------------------------
# verl's separate_async, per global step (one optimizer step under auto): step() -> _update_actor
# (the step's metrics, the signal among them) -> save checkpoint -> on_step_end, which calls
# standalone_checkpoint_manager.update_weights(global_steps) and logs what it returns with the
# step. So the manager is wrapped: its update_weights runs only when the rule says so, and
# returns this step's decision as metrics either way. The sync after loading a checkpoint
# (on_init_end) runs before the wrap: a resumed run always starts from a broadcast.
class GatedWeightSync:
    """verl's checkpoint manager whose ``update_weights`` runs when ``AutoLag`` decides to, and
    always before a step ``must(global_steps)`` names (validation: it samples with the rollout)."""

    def __init__(self, manager: Any, gate: AutoLag, signal: Any, must: Any = None, version: int = 0) -> None:
        self.manager, self.gate, self.signal = manager, gate, signal
        self.must = must or (lambda global_steps: False)
        self.version = version  # the rollout's weight version: the global step of the last sync

    def update_weights(self, global_steps: int, *args: Any, **kwargs: Any) -> dict[str, Any]:
        value, batch_version = self.signal()
        if self.must(global_steps):
            self.gate.force_next()
        fresh = batch_version is None or batch_version >= self.version
        broadcast, k = self.gate.decide(value, fresh)
        if broadcast:
            self.version = global_steps
        out = dict(self.manager.update_weights(global_steps, *args, **kwargs) or {}) if broadcast else {}
        out.update(self.gate.step_metrics(broadcast, k, value))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)


class AutoLagTrainerMixin:
    """``sat.lag=auto`` on verl's separate_async trainer (module docstring)."""

    def _auto_lag(self) -> AutoLag | None:
        if "_sat_auto_lag" not in self.__dict__:
            sat = self.config.get("sat") or {}  # type: ignore[attr-defined]
            auto = sat.get("lag") == AUTO
            self._sat_auto_lag = (
                AutoLag(config_from_node(AutoLagConfig, sat.get("auto_lag"), "sat.auto_lag")) if auto else None
            )
            self._sat_auto_signal: tuple[float | None, int | None] = (None, None)
        return self._sat_auto_lag

    def _auto_lag_observe(self, metrics: Mapping[str, Any], tags: Sequence[Mapping[str, Any]] = ()) -> None:
        """After the actor update: remember this step's signal and its batch's newest weight version
        (verl's ``max_global_steps`` tags; None without them, counted as fresh)."""
        gate = self._auto_lag()
        if gate is not None:
            versions = [int(t["max_global_steps"]) for t in tags if "max_global_steps" in t]
            self._sat_auto_signal = (signal_of(metrics, gate.config), max(versions) if versions else None)

    def _auto_lag_wrap_sync(self) -> None:
        """Before verl's on_step_end: gate its weight sync (once)."""
        gate = self._auto_lag()
        manager = getattr(self, "standalone_checkpoint_manager", None)
        if gate is not None and manager is not None and not isinstance(manager, GatedWeightSync):
            # the last sync was on_init_end's, before fit() advanced global_steps to this step
            version = int(getattr(self, "global_steps", 1)) - 1
            self.standalone_checkpoint_manager = GatedWeightSync(
                manager, gate, lambda: self._sat_auto_signal, self._auto_lag_validates, version
            )

    def _auto_lag_validates(self, global_steps: int) -> bool:
        """verl validates after this step's sync (``test_freq``, and the last step): the rollout
        that samples the validation set must hold the trained weights, so the sync runs."""
        trainer = self.config.trainer  # type: ignore[attr-defined]
        test_freq = int(trainer.get("test_freq", -1) or -1)
        last = global_steps >= int(getattr(self, "total_training_steps", 0) or 0) > 0
        return test_freq > 0 and (last or global_steps % test_freq == 0)

    def _auto_lag_after_rollback(self) -> dict[str, tuple[int, int]]:
        """A sentinel rollback changed the weights under the rollout: broadcast at this step, and
        halve ``max`` (not below ``min``), auto's form of the sentinel's halve_lag. {} without auto."""
        gate = self._auto_lag()
        if gate is None:
            return {}
        gate.force_next()
        old = gate.config.max
        new = max(gate.config.min, old // 2)
        if new == old:
            return {}
        gate.config = AutoLagConfig(**{**gate.config.__dict__, "max": new})
        return {"sat.auto_lag.max": (old, new)}
