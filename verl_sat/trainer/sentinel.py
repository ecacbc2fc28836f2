"""The collapse sentinel: online detection of the late-collapse signature (docs/sat.md#diagnostics, §7).

The paper reports that plain GRPO and GSPO "collapse later" at lag 8 (docs/reproduce.md, Table 1): the
reward falls and stays down while the train/rollout mismatch ``dbar_pi`` grows. The sentinel
watches the per-step metrics that verl already logs and raises an alarm on that signature, so a
long run can log it, stop, or roll back to the last healthy checkpoint (``docs/sentinel.md``).

Notation, per global step t (verl's ``global_steps``), over a rolling history ``H`` of the last
``W`` (``window``) finite values of a signal strictly before t:

    med(H) = median of H,   MAD(H) = median |h - med(H)|,   sigma(H) = 1.4826 MAD(H)
    scale(H) = max(sigma(H), rho |med(H)|, 1e-12)                  rho = scale_rel_floor
    z_t(x)   = (x_t - med(H)) / scale(H)                            (robust z-score)

1.4826 makes sigma the standard deviation for gaussian noise; the floor rho |med| keeps a
near-constant history (MAD ~ 0) from turning rounding noise into huge z-scores.

The cap r_max |med| matters at low reward, where sampling noise is large next to the median: at
a median of 0.10 with sigma 0.06 (64 samples), k sigma = 0.18 would put the band below 0, and a
reward falling to 0 could never be "low". With r_max = 0.5, losing half the reward always is.

The rule, with reward R (``critic/score/mean``), mismatch signals M^j (``dbar_pi`` =
``actor/mismatch_abs_mean`` and SAT's reference ``q`` = ``actor/sat_q``), gradient norm G and
entropy E:

    warm_t  = |H_R| >= warmup
    drop_t  = min(max(k sigma(H_R), delta_min), r_max |med(H_R)|)  k = reward_k, delta_min = reward_min_drop,
                                                                     r_max = reward_max_rel_drop (0: no cap)
    band_t  = med(H_R) - drop_t
    low_t   = warm_t and R_t < band_t
    run_t   = run_{t-1} + 1 if low_t else 0                          (consecutive low steps)
    onset   = the first step of the current low run
    mz_t    = max_j z_t(M^j)                                         (the larger mismatch spike)
    az_t    = max(z_t(G), |z_t(E)|)                                  (grad norm up, entropy either way)
    spike_t = max of mz over the steps [onset - L, t] >= spike_z     L = spike_lookback
    aux_t   = max of az over the steps [onset - L, t] >= aux_z
    alarm_t = run_t >= P and (spike_t or not require_mismatch_spike)
                         and (aux_t or not require_aux_anomaly) and t >= cooldown_until

P = ``patience``. After an alarm at t, ``cooldown_until = t + cooldown + 1``. The lookback L
lets a mismatch spike that *precedes* the reward drop count (the mismatch grows first, then
the reward falls). A step whose reward is missing or not finite leaves the reward state as it
is. After a step is scored, its finite values enter their histories, except a low reward: the
band stays at its pre-onset level for the whole low run, so a lasting collapse does not become
the new normal (were the low rewards to enter H_R, its MAD would grow and the band would sink
within about ten steps). A slow decline, one step at a time inside the band, moves the band
with it and is not this signature.

Pure Python + numpy: nothing here imports verl. ``verl_sat.trainer.actor.SATTrainerMixin`` runs it on
the trainer.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from verl_sat.config_node import check_fields, checked, config_from_node, flag, integer, number, one_of, text

ACTIONS = ("log", "stop", "rollback")
AFTER_ROLLBACK = ("halve_lag", "none")
MAD_TO_SIGMA = 1.4826  # sigma = 1.4826 MAD for gaussian noise
MISMATCH_KEYS = ("actor/mismatch_abs_mean", "actor/sat_q")  # dbar_pi and SAT's q


def _keys(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(k, str) and k for k in value)


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
@dataclass
class SentinelConfig:
    """``sat.sentinel``: the collapse sentinel (off unless enabled). The rule: module docstring.

    Args:
        enabled: run the sentinel on the trainer every step (adds ``sentinel/*`` metrics).
        action: on alarm, ``log`` (metrics + a printed line), ``stop`` (end training after the
            step), or ``rollback`` (reload the newest checkpoint saved before the collapse).
        reward_key: the reward metric (verl: mean sequence score of the batch).
        mismatch_keys: mismatch metrics whose spike is the collapse's second half (dbar_pi, q).
        grad_norm_key: the gradient-norm metric (an anomaly is a z-score above ``aux_z``).
        entropy_key: the entropy metric (only logged when verl computes entropy).
        window: W, the rolling history length of every signal, in steps.
        warmup: steps of reward history before any alarm (<= window).
        patience: P, consecutive low-reward steps needed for an alarm.
        reward_k: k, the band's width in robust standard deviations below the rolling median.
        reward_min_drop: the band is at least this far below the median (reward units; rewards
            from the math verifier are in [0, 1]). Keeps a near-constant reward from alarming on
            a tiny dip.
        reward_max_rel_drop: r_max, the band is never more than this fraction of |median| below
            the median (0: no cap). For rewards in [0, 1]; keeps the band above 0 at low reward.
        spike_z: a mismatch z-score at or above this is a spike.
        spike_lookback: L, steps before the onset of the low run in which a spike still counts.
        require_mismatch_spike: the alarm needs a mismatch spike (the paper's signature); off:
            a sustained reward drop alone is enough.
        aux_z: a gradient-norm (or |entropy|) z-score at or above this is an anomaly.
        require_aux_anomaly: the alarm also needs a gradient-norm or entropy anomaly.
        scale_rel_floor: rho, the robust scale is at least rho |median| (see module docstring).
        cooldown: steps after an alarm during which no new alarm fires.
        rollback_margin: roll back to a checkpoint saved at least this many steps before the
            onset (the weights that generated the first low batch are already bad; async
            sampling reaches one step further back).
        max_rollbacks: after this many rollbacks, a further alarm stops training instead.
        after_rollback: the safer setting a rollback switches to: ``halve_lag`` (the weights
            reach the rollout twice as often from the next step on; nothing at lag 1) or ``none``.
    """

    enabled: bool = flag(False)
    action: str = one_of("log", ACTIONS)
    reward_key: str = text("critic/score/mean")
    mismatch_keys: tuple[str, ...] = checked(MISMATCH_KEYS, _keys, "a list of non-empty strings")
    grad_norm_key: str = text("actor/grad_norm")
    entropy_key: str = text("actor/entropy")
    window: int = integer(50, low=2)
    warmup: int = integer(20, low=2)
    patience: int = integer(3, low=1)
    reward_k: float = number(3.0, strictly_positive=True)
    reward_min_drop: float = number(0.05, strictly_positive=False)
    reward_max_rel_drop: float = number(0.5, strictly_positive=False)
    spike_z: float = number(4.0, strictly_positive=True)
    spike_lookback: int = integer(10, low=0)
    require_mismatch_spike: bool = flag(True)
    aux_z: float = number(4.0, strictly_positive=True)
    require_aux_anomaly: bool = flag(False)
    scale_rel_floor: float = number(0.05, strictly_positive=False)
    cooldown: int = integer(10, low=0)
    rollback_margin: int = integer(2, low=0)
    max_rollbacks: int = integer(2, low=0)
    after_rollback: str = one_of("halve_lag", AFTER_ROLLBACK)

    def __post_init__(self) -> None:
        if isinstance(self.mismatch_keys, str):
            self.mismatch_keys = (self.mismatch_keys,)
        elif isinstance(self.mismatch_keys, Iterable):
            self.mismatch_keys = tuple(self.mismatch_keys)
        check_fields(self, "sat.sentinel")
        if self.warmup > self.window:
            raise ValueError(f"sat.sentinel.warmup must be <= sat.sentinel.window ({self.window}), got {self.warmup!r}")


# ---------------------------------------------------------------------------------------------
# robust statistics
# ---------------------------------------------------------------------------------------------
def robust_center_scale(history: Iterable[float], rel_floor: float) -> tuple[float, float, float]:
    """(med, sigma, scale) of a history: med(H), 1.4826 MAD(H), max(sigma, rho |med|, 1e-12)."""
    values = [float(v) for v in history]
    med = statistics.median(values)
    sigma = MAD_TO_SIGMA * statistics.median([abs(v - med) for v in values])
    return med, sigma, max(sigma, rel_floor * abs(med), 1e-12)


def robust_z(value: float, history: Iterable[float], rel_floor: float) -> float:
    """z = (x - med(H)) / scale(H)."""
    med, _, scale = robust_center_scale(history, rel_floor)
    return (value - med) / scale


def _finite(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _nanmax(values: Iterable[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


# ---------------------------------------------------------------------------------------------
# the sentinel
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SentinelEvent:
    """An alarm: the collapse signature held at ``step``; the low-reward run began at ``onset_step``."""

    step: int
    onset_step: int
    action: str
    reasons: tuple[str, ...]

    def describe(self) -> str:
        return f"collapse signature at step {self.step} (low reward since step {self.onset_step}): " + "; ".join(
            self.reasons
        )


class CollapseSentinel:
    """Online detector of the collapse signature on per-step metric dicts (module docstring).

    ``update(step, metrics)`` scores one step and returns a ``SentinelEvent`` on alarm, else
    None. ``last_metrics`` then holds the step's ``sentinel/*`` metrics for logging (the finite
    ones): ``alarm`` (0/1), ``reward_band_low``, ``low_run``, ``mismatch_z``, ``grad_norm_z``,
    ``entropy_z``.
    """

    def __init__(self, config: SentinelConfig) -> None:
        self.config = config
        window = config.window
        self._reward: deque[float] = deque(maxlen=window)
        self._mismatch: dict[str, deque[float]] = {k: deque(maxlen=window) for k in config.mismatch_keys}
        self._grad_norm: deque[float] = deque(maxlen=window)
        self._entropy: deque[float] = deque(maxlen=window)
        # (mismatch z, aux z) of the last L steps before the current one
        self._recent: deque[tuple[float, float]] = deque(maxlen=max(config.spike_lookback, 1))
        self._run = 0
        self._onset: int | None = None
        self._run_mz = math.nan
        self._run_az = math.nan
        self._cooldown_until: int | None = None
        self.last_metrics: dict[str, float] = {}
        self.events: list[SentinelEvent] = []

    # -- signals -------------------------------------------------------------------------------
    def _z(self, value: float | None, history: deque[float]) -> float:
        if value is None or len(history) < self.config.warmup:
            return math.nan
        return robust_z(value, history, self.config.scale_rel_floor)

    def reward_band(self) -> float:
        """band = med(H_R) - min(max(k sigma(H_R), delta_min), r_max |med(H_R)|); nan before the warm-up."""
        cfg = self.config
        if len(self._reward) < cfg.warmup:
            return math.nan
        med, sigma, _ = robust_center_scale(self._reward, cfg.scale_rel_floor)
        drop = max(cfg.reward_k * sigma, cfg.reward_min_drop)
        if cfg.reward_max_rel_drop > 0:
            drop = min(drop, cfg.reward_max_rel_drop * abs(med))
        return med - drop

    # -- one step ------------------------------------------------------------------------------
    def update(self, step: int, metrics: Mapping[str, Any]) -> SentinelEvent | None:
        """Score step ``step`` from its metrics, then add its values to the histories."""
        cfg = self.config
        reward = _finite(metrics, cfg.reward_key)
        band = self.reward_band()
        mismatch = {k: _finite(metrics, k) for k in cfg.mismatch_keys}
        mz = _nanmax(self._z(v, self._mismatch[k]) for k, v in mismatch.items())
        grad_norm, entropy = _finite(metrics, cfg.grad_norm_key), _finite(metrics, cfg.entropy_key)
        gz, ez = self._z(grad_norm, self._grad_norm), self._z(entropy, self._entropy)
        az = _nanmax([gz, abs(ez)])

        if reward is not None:
            low = math.isfinite(band) and reward < band
            if low and self._run == 0:  # a run starts: the lookback's spikes count
                self._onset = step
                self._run_mz = _nanmax([mz, *(m for m, _ in self._recent_lookback())])
                self._run_az = _nanmax([az, *(a for _, a in self._recent_lookback())])
            elif low:
                self._run_mz, self._run_az = _nanmax([self._run_mz, mz]), _nanmax([self._run_az, az])
            self._run = self._run + 1 if low else 0
            if not low:
                self._onset, self._run_mz, self._run_az = None, math.nan, math.nan

        event = self._maybe_alarm(step, reward, band)
        self.last_metrics = self._step_metrics(event is not None, band, mz, gz, ez)
        if event is not None:
            self.events.append(event)

        # histories take the step's values after it is scored; a low reward does not, so the
        # band stays at its pre-onset level for the whole low run
        if reward is not None and self._run == 0:
            self._reward.append(reward)
        for k, v in mismatch.items():
            if v is not None:
                self._mismatch[k].append(v)
        if grad_norm is not None:
            self._grad_norm.append(grad_norm)
        if entropy is not None:
            self._entropy.append(entropy)
        self._recent.append((mz, az))
        return event

    def _recent_lookback(self) -> list[tuple[float, float]]:
        lookback = self.config.spike_lookback
        return list(self._recent)[-lookback:] if lookback > 0 else []

    def _maybe_alarm(self, step: int, reward: float | None, band: float) -> SentinelEvent | None:
        cfg = self.config
        if reward is None or self._run < cfg.patience or self._onset is None:
            return None
        if self._cooldown_until is not None and step < self._cooldown_until:
            return None
        spike = math.isfinite(self._run_mz) and self._run_mz >= cfg.spike_z
        aux = math.isfinite(self._run_az) and self._run_az >= cfg.aux_z
        if (cfg.require_mismatch_spike and not spike) or (cfg.require_aux_anomaly and not aux):
            return None
        reasons = [f"reward {reward:.4g} below the band {band:.4g} for {self._run} steps"]
        if spike:
            reasons.append(f"mismatch z {self._run_mz:.1f} >= {cfg.spike_z:g}")
        if aux:
            reasons.append(f"grad-norm/entropy z {self._run_az:.1f} >= {cfg.aux_z:g}")
        self._cooldown_until = step + cfg.cooldown + 1
        return SentinelEvent(
            step=step,
            onset_step=self._onset,
            action=cfg.action,
            reasons=tuple(reasons),
        )

    def _step_metrics(self, alarm: bool, band: float, mz: float, gz: float, ez: float) -> dict[str, float]:
        values = {
            "sentinel/alarm": float(alarm),
            "sentinel/low_run": float(self._run),
            "sentinel/reward_band_low": band,
            "sentinel/mismatch_z": mz,
            "sentinel/grad_norm_z": gz,
            "sentinel/entropy_z": ez,
        }
        return {k: v for k, v in values.items() if math.isfinite(v)}


# ---------------------------------------------------------------------------------------------
# rollback target
# ---------------------------------------------------------------------------------------------
def select_rollback_step(
    checkpoints: Iterable[int], onset_step: int, margin: int, poisoned: Iterable[tuple[int, int]] = ()
) -> int | None:
    """The newest checkpoint k with k <= onset - margin outside every poisoned range (a, b].

    A poisoned range is (onset_i - margin, rollback_i] of an earlier rollback: checkpoints
    saved there hold weights from during that collapse.
    """
    poisoned = list(poisoned)
    ok = [k for k in checkpoints if k <= onset_step - margin and not any(a < k <= b for a, b in poisoned)]
    return max(ok) if ok else None


def standing_alarm(sentinel: CollapseSentinel) -> SentinelEvent | None:
    """The last alarm, if its low-reward run has not ended (the reward is still below the band)."""
    if not sentinel.events or sentinel._run == 0:
        return None
    last = sentinel.events[-1]
    return last if sentinel._onset == last.onset_step else None


# ---------------------------------------------------------------------------------------------
# the hook on verl's v1 trainer (SATTrainerMixin; verl imported lazily, inside the methods)
# ---------------------------------------------------------------------------------------------
# verl's fit loop, per global step t: step() -> save checkpoint -> on_step_end (weight sync)
# -> _compute_metrics (the reward appears here) -> logger.log -> global_steps += 1. So the
# sentinel scores step t in _compute_metrics, whose metrics verl logs next; "stop" lowers
# total_training_steps to t, which ends verl's loop after this step; "rollback" reloads the
# checkpoint in the next step's on_step_end, right before verl's own weight sync, and halves
# the lag (docs/sentinel.md, "After a rollback").
class SentinelTrainerMixin:
    """The collapse sentinel on verl's trainer; writes ``<run_dir>/sentinel.json`` as it acts."""

    def _sentinel(self) -> CollapseSentinel | None:
        """The ``CollapseSentinel`` of ``sat.sentinel`` in the composed config; None when disabled."""
        if "_sat_sentinel" not in self.__dict__:
            sat = self.config.get("sat") or {}  # type: ignore[attr-defined]
            config = config_from_node(SentinelConfig, sat.get("sentinel"), "sat.sentinel")
            self._sat_sentinel = CollapseSentinel(config) if config.enabled else None
            self._sat_rollbacks: list[tuple[int, int]] = []  # (onset - margin, step rolled back at)
            self._sat_rollback_pending: dict[str, Any] | None = None
            self._sat_sentinel_carry: dict[str, float] = {}
            self._sat_record: dict[str, Any] = {"alarms": [], "rollbacks": [], "verdict": {"collapsed": False}}
        return self._sat_sentinel

    def _sentinel_observe(self, step: int, metrics: dict) -> None:
        """Score the step; add ``sentinel/*`` to its metrics; on alarm, act (``sat.sentinel.action``)."""
        sentinel = self._sentinel()
        if sentinel is None:
            return
        metrics.update(self._sat_sentinel_carry)
        self._sat_sentinel_carry = {}
        event = sentinel.update(step, metrics)
        metrics.update(sentinel.last_metrics)
        if event is not None:
            self._sentinel_alarm(event, step, metrics)
        if step >= int(self.total_training_steps):  # type: ignore[attr-defined]
            self._sentinel_verdict(step)
        self._sentinel_write()

    def _sentinel_alarm(self, event: SentinelEvent, step: int, metrics: dict) -> None:
        action = event.action
        print(f"[verl-sat] sentinel: {event.describe()}; action: {action}", flush=True)
        self._sat_record["alarms"].append(
            {"step": step, "onset": event.onset_step, "reason": event.describe(), "action": action}
        )
        if action == "rollback":
            action = self._sentinel_schedule_rollback(event, metrics)
        if action == "stop":
            # verl's loop runs while global_steps <= total_training_steps: this step is the last
            self.total_training_steps = min(int(self.total_training_steps), step)  # type: ignore[attr-defined]
            metrics["sentinel/stop"] = 1.0
            self._sat_record["stopped"] = {"step": step, "why": self._sat_record.get("stop_why", event.describe())}
            print(f"[verl-sat] sentinel: stopping after step {step}", flush=True)

    def _sentinel_verdict(self, step: int) -> None:
        """On the last step: a stop by the sentinel, or an alarm still standing, is a collapse."""
        record = self._sat_record
        stopped = record.get("stopped")
        standing = standing_alarm(self._sat_sentinel)
        if stopped:
            why = f"the sentinel stopped training after step {stopped['step']}: {stopped['why']}"
        elif standing is not None:
            why = (
                f"the alarm of step {standing.step} still stands at the last step {step} "
                f"(reward below the band since step {standing.onset_step}; {len(self._sat_rollbacks)} rollback(s) done)"
            )
        else:
            record["verdict"] = {"collapsed": False, "final_step": step}
            return
        record["verdict"] = {"collapsed": True, "why": why, "final_step": step}
        print(f"[verl-sat] sentinel: verdict: collapsed: {why}", flush=True)

    def _sentinel_write(self) -> None:
        from verl_sat.files import write_json

        run_dir = (self.config.get("sat") or {}).get("run_dir")  # type: ignore[attr-defined]
        if not run_dir:
            return
        write_json(Path(str(run_dir)) / "sentinel.json", self._sat_record)

    def _sentinel_checkpoint_dir(self) -> str:
        """verl's ``trainer.default_local_dir``, made absolute as ``_load_checkpoint`` does."""
        folder = str(self.config.trainer.default_local_dir)  # type: ignore[attr-defined]
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)

    def _sentinel_schedule_rollback(self, event: SentinelEvent, metrics: dict) -> str:
        """Pick the newest checkpoint saved before the onset; "stop" if none or out of rollbacks."""
        from verl_sat.trainer.faults import checkpoint_steps, read_tracker

        config = self._sat_sentinel.config
        if len(self._sat_rollbacks) >= config.max_rollbacks:
            why = f"{config.max_rollbacks} rollback(s) already done and the collapse signature is back"
            print(f"[verl-sat] sentinel: {why}; stopping", flush=True)
            self._sat_record["stop_why"] = f"{why} ({event.describe()})"
            return "stop"
        folder = self._sentinel_checkpoint_dir()
        newest = read_tracker(folder)  # verl writes the tracker last: newer directories may be half-written
        saved = [k for k in checkpoint_steps(folder, with_actor=True) if newest is not None and k <= newest]
        target = select_rollback_step(saved, event.onset_step, config.rollback_margin, self._sat_rollbacks)
        if target is None:
            why = f"no checkpoint in {folder} at or before step {event.onset_step - config.rollback_margin}"
            print(f"[verl-sat] sentinel: {why}; stopping", flush=True)
            self._sat_record["stop_why"] = f"{why} to roll back to ({event.describe()})"
            return "stop"
        self._sat_rollback_pending = {
            "alarm_step": event.step,
            "onset": event.onset_step,
            "target": target,
            "path": os.path.join(folder, f"global_step_{target}"),
            "reason": event.describe(),
        }
        metrics["sentinel/rollback_target"] = float(target)
        print(f"[verl-sat] sentinel: rolling back to the checkpoint of step {target} next step", flush=True)
        return "rollback"

    def _sentinel_rollback_if_pending(self) -> None:
        """Reload the actor (and critic) checkpoint picked on alarm, before verl syncs weights,
        then make the run safer (``_sentinel_safer_setting``) and record the rollback.

        verl's ``load_checkpoint`` restores what ``checkpoint.load_contents`` lists (model,
        optimizer, lr scheduler). The step counter, dataloader position and TransferQueue
        contents are kept: training goes on with new prompts from the restored weights.
        """
        pending = self.__dict__.get("_sat_rollback_pending")
        if pending is None:
            return
        self._sat_rollback_pending = None
        path, target = pending["path"], pending["target"]
        self.actor_rollout_wg.load_checkpoint(local_path=os.path.join(path, "actor"), del_local_after_load=False)  # type: ignore[attr-defined]
        if getattr(self, "use_critic", False):
            from verl.trainer.ppo.utils import Role

            self.critic_wg.load_checkpoint(local_path=os.path.join(path, str(Role.Critic)), del_local_after_load=False)  # type: ignore[attr-defined]
        step = int(self.global_steps)  # type: ignore[attr-defined]
        self._sat_rollbacks.append((pending["onset"] - self._sat_sentinel.config.rollback_margin, step))
        changed = self._sentinel_safer_setting()
        self._sat_sentinel_carry = {
            "sentinel/rollbacks": float(len(self._sat_rollbacks)),
            "sentinel/rolled_back_to": float(target),
        }
        self._sat_record["rollbacks"].append(
            {
                "alarm_step": pending["alarm_step"],
                "step": step,
                "target": target,
                "reason": pending["reason"],
                "setting_changed": changed,
            }
        )
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()) or "nothing (the lag is already 1)"
        line = f"[verl-sat] sentinel: step {step}: restored the checkpoint of step {target}; changed: {what}"
        print(line, flush=True)
        self._sentinel_write()

    def _sentinel_safer_setting(self) -> dict[str, tuple[int, int]]:
        """After a rollback, halve the lag (``sat.sentinel.after_rollback=halve_lag``; docs/sat.md#setting).

        In separate_async one global step holds ``parameter_sync_step`` optimizer steps over as
        many mini-batches (``verl_sat.trainer.recipe.apply_lag``). verl's step reads both numbers below
        every global step, so from the next one on the weights reach the rollout twice as often.
        Returns ``{key: (old, new)}`` ({} when the lag is already 1 or the rule is off).
        """
        from omegaconf import open_dict

        config = self._sat_sentinel.config
        old = int(getattr(self, "parameter_sync_step", 1))
        if config.after_rollback != "halve_lag" or old <= 1:
            return {}
        new = old // 2
        mini = int(self.config.actor_rollout_ref.actor.ppo_mini_batch_size)  # type: ignore[attr-defined]
        with open_dict(self.config):  # type: ignore[attr-defined]
            node = self.config.trainer.v1.get(self.trainer_mode)  # type: ignore[attr-defined]
            if node is not None and "parameter_sync_step" in node:
                node.parameter_sync_step = new
            old_batch = int(self.config.data.train_batch_size)  # type: ignore[attr-defined]
            self.config.data.train_batch_size = new * mini  # type: ignore[attr-defined]
        self.parameter_sync_step = new
        return {"sat.lag": (old, new), "data.train_batch_size": (old_batch, new * mini)}
