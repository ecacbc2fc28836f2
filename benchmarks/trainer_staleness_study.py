"""The first staleness study, through verl's trainer: GSPO / SAT-GSPO / GRPO / SAT-GRPO, +-R3, lag 1 and 8.

Kept to reproduce docs/study.md's first study (16 optimizer steps, i.i.d. logit noise: a regime
in which nothing was in trouble). The study in a stress regime is benchmarks/staleness_study.py.

Every run goes through verl's real trainer (``python -m verl_sat.main``, one subprocess at a
time, each into its own run directory under ``--out/runs/``) on the CPU default (tiny Qwen3-MoE,
synthetic arithmetic, separate_async). The rollout's logits get Gaussian noise
(``actor_rollout_ref.rollout.engine_kwargs.hf.logit_noise_std``) so that rollout and trainer
disagree measurably and staleness bites at this scale. The number of *optimizer* steps is the
same at every lag (``trainer.total_training_steps = steps / lag`` verl global steps).

Baselines: GSPO and GRPO run as ``sat_gspo`` / ``sat`` with ``policy_loss.sat_enabled=false``,
which is bit-identical to verl's ``gspo`` / ``vanilla`` losses (README, tests/test_losses_on_cpu.py)
and in addition logs ``dbar_pi`` (``actor/mismatch_abs_mean``), which verl's own losses do not.

    python benchmarks/trainer_staleness_study.py --quick --out runs/study_quick     # <= 10 min on 2 cores
    python benchmarks/trainer_staleness_study.py --out runs/study                   # full: 4 x 2 x 2 x 3 seeds
    python benchmarks/trainer_staleness_study.py --dry-run                          # print the commands only
    python benchmarks/trainer_staleness_study.py --summarize-only runs/study        # table + plots again

Outputs in ``--out``: ``study.md`` (one row per (method, lag): mean ± std over seeds of the
final reward (mean of the last 25% of logged steps), the best reward, collapses (runs where the
CPU default's collapse sentinel, replayed on the logged metrics, alarms), mean ``dbar_pi`` and
mean SAT gate rate), ``study.json`` (also report.py's ``CollapseRule`` per run),
``reward.png`` and ``dbar_pi.png`` (seed mean with a ±1 std band against optimizer steps, one
panel per lag, one line per method).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_sat.paper.report import DBAR_PI_KEY, GATE_RATE_KEY, CollapseRule, Run, Series, load_run, reward_series
from verl_sat.study import stats as study_stats
from verl_sat.study.stats import cpu_sentinel_config
from verl_sat.trainer.sentinel import SentinelConfig

# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------

# method -> (loss_mode, loss_agg_mode, sat_enabled). Baselines: SAT off = verl's loss, bit for bit.
LOSSES: dict[str, tuple[str, str, bool]] = {
    "gspo": ("sat_gspo", "seq-mean-token-mean", False),
    "sat_gspo": ("sat_gspo", "seq-mean-token-mean", True),
    "grpo": ("sat", "token-mean", False),
    "sat_grpo": ("sat", "token-mean", True),
}
NOISE_KEY = "actor_rollout_ref.rollout.engine_kwargs.hf.logit_noise_std"
SEED_KEYS = ("actor_rollout_ref.rollout.seed", "data.seed")
DEFAULT_NOISE = 0.5  # measured at lag 1: mean dbar_pi 0.069 vs 0.015 without noise (0.2: 0.024; docs/study.md)
QUICK = {"methods": ("gspo", "sat_gspo"), "r3": (False,), "lags": (1, 8), "seeds": (1,), "steps": 8}
FULL = {"methods": tuple(LOSSES), "r3": (False, True), "lags": (1, 8), "seeds": (1, 2, 3), "steps": 16}
# Cost model of the estimate, measured on the quiet 2-core machine (docs/study.md): Ray, workers,
# FSDP and rollout start-up ~65 s per run (verl's import alone is 7.5 s in each of ~6 processes);
# an optimizer step ~3.5 s. Two runs side by side took 144 s against 2 x 86 s one after the
# other: start-up is mostly one process importing at a time, so a second job overlaps it.
STARTUP_S = 65.0
STEP_S = 3.5
PARALLEL_GAIN = 1.2  # throughput of --jobs >= 2 over --jobs 1 (measured with 2; 2 cores)
BUDGET_MIN = 60.0
FINAL_FRAC = 0.25
# report.py's reward-only collapse rule ("lost half its gain late"), kept in study.json. It is not
# the table's collapse count: on 16 steps of a reward averaged over 32 samples (std ~0.06) it
# flagged 6 of the first 8 lag-1 runs from sampling noise alone (docs/study.md). The table
# counts alarms of the collapse sentinel, whose false-alarm rate is tested (docs/sentinel.md).
COLLAPSE_RULE = CollapseRule(min_points=16)
STATUS_FILE = "study_run.json"


@dataclass(frozen=True)
class RunSpec:
    """One training run of the study.

    Args:
        method: ``gspo`` | ``sat_gspo`` | ``grpo`` | ``sat_grpo`` (without the R3 suffix).
        r3: routing replay R3 on (``sat.routing_replay=R3``).
        lag: optimizer steps between weight broadcasts (``sat.lag``).
        seed: rollout and data-loader seed.
        steps: optimizer steps (the same at every lag).
        noise: std of the Gaussian noise on the rollout's logits.
    """

    method: str
    r3: bool
    lag: int
    seed: int
    steps: int
    noise: float

    @property
    def key(self) -> str:
        """The Table-1 method key (``sat_gspo_r3``)."""
        return self.method + ("_r3" if self.r3 else "")

    @property
    def name(self) -> str:
        """Run directory name, ``<key>-lag<n>-seed<s>`` (readable by report.infer_method_lag)."""
        return f"{self.key}-lag{self.lag}-seed{self.seed}"

    @property
    def global_steps(self) -> int:
        """verl global steps: each holds ``lag`` optimizer steps."""
        return self.steps // self.lag

    def overrides(self, run_dir: Path) -> list[str]:
        """Hydra overrides of ``python -m verl_sat.main`` for this run."""
        loss_mode, agg_mode, sat_enabled = LOSSES[self.method]
        return [
            f"sat.run_dir={run_dir}",
            f"sat.method={self.key}",
            f"sat.lag={self.lag}",
            f"sat.routing_replay={'R3' if self.r3 else 'disabled'}",
            f"trainer.total_training_steps={self.global_steps}",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
            f"actor_rollout_ref.actor.policy_loss.sat_enabled={str(sat_enabled).lower()}",
            f"actor_rollout_ref.actor.loss_agg_mode={agg_mode}",
            f"{NOISE_KEY}={self.noise}",
            *(f"{key}={self.seed}" for key in SEED_KEYS),
        ]


def plan(
    methods: Sequence[str], r3: Sequence[bool], lags: Sequence[int], seeds: Sequence[int], steps: int, noise: float
) -> list[RunSpec]:
    """All runs, seed-major (a partial study still covers every cell), then lag, method, R3."""
    for method in methods:
        if method not in LOSSES:
            raise ValueError(f"--methods: unknown method {method!r}; known: {list(LOSSES)}")
    for lag in lags:
        if lag < 1 or steps % lag:
            raise ValueError(f"--steps={steps} must be a positive multiple of every lag (got lag {lag})")
    return [
        RunSpec(method, flag, lag, seed, steps, noise)
        for seed in seeds
        for lag in lags
        for method in methods
        for flag in r3
    ]


def command(spec: RunSpec, out: Path, extra: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """The command line of one run (its run directory is ``out/runs/<name>``)."""
    return [python, "-m", "verl_sat.main", *spec.overrides(out / "runs" / spec.name), *extra]


def estimate_s(specs: Sequence[RunSpec], startup_s: float = STARTUP_S, step_s: float = STEP_S, jobs: int = 1) -> float:
    """Estimated wall time of ``specs`` in seconds: start-up + optimizer steps per run, run ``jobs``
    at a time (``PARALLEL_GAIN`` for more than one: 2 cores do not make two runs twice as fast)."""
    serial = sum(startup_s + spec.steps * step_s for spec in specs)
    return serial / (PARALLEL_GAIN if jobs > 1 else 1.0)


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def run_one(spec: RunSpec, out: Path, extra: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Run one training job; writes ``train.log`` and ``study_run.json`` into its run directory.

    Status ``ok``, ``failed`` or, when an R3 run fails, ``unavailable`` (routing replay not usable
    in this checkout); a run directory that already holds a finished run is skipped.
    """
    run_dir = out / "runs" / spec.name
    status_path = run_dir / STATUS_FILE
    if status_path.is_file() and json.loads(status_path.read_text()).get("status") == "ok":
        print(f"[study] {spec.name}: already done, skipped", flush=True)
        return json.loads(status_path.read_text())
    if run_dir.exists():  # an earlier, unfinished attempt: main refuses a non-empty metrics.jsonl
        for stale in ("metrics.jsonl", "run.json"):
            (run_dir / stale).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_FILE_LOGGER")}
    start = time.perf_counter()
    with (run_dir / "train.log").open("w") as log:
        try:
            proc = subprocess.run(
                command(spec, out, extra), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out, timeout=timeout_s
            )
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.perf_counter() - start
    ok = rc == 0 and (run_dir / "metrics.jsonl").is_file()
    status = "ok" if ok else ("unavailable" if spec.r3 else "failed")
    record = {**asdict(spec), "key": spec.key, "name": spec.name, "status": status, "rc": rc, "seconds": seconds}
    status_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"[study] {spec.name}: {status} in {seconds:.0f} s", flush=True)
    return record


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------


