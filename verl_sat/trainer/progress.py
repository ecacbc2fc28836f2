"""The main job's console and closing report: a line a step, where a step's time went, the
quarter rewards, ``reward.png``, and the warning that SAT is inert in this run.

Everything is read from verl's own per-step metrics (``metrics.jsonl``):

- ``timing_s/step``: one global step (``sat.lag`` optimizer steps) end to end;
- ``timing_s/gen``: in ``separate_async`` the trainer's wait on the replay buffer for the
  rollout's samples (generation runs beside training; this is the part it did not hide);
- ``timing_s/old_log_prob``, ``timing_s/adv``, ``timing_s/update_actor`` (the SAT scoring pass,
  forward, backward and optimizer step), ``timing_s/update_weights`` (the weight broadcast);
- ``other``: the rest of the step (batch balancing, metrics, the data loader).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from verl_sat.default.heldout import HELDOUT_GREEDY_KEY, HELDOUT_KEY
from verl_sat.files import read_metrics, update_run_record
from verl_sat.trainer import auto_lag
from verl_sat.trainer.console import CONSOLE_LOG
from verl_sat.trainer.heldout import STEP_KEY as HELDOUT_STEP_KEY

REWARD_KEY = "critic/score/mean"
DBAR_PI_KEY = "actor/mismatch_abs_mean"
GATE_KEY = "actor/sat_gate_rate"
INTERCEPT_KEY = "actor/sat_intercepted_frac"
Q_KEY = "actor/sat_q"
STEP_KEY = "timing_s/step"
INERT_WINDOW = 20
"""the last steps the inertness warning looks at"""

TIMING_PARTS: tuple[tuple[str, str], ...] = (
    ("wait_rollout", "timing_s/gen"),
    ("old_log_prob", "timing_s/old_log_prob"),
    ("adv", "timing_s/adv"),
    ("update_actor", "timing_s/update_actor"),
    ("weight_sync", "timing_s/update_weights"),
)
"""Summary label and verl timing key of each part of a global step."""


def _values(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def quarter_means(rows: Sequence[dict[str, Any]], key: str = REWARD_KEY) -> tuple[float, float] | None:
    """Mean of ``key`` over the first and the last quarter of the steps (at least one step each)."""
    values = _values(rows, key)
    if not values:
        return None
    k = max(1, len(values) // 4)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def timing_split(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per global step of each part in :data:`TIMING_PARTS`, plus ``step`` and ``other``.

    The first step is left out when there are more (it pays one-off start-up costs); a part a
    run never logged counts 0.
    """
    steady = list(rows[1:]) if len(rows) > 1 else list(rows)
    steps = _values(steady, STEP_KEY)
    if not steps:
        return {}
    split = {"step": sum(steps) / len(steps)}
    for label, key in TIMING_PARTS:
        values = _values(steady, key)
        split[label] = sum(values) / len(values) if values else 0.0
    split["other"] = max(0.0, split["step"] - sum(split[label] for label, _ in TIMING_PARTS))
    return split


def format_split(split: dict[str, float], lag: int) -> str:
    """``step 4.2 s = 2.1 s/optimizer step: wait_rollout 2.0, ...`` (empty when nothing was timed)."""
    if not split:
        return ""
    parts = ", ".join(f"{label} {split[label]:.2f}" for label in [p for p, _ in TIMING_PARTS] + ["other"])
    return f"step {split['step']:.2f} s = {split['step'] / max(1, lag):.2f} s/optimizer step ({parts})"


def inert_warning(rows: Sequence[dict[str, Any]], eps_high: float, window: int = INERT_WINDOW) -> str | None:
    """A warning when SAT cannot change this run's updates, or None (docs/sat.md, "Where SAT acts").

    SAT moves a gated token's endpoint only inside the band 1 + eps_high~ < r < 1 + eps_high
    (and its mirror); a token beyond q with q > log(1 + eps_high) already lies outside
    PPO's interval, where PPO clips it too. So when q exceeds log(1 + eps_high) on most of the
    last ``window`` steps, SAT gates tokens that PPO already clips: SAT is inert.
    """
    qs = _values(rows, Q_KEY)[-window:]
    radius = math.log1p(eps_high)
    above = sum(q > radius for q in qs)
    if len(qs) < window or above <= window / 2:
        return None
    icpt = _values(rows[-window:], INTERCEPT_KEY)
    return (
        f"[verl-sat] warning: SAT is inert here: q > log(1 + eps_high) = {radius:.3f} on {above} of the last "
        f"{len(qs)} steps (median q {sorted(qs)[len(qs) // 2]:.3f}); mean intercepted fraction "
        f"{sum(icpt) / max(1, len(icpt)):.2g}. The tokens SAT gates are ones PPO already clips; SAT acts where "
        "q < log(1 + eps_high): a shorter lag or a smaller learning rate (docs/sat.md, 'Where SAT acts')"
    )