@dataclass
class RunStats:
    """The study's numbers for one run (None: the run never logged the metric)."""

    name: str
    method: str
    lag: int
    seed: int
    status: str
    final_reward: float | None = None
    best_reward: float | None = None
    collapsed: bool | None = None  # the sentinel alarmed (None: it never got past its warm-up)
    reward_rule_collapsed: bool | None = None  # report.CollapseRule on the reward alone
    dbar_pi: float | None = None
    gate_rate: float | None = None
    sentinel_alarms: int | None = None
    sentinel_scored: int | None = None
    dbar_pi_by_staleness: dict[int, float] = field(default_factory=dict)


BY_STALENESS_KEY = re.compile(r"^actor/sat_by_staleness/(\d+)/mismatch_abs_mean$")


def staleness_profile(run: Run) -> dict[int, float]:
    """{s: dbar_pi among the tokens of staleness s}, averaged over the run's logged steps."""
    profile = {}
    for key, series in run.metrics.items():
        match = BY_STALENESS_KEY.match(key)
        if match and series:
            profile[int(match.group(1))] = statistics.fmean(series.values())
    return dict(sorted(profile.items()))


def replay_sentinel(run: Run, config: SentinelConfig) -> tuple[int, int]:
    """(alarms, scored steps) of the collapse sentinel replayed on a run's logged metrics."""
    steps = sorted({step for series in run.metrics.values() for step in series})
    rows = [{"step": step, **{k: v[step] for k, v in run.metrics.items() if step in v}} for step in steps]
    alarms, scored = study_stats.replay_sentinel(rows, config)
    return len(alarms), scored


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def final_mean(series: Series, frac: float = FINAL_FRAC) -> float | None:
    """Mean of the last ``ceil(frac * n)`` points (at least one)."""
    return study_stats.final_mean([v for _, v in series], frac)


def seed_of(name: str) -> int:
    """``"gspo-lag8-seed3"`` -> 3 (0 when the name carries no seed)."""
    match = re.search(r"seed(\d+)", name)
    return int(match.group(1)) if match else 0


def run_stats(
    run: Run, seed: int, status: str = "ok", rule: CollapseRule | None = None, sentinel: SentinelConfig | None = None
) -> RunStats:
    """Final and best reward, collapse flag, mean dbar_pi, mean gate rate and sentinel alarms of one run."""
    rewards = reward_series(run)
    gate = [v for _, v in run.series(GATE_RATE_KEY)]
    alarms, scored = replay_sentinel(run, sentinel or cpu_sentinel_config())
    return RunStats(
        name=run.name,
        method=run.method,
        lag=run.lag,
        seed=seed,
        status=status,
        final_reward=final_mean(rewards),
        best_reward=max((v for _, v in rewards), default=None),
        collapsed=alarms > 0 if scored else None,
        reward_rule_collapsed=(rule or COLLAPSE_RULE).collapsed(rewards),
        dbar_pi=_mean([v for _, v in run.series(DBAR_PI_KEY)]),
        gate_rate=_mean(gate),
        sentinel_alarms=alarms,
        sentinel_scored=scored,
        dbar_pi_by_staleness=staleness_profile(run),
    )


def load_study(out: Path) -> tuple[list[Run], list[RunStats]]:
    """Every run directory under ``out/runs`` (or ``out`` itself): finished runs and all stats.

    A run without metrics (failed, or R3 unavailable) appears only in the stats, by its status.
    """
    root = out / "runs" if (out / "runs").is_dir() else out
    runs, stats = [], []
    sentinel = cpu_sentinel_config()
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        record = json.loads((run_dir / STATUS_FILE).read_text()) if (run_dir / STATUS_FILE).is_file() else {}
        seed = int(record.get("seed", seed_of(run_dir.name)))
        status = str(record.get("status", "ok"))
        if (run_dir / "metrics.jsonl").is_file() and status == "ok":
            run = load_run(run_dir)
            runs.append(run)
            stats.append(run_stats(run, seed, status, sentinel=sentinel))
        elif record:
            stats.append(RunStats(run_dir.name, str(record["key"]), int(record["lag"]), seed, status))
    return runs, stats