def plot_job(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """``reward.png``: reward (with its first/last-quarter means), dbar_pi (with sat.lag=auto's
    broadcasts), SAT gate rate and the intercepted fraction (tokens SAT clips and PPO does not) per step;
    with ``sat.heldout``, a fifth panel: the held-out accuracy (sampled, greedy) by optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        (REWARD_KEY, "reward (mean score)"),
        (DBAR_PI_KEY, "dbar_pi"),
        (GATE_KEY, "SAT gate rate"),
        (INTERCEPT_KEY, "intercepted (SAT clips, PPO does not)"),
    )
    heldout = heldout_points(rows)
    fig, axes = plt.subplots(
        1, len(panels) + bool(heldout[HELDOUT_KEY]), figsize=(17 + 4 * bool(heldout[HELDOUT_KEY]), 3.6)
    )
    for ax, (key, label) in zip(axes, panels, strict=False):
        points = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", ms=3, lw=1.4)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(label)
        ax.set_xlabel("global step")
        ax.grid(alpha=0.3)
    broadcasts = [r["step"] for r in rows if r.get("training/sat/auto_lag/broadcast")]  # sat.lag=auto
    for step in broadcasts:
        axes[1].axvline(step, color="tab:red", lw=0.6, alpha=0.5)
    if broadcasts:
        axes[1].set_title(f"dbar_pi (red: the {len(broadcasts)} broadcasts of sat.lag=auto)")
    quarters = quarter_means(rows)
    if quarters:
        first, last = quarters
        axes[0].axhline(first, color="gray", ls=":", lw=1, label=f"first quarter {first:.2f}")
        axes[0].axhline(last, color="tab:green", ls="--", lw=1, label=f"last quarter {last:.2f}")
        axes[0].legend(fontsize=8)
    if heldout[HELDOUT_KEY]:
        ax = axes[-1]
        for key, label in ((HELDOUT_KEY, "sampled"), (HELDOUT_GREEDY_KEY, "greedy")):
            if heldout[key]:
                ax.plot(*zip(*heldout[key], strict=True), marker="o", ms=3, lw=1.4, label=label)
        ax.set_title("held-out accuracy (sat.heldout)")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heldout_points(rows: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """(optimizer step, accuracy) per held-out key: step 0 from ``*_initial``, then every row's
    ``eval/heldout_step`` (verl_sat.trainer.heldout)."""
    out: dict[str, list[tuple[float, float]]] = {HELDOUT_KEY: [], HELDOUT_GREEDY_KEY: []}
    for row in rows:
        for key, points in out.items():
            if isinstance(row.get(key + "_initial"), int | float):
                points.append((0.0, float(row[key + "_initial"])))
            if isinstance(row.get(key), int | float) and isinstance(row.get(HELDOUT_STEP_KEY), int | float):
                points.append((float(row[HELDOUT_STEP_KEY]), float(row[key])))
    return out


# ---------------------------------------------------------------------------------------------
# the console: one line a step, then the closing summary
# ---------------------------------------------------------------------------------------------
PROGRESS_KEYS = {
    "reward": REWARD_KEY,
    "gate": GATE_KEY,
    "intercepted": INTERCEPT_KEY,
    "dbar_pi": DBAR_PI_KEY,
    "staleness": "training/sat/staleness_steps/max",
    "seconds": STEP_KEY,
}


def progress_line(row: dict[str, Any]) -> str:
    """``[verl-sat] step N | reward | gate | intercepted | dbar_pi | staleness<= | seconds`` (+ auto-lag)."""

    def fmt(key: str, spec: str) -> str:
        value = row.get(PROGRESS_KEYS[key])
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    line = (
        f"[verl-sat] step {row['step']:>4} | reward {fmt('reward', '.3f')} | gate {fmt('gate', '.3f')} | "
        f"intercepted {fmt('intercepted', '.4f')} | dbar_pi {fmt('dbar_pi', '.4f')} | "
        f"staleness<= {fmt('staleness', '.0f')} | {fmt('seconds', '.1f')} s"
    )
    if isinstance(row.get(HELDOUT_KEY), int | float):  # sat.heldout: taken in this global step
        line += f" | held-out {row[HELDOUT_KEY]:.3f}"
    if isinstance(row.get(auto_lag.LAG_KEY), int | float):  # sat.lag=auto: the lag this step ran at
        line += f" | lag {row[auto_lag.LAG_KEY]:.0f}{' -> broadcast' if row.get(auto_lag.BROADCAST_KEY) else ''}"
    return line


class ProgressPrinter(threading.Thread):
    """Tails metrics.jsonl (written by verl's trainer in its Ray actor) and prints a line a step
    (from the rows after those a resumed run keeps)."""

    def __init__(self, path: Path, interval: float = 1.0, eps_high: float = 0.2, out: TextIO | None = None) -> None:
        super().__init__(daemon=True)
        self.path, self.interval, self.printed, self.out = path, interval, len(read_metrics(path)), out
        self.eps_high, self.warned = eps_high, False
        self.stopped = threading.Event()

    def flush(self) -> None:
        rows = read_metrics(self.path)
        for row in rows[self.printed :]:
            print(progress_line(row), file=self.out or sys.stdout, flush=True)
        self.printed = len(rows)
        warning = None if self.warned else inert_warning(rows, self.eps_high)
        if warning:
            print(warning, file=self.out or sys.stdout, flush=True)
            self.warned = True

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.flush()
            except (OSError, ValueError):
                continue  # a line being written; read it next time

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.flush()


def summary(rows: list[dict[str, Any]], seconds: float, lag: int = 1) -> str:
    """The closing line: steps, quarter rewards, gate, staleness and where a step's time went."""
    if not rows:
        return f"[verl-sat] no training step completed ({seconds:.0f} s)"
    staleness = _values(rows, PROGRESS_KEYS["staleness"])
    gate = _values(rows, GATE_KEY)
    parts = [f"[verl-sat] {len(rows)} steps in {seconds:.0f} s"]
    quarters = quarter_means(rows)
    if quarters:
        parts.append(f"reward first-quarter {quarters[0]:.3f} -> last-quarter {quarters[1]:.3f}")
    if gate:
        parts.append(f"mean gate rate {sum(gate) / len(gate):.3f}")
    if staleness:
        parts.append(f"max staleness {max(staleness):.0f} steps")
    split = format_split(timing_split(rows), lag)
    if split:
        parts.append(split)
    return " | ".join(parts)


def lag_lines(run_dir: Path, rows: list[dict[str, Any]], sat: Any) -> list[str]:
    """sat.lag=auto: the broadcasts, also into ``run.json`` (``auto_lag``); a fixed lag: the
    ``sat.auto_lag.target`` values its staleness levels suggest (``auto_lag.suggestion_line``)."""
    if sat.lag != auto_lag.AUTO:
        line = auto_lag.suggestion_line(rows)
        return [line] if line else []
    decided = [r for r in rows if auto_lag.BROADCAST_KEY in r]
    broadcasts = sum(bool(r[auto_lag.BROADCAST_KEY]) for r in decided)
    lags = [int(r[auto_lag.LAG_KEY]) for r in decided if r[auto_lag.BROADCAST_KEY]]
    record = {**sat.auto_lag.__dict__, "broadcasts": broadcasts, "steps": len(decided), "lags": lags}
    update_run_record(run_dir, auto_lag=record)
    mean = f"{sum(lags) / len(lags):.2f}" if lags else "-"
    return [
        f"[verl-sat] sat.lag=auto ({sat.auto_lag.signal} > {sat.auto_lag.target:g}, lag in "
        f"[{sat.auto_lag.min}, {sat.auto_lag.max}]): {broadcasts} broadcasts in {len(decided)} optimizer steps, "
        f"mean lag {mean}"
    ]


def announce_console(run_dir: Path, verbose: bool) -> None:
    """Say where Ray's and the workers' output goes (``verl_sat.trainer.console``)."""
    if verbose:
        print("[verl-sat] sat.verbose=true: Ray's and the workers' output shown as it comes", flush=True)
    else:
        print(
            f"[verl-sat] Ray and worker output: {run_dir / CONSOLE_LOG} (errors still show here; "
            "sat.verbose=true shows everything)",
            flush=True,
        )