@dataclass
class CellSummary:
    """One (method, lag) row: mean and std over seeds of each statistic."""

    method: str
    lag: int
    seeds: int
    statuses: dict[str, int] = field(default_factory=dict)
    values: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    collapses: tuple[int, int] = (0, 0)
    sentinel: tuple[int, int] = (0, 0)  # (alarms, scored steps) over the cell's runs
    by_staleness: dict[int, tuple[float, float]] = field(default_factory=dict)  # s -> dbar_pi mean, std


STAT_COLUMNS = ("final_reward", "best_reward", "dbar_pi", "gate_rate")


def mean_std(values: Sequence[float]) -> tuple[float, float] | None:
    """(mean, sample std) — std 0 for a single value; None for none."""
    if not values:
        return None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def method_order(method: str) -> tuple[int, str]:
    """Baselines before SAT, objectives in LOSSES order, R3 after the plain variant."""
    base = method.removesuffix("_r3")
    order = list(LOSSES)
    return (order.index(base) if base in order else len(order), method)


def summarize(stats: Sequence[RunStats]) -> list[CellSummary]:
    """One CellSummary per (method, lag), ordered by lag, then method."""
    cells: dict[tuple[str, int], list[RunStats]] = {}
    for s in stats:
        cells.setdefault((s.method, s.lag), []).append(s)
    out = []
    for (method, lag), group in sorted(cells.items(), key=lambda kv: (kv[0][1], method_order(kv[0][0]))):
        ok = [s for s in group if s.status == "ok"]
        statuses: dict[str, int] = {}
        for s in group:
            statuses[s.status] = statuses.get(s.status, 0) + 1
        values = {col: mean_std([getattr(s, col) for s in ok if getattr(s, col) is not None]) for col in STAT_COLUMNS}
        judged = [s.collapsed for s in ok if s.collapsed is not None]
        sentinel = (sum(s.sentinel_alarms or 0 for s in ok), sum(s.sentinel_scored or 0 for s in ok))
        levels = sorted({k for s in ok for k in s.dbar_pi_by_staleness})
        by_staleness = {
            k: mean_std([s.dbar_pi_by_staleness[k] for s in ok if k in s.dbar_pi_by_staleness]) for k in levels
        }
        cells = (sum(judged), len(judged))
        out.append(CellSummary(method, lag, len(ok), statuses, values, cells, sentinel, by_staleness))
    return out


def _cell(value: tuple[float, float] | None, spec: str) -> str:
    if value is None:
        return "–"
    mean, std = value
    return f"{mean:{spec}} ± {std:{spec}}"


def format_study(cells: Sequence[CellSummary], title: str = "Staleness study") -> str:
    """study.md: one row per (method, lag), mean ± std over seeds."""
    lines = [
        f"# {title}",
        "",
        "| method | lag | seeds | final reward | best reward | collapses | dbar_pi | SAT gate rate | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        collapsed, judged = c.collapses
        statuses = ", ".join(f"{n} {status}" for status, n in sorted(c.statuses.items()))
        cells_text = [
            c.method,
            str(c.lag),
            str(c.seeds),
            _cell(c.values.get("final_reward"), ".3f"),
            _cell(c.values.get("best_reward"), ".3f"),
            f"{collapsed}/{judged}" if judged else "n/a",
            _cell(c.values.get("dbar_pi"), ".4f"),
            _cell(c.values.get("gate_rate"), ".3f"),
            statuses,
        ]
        lines.append("| " + " | ".join(cells_text) + " |")
    lines += format_staleness_table(cells)
    lines += [
        "",
        f"final reward: mean `critic/score/mean` over the last {FINAL_FRAC:.0%} of logged steps; best: its maximum.",
        "collapses: runs in which the CPU default's collapse sentinel, replayed on the logged metrics, alarmed / "
        "runs it scored (n/a: no run got past its warm-up of "
        f"{cpu_sentinel_config().warmup} logged steps).",
        f"dbar_pi: mean `{DBAR_PI_KEY}` over the run; gate rate: mean `{GATE_RATE_KEY}` (SAT runs only).",
        "Cells: mean ± std over seeds (std 0 with one seed). runs: statuses (unavailable = R3 failed).",
    ]
    return "\n".join(lines) + "\n"


def format_staleness_table(cells: Sequence[CellSummary]) -> list[str]:
    """dbar_pi by per-sample staleness (optimizer steps), one row per (method, lag > 1)."""
    rows = [c for c in cells if c.lag > 1 and c.by_staleness]
    if not rows:
        return []
    levels = sorted({k for c in rows for k in c.by_staleness})
    lines = [
        "",
        "dbar_pi by per-sample staleness s (optimizer steps between the generating and the trained weights), "
        "mean over each run's steps, then mean ± std over seeds:",
        "",
        "| method | lag | " + " | ".join(f"s={k}" for k in levels) + " |",
        "|---|---|" + "---|" * len(levels),
    ]
    for c in rows:
        values = [_cell(c.by_staleness.get(k), ".3f") for k in levels]
        lines.append(f"| {c.method} | {c.lag} | " + " | ".join(values) + " |")
    return lines


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def optimizer_step_series(run: Run, key_fn: Any) -> Series:
    """``key_fn(run)`` with verl global steps mapped to optimizer steps (the end of each global step)."""
    return [(step * run.lag, value) for step, value in key_fn(run)]


def seed_band(series_list: Sequence[Series]) -> tuple[list[int], list[float], list[float]]:
    """Steps, mean and std over the series that have each step."""
    by_step: dict[int, list[float]] = {}
    for series in series_list:
        for step, value in series:
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    stats = [mean_std(by_step[s]) or (math.nan, 0.0) for s in steps]
    return steps, [m for m, _ in stats], [s for _, s in stats]


def plot_study(runs: Sequence[Run], key_fn: Any, ylabel: str, title: str, path: Path) -> Path:
    """One panel per lag, one line per method (seed mean, ±1 std band), x = optimizer steps."""
    from verl_sat.paper.report import _colors, _pyplot, finish_lag_panel, save_panels

    plt = _pyplot()
    lags = sorted({r.lag for r in runs}) or [1]
    methods = sorted({r.method for r in runs}, key=method_order)
    colors = _colors(methods)
    fig, axes = plt.subplots(1, len(lags), figsize=(5.5 * len(lags), 4), squeeze=False, sharey=True)
    for ax, lag in zip(axes[0], lags, strict=True):
        plotted = False
        for method in methods:
            series = [optimizer_step_series(r, key_fn) for r in runs if r.lag == lag and r.method == method]
            steps, mean, std = seed_band([s for s in series if s])
            if not steps:
                continue
            label = f"{method} (n={sum(1 for s in series if s)})"
            ax.plot(steps, mean, marker="o" if len(steps) < 4 else None, color=colors[method], label=label, lw=1.4)
            low = [m - s for m, s in zip(mean, std, strict=True)]
            high = [m + s for m, s in zip(mean, std, strict=True)]
            ax.fill_between(steps, low, high, color=colors[method], alpha=0.2)
            plotted = True
        finish_lag_panel(ax, lag, plotted, "optimizer step")
        ax.set_xlim(left=0)
    return save_panels(fig, axes, ylabel, title, path)


def plot_staleness_profile(cells: Sequence[CellSummary], path: Path) -> Path | None:
    """dbar_pi against per-sample staleness, one panel per lag > 1, one line per method (±1 std)."""
    from verl_sat.paper.report import _colors, _pyplot, finish_lag_panel, save_panels

    rows = [c for c in cells if c.lag > 1 and c.by_staleness]
    if not rows:
        return None
    plt = _pyplot()
    lags = sorted({c.lag for c in rows})
    colors = _colors([c.method for c in rows])
    fig, axes = plt.subplots(1, len(lags), figsize=(5.5 * len(lags), 4), squeeze=False, sharey=True)
    for ax, lag in zip(axes[0], lags, strict=True):
        for c in sorted((c for c in rows if c.lag == lag), key=lambda c: method_order(c.method)):
            levels = sorted(c.by_staleness)
            mean = [c.by_staleness[k][0] for k in levels]
            std = [c.by_staleness[k][1] for k in levels]
            ax.plot(levels, mean, marker="o", ms=3, color=colors[c.method], label=f"{c.method} (n={c.seeds})", lw=1.4)
            low = [m - d for m, d in zip(mean, std, strict=True)]
            ax.fill_between(
                levels, low, [m + d for m, d in zip(mean, std, strict=True)], color=colors[c.method], alpha=0.15
            )
        finish_lag_panel(ax, lag, True, "staleness s (optimizer steps)")
    return save_panels(
        fig, axes, "dbar_pi among tokens of staleness s", "Mismatch by staleness (seed mean ± std)", path
    )


def write_summary(out: Path, title: str = "Staleness study") -> list[CellSummary]:
    """study.md, study.json, reward.png, dbar_pi.png and (lag > 1) dbar_pi_by_staleness.png from ``out``."""
    runs, stats = load_study(out)
    cells = summarize(stats)
    text = format_study(cells, title)
    (out / "study.md").write_text(text)
    (out / "study.json").write_text(
        json.dumps({"runs": [asdict(s) for s in stats], "cells": [asdict(c) for c in cells]}, indent=1) + "\n"
    )
    plot_study(runs, reward_series, "mean reward", "Training reward (seed mean ± std)", out / "reward.png")
    plot_study(
        runs, lambda r: r.series(DBAR_PI_KEY), "dbar_pi = mean |log pi/mu|", "Mismatch (seed mean ± std)",
        out / "dbar_pi.png",
    )  # fmt: skip
    plot_staleness_profile(cells, out / "dbar_pi_by_staleness.png")
    print(text, flush=True)
    return cells


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The study's argument parser."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/staleness_study"), help="study directory")
    p.add_argument("--quick", action="store_true", help="gspo vs sat_gspo, lag 1 and 8, one seed, no R3")
    p.add_argument("--dry-run", action="store_true", help="print the planned commands and the estimate only")
    p.add_argument("--summarize-only", type=Path, metavar="DIR", help="rebuild table and plots from DIR")
    p.add_argument("--noise", type=float, default=DEFAULT_NOISE, help="std of the rollout logit noise")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (a multiple of every lag)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (full default: 1 2 3)")
    p.add_argument("--methods", nargs="+", default=None, help=f"subset of {list(LOSSES)}")
    p.add_argument("--no-r3", action="store_true", help="skip the R3 variants")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (each starts its own Ray cluster)")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per-run wall-clock limit")
    p.add_argument("--startup-s", type=float, default=STARTUP_S, help="estimate: start-up seconds per run")
    p.add_argument("--step-s", type=float, default=STEP_S, help="estimate: seconds per optimizer step")
    p.add_argument("extra", nargs="*", help="further Hydra overrides for every run (e.g. sat.assets_dir=...)")
    return p


def specs_from_args(args: argparse.Namespace) -> list[RunSpec]:
    """The planned runs for the parsed arguments."""
    base = QUICK if args.quick else FULL
    r3 = (False,) if args.no_r3 else base["r3"]
    return plan(
        args.methods or base["methods"],
        r3,
        base["lags"],
        args.seeds or base["seeds"],
        args.steps or base["steps"],
        args.noise,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (1 when a non-R3 run failed)."""
    args = build_parser().parse_args(argv)
    if args.summarize_only:
        write_summary(args.summarize_only, "Staleness study (quick)" if args.quick else "Staleness study")
        return 0
    specs = specs_from_args(args)
    out = args.out.resolve()
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    est = estimate_s(specs, args.startup_s, args.step_s, args.jobs)
    print(
        f"[study] {len(specs)} runs, {specs[0].steps} optimizer steps each, noise {args.noise}; estimate "
        f"{est / 60:.1f} min ({args.startup_s:.0f} s start-up + {args.step_s:.1f} s/optimizer step per run, "
        f"{args.jobs} at a time)"
    )
    if est / 60 > BUDGET_MIN:
        print(f"[study] warning: above the {BUDGET_MIN:.0f} min budget; per-run start-up dominates (--no-r3 halves it)")
    for spec in specs:
        print(f"[study]   {spec.name}: {spec.global_steps} global steps x lag {spec.lag}")
    if args.dry_run:
        for spec in specs:
            print(" ".join(command(spec, out, args.extra)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each run is its own subprocess
        records = list(pool.map(lambda spec: run_one(spec, out, args.extra, args.timeout_s), specs))
    wall = time.perf_counter() - start
    print(f"[study] {len(records)} runs in {wall / 60:.1f} min (estimate was {est / 60:.1f} min)", flush=True)
    (out / "wall_time.json").write_text(json.dumps({"seconds": wall, "estimate_s": est}) + "\n")
    write_summary(out, "Staleness study (quick)" if args.quick else "Staleness study")
    return int(any(r["status"] == "failed" for r in records))


if __name__ == "__main__":
    sys.exit(main())
