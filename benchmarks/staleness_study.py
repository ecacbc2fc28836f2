"""Staleness study in a regime where stale training is in trouble: SAT against the baselines, many seeds.

Every run is one :class:`verl_sat.study.loop.StudyLoop` (the CPU trainer's HF rollout engine,
verl's registered losses and GRPO advantage, in one process: docs/study.md says what it does
and does not exercise). ``--jobs`` worker processes each import torch/verl/transformers once
and load the default's assets once, then run many runs: per-run start-up is building the two
model copies (printed), against ~65 s per run through verl's trainer.

    python benchmarks/staleness_study.py --search --out runs/search     # baselines only: pick the regime
    python benchmarks/staleness_study.py --out runs/study               # the measurement (<= 90 min)
    python benchmarks/staleness_study.py --quick --out runs/study_quick # <= 10 min: the pipeline, 1 seed
    python benchmarks/staleness_study.py --summarize-only runs/study    # table + figures again

The regime (``REGIME``) was fixed from the ``--search`` baselines alone, before any SAT run, and
is written with that evidence in docs/study.md. Outputs in ``--out``: ``study.md`` (per arm and
lag: final and best reward with 95% bootstrap intervals over seeds, collapsed seeds under the
replayed collapse sentinel, dbar_pi, gate rate), ``study.json``, ``reward.png``, ``dbar_pi.png``,
``gate_rate.png``; each run's metrics under ``runs/<arm>-lag<n>-seed<k>/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from verl_sat.main import read_metrics
from verl_sat.study.loop import METRICS_FILE, LoopConfig, run_in_worker, worker_init
from verl_sat.study.stats import bootstrap_ci, cpu_sentinel_config, final_mean, replay_sentinel

# arm -> LoopConfig fields. Baselines run the SAT losses with sat_enabled=false: verl's own
# vanilla / gspo loss bit for bit (tests/test_losses_on_cpu.py), plus the dbar_pi metric.
ARMS: dict[str, dict[str, Any]] = {
    "grpo": {"loss_mode": "sat", "sat_enabled": False, "loss_agg_mode": "token-mean"},
    "sat_grpo": {"loss_mode": "sat", "loss_agg_mode": "token-mean"},
    "gspo": {"loss_mode": "sat_gspo", "sat_enabled": False, "loss_agg_mode": "seq-mean-token-mean"},
    "sat_gspo": {"loss_mode": "sat_gspo", "loss_agg_mode": "seq-mean-token-mean"},
    "grpo_tis": {"loss_mode": "vanilla", "correction": "tis", "loss_agg_mode": "token-mean"},
    # hydra_configs/algorithm/dppo.yaml: delta 1e-3 in probability, IS cap 20
    "dppo_tv": {
        "loss_mode": "dppo_tv",
        "loss_agg_mode": "token-mean",
        "eps_low": 1e-3,
        "eps_high": 1e-3,
        "clip_ratio_c": 20.0,
    },
    "gspo_r3": {"loss_mode": "sat_gspo", "sat_enabled": False, "routing_replay": "R3"},
    "sat_gspo_r3": {"loss_mode": "sat_gspo", "routing_replay": "R3"},
}
BASELINES = ("grpo", "gspo")
# (arm, its reference): the per-seed differences study.md reports
PAIRS = (
    ("sat_grpo", "grpo"),
    ("sat_gspo", "gspo"),
    ("grpo_tis", "grpo"),
    ("dppo_tv", "grpo"),
    ("sat_gspo_r3", "gspo_r3"),
)

# The stress regime, chosen from --search's baselines alone (docs/study.md, "The regime").
REGIME: dict[str, Any] = {
    "lr": 8e-4,
    "steps": 240,
    "logit_bias_std": 0.0,
    "router_bias_std": 0.0,
    "prompts_per_step": 8,
    "rollout_n": 4,
    "staleness": "legacy",  # this study's schedule: staleness 0..n-1 (the trainer's is 1..n)
}
STRESS_LAG = 32
FULL = {
    "arms": {
        STRESS_LAG: ("grpo", "sat_grpo", "gspo", "sat_gspo", "grpo_tis", "dppo_tv"),
        1: ("grpo", "sat_grpo", "gspo", "sat_gspo"),
    },
    "seeds": (1, 2, 3, 4, 5),
}
QUICK = {"arms": {STRESS_LAG: ("grpo", "sat_grpo"), 1: ("grpo",)}, "seeds": (1,), "steps": 160}
# --search: the baselines at lag 1 and the stress lag, without and with a systematic mismatch
# (a fixed per-token logit bias and a fixed per-expert router bias in the rollout)
SEARCH = {
    "lags": (1, STRESS_LAG),
    "mismatch": {
        "none": {"logit_bias_std": 0.0, "router_bias_std": 0.0},
        "bias": {"logit_bias_std": 0.2, "router_bias_std": 1.0},
    },
    "seeds": (1, 2, 3),
}
REWARD_KEY = "critic/score/mean"
DBAR_PI_KEY = "actor/mismatch_abs_mean"
GATE_RATE_KEY = "actor/sat_gate_rate"


@dataclass(frozen=True)
class Spec:
    """One run: an arm at a lag and a seed, with the regime's settings (and the search's tag)."""

    arm: str
    lag: int
    seed: int
    settings: tuple[tuple[str, Any], ...]
    tag: str = ""

    @property
    def name(self) -> str:
        tag = f"{self.tag}-" if self.tag else ""
        return f"{tag}{self.arm}-lag{self.lag}-seed{self.seed}"

    def config(self) -> LoopConfig:
        return LoopConfig(**{**dict(self.settings), **ARMS[self.arm], "lag": self.lag, "seed": self.seed})


def plan(arms: dict[int, Sequence[str]], seeds: Sequence[int], settings: dict[str, Any], tag: str = "") -> list[Spec]:
    """Every (lag, arm, seed), lag-major; each spec validated (a bad arm or setting fails here)."""
    specs = []
    for lag, names in arms.items():
        for arm in names:
            if arm not in ARMS:
                raise ValueError(f"unknown arm {arm!r}; known: {sorted(ARMS)}")
            for seed in seeds:
                spec = Spec(arm, lag, seed, tuple(sorted(settings.items())), tag)
                spec.config()
                specs.append(spec)
    return specs


def search_plan(seeds: Sequence[int] = SEARCH["seeds"]) -> list[Spec]:
    """The baselines at every search lag, under each mismatch (the regime's other settings fixed)."""
    specs = []
    for tag, mismatch in SEARCH["mismatch"].items():
        arms = {lag: BASELINES for lag in SEARCH["lags"]}
        specs += plan(arms, seeds, {**REGIME, **mismatch}, tag=tag)
    return specs


# ---------------------------------------------------------------------------------------------
# Running: worker processes that import and load once, then run many specs
# ---------------------------------------------------------------------------------------------
def run_all(specs: Sequence[Spec], out: Path, assets_dir: Path, jobs: int) -> list[dict[str, Any]]:
    """Run ``specs`` on ``jobs`` worker processes (skipping runs already complete in ``out``)."""
    todo = [s for s in specs if not _complete(out / "runs" / s.name, s.config().steps)]
    print(f"[study] {len(specs)} runs, {len(specs) - len(todo)} already done; {jobs} worker(s)", flush=True)
    if not todo:
        return []
    start = time.perf_counter()
    ctx = get_context("spawn")
    timings = []
    pool = ProcessPoolExecutor(jobs, mp_context=ctx, initializer=worker_init, initargs=(str(assets_dir),))
    with pool:
        futures = [pool.submit(run_in_worker, spec.config(), str(out / "runs" / spec.name), spec.arm) for spec in todo]
        for i, future in enumerate(futures, 1):
            result = future.result()
            timings.append(result)
            elapsed = time.perf_counter() - start
            print(
                f"[study] {i}/{len(todo)} {result['name']}: {result['run_s']:.0f} s "
                f"(start-up {result['startup_s']:.2f} s) | {elapsed / 60:.1f} min",
                flush=True,
            )
    return timings


def _complete(run_dir: Path, steps: int) -> bool:
    path = run_dir / METRICS_FILE
    return path.is_file() and len(path.read_text().splitlines()) >= steps


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------
def run_stats(spec: Spec, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Final and best reward, collapse alarms (replayed sentinel), mean dbar_pi and gate rate of one run."""
    rewards = [r[REWARD_KEY] for r in rows]
    alarms, scored = replay_sentinel(rows, cpu_sentinel_config())
    gate = [r[GATE_RATE_KEY] for r in rows if GATE_RATE_KEY in r and spec.arm.startswith("sat")]
    return {
        "name": spec.name,
        "arm": spec.arm,
        "lag": spec.lag,
        "seed": spec.seed,
        "tag": spec.tag,
        "final_reward": final_mean(rewards),
        "best_reward": max(rewards),
        "collapsed": bool(alarms) if scored else None,
        "first_alarm": alarms[0] if alarms else None,
        "dbar_pi": sum(r[DBAR_PI_KEY] for r in rows) / len(rows),
        "dbar_pi_final": final_mean([r[DBAR_PI_KEY] for r in rows]),
        "gate_rate": sum(gate) / len(gate) if gate else None,
    }


def cells(stats: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per (tag, lag, arm): means over seeds with 95% bootstrap intervals, collapse counts."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for s in stats:
        groups.setdefault((s["tag"], s["lag"], s["arm"]), []).append(s)
    order = list(ARMS)
    out = []
    for (tag, lag, arm), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1], order.index(kv[0][2]))):
        cell: dict[str, Any] = {"tag": tag, "lag": lag, "arm": arm, "seeds": len(runs)}
        for key in ("final_reward", "best_reward", "dbar_pi", "dbar_pi_final", "gate_rate"):
            values = [r[key] for r in runs if r[key] is not None]
            cell[key] = sum(values) / len(values) if values else None
            cell[f"{key}_ci"] = bootstrap_ci(values)
        judged = [r for r in runs if r["collapsed"] is not None]
        cell["collapsed"] = (sum(r["collapsed"] for r in judged), len(judged))
        out.append(cell)
    return out


def paired_differences(stats: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (lag, arm - reference) in PAIRS: mean over shared seeds of the difference in final
    reward and in last-quarter dbar_pi, with 95% bootstrap intervals (the seed fixes data order
    and sampling, so seed k of both arms starts from the same place)."""
    by_key = {(s["tag"], s["lag"], s["arm"], s["seed"]): s for s in stats}
    out = []
    for tag, lag in sorted({(s["tag"], s["lag"]) for s in stats}, key=lambda t: (t[0], -t[1])):
        for arm, ref in PAIRS:
            seeds = sorted(k[3] for k in by_key if k[:3] == (tag, lag, arm) and (tag, lag, ref, k[3]) in by_key)
            if not seeds:
                continue
            row: dict[str, Any] = {"tag": tag, "lag": lag, "arm": arm, "reference": ref, "seeds": len(seeds)}
            for key in ("final_reward", "dbar_pi_final"):
                diffs = [by_key[(tag, lag, arm, k)][key] - by_key[(tag, lag, ref, k)][key] for k in seeds]
                row[key] = sum(diffs) / len(diffs)
                row[f"{key}_ci"] = bootstrap_ci(diffs)
            out.append(row)
    return out


def format_differences(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| mismatch | lag | arm - reference | seeds | final reward difference [95% CI] | dbar_pi difference [95% CI] |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        (flo, fhi), (dlo, dhi) = r["final_reward_ci"], r["dbar_pi_final_ci"]
        lines.append(
            f"| {r['tag'] or '-'} | {r['lag']} | {r['arm']} - {r['reference']} | {r['seeds']} | "
            f"{r['final_reward']:+.3f} [{flo:+.3f}, {fhi:+.3f}] | {r['dbar_pi_final']:+.4f} [{dlo:+.4f}, {dhi:+.4f}] |"
        )
    return lines


def _ci(cell: dict[str, Any], key: str, spec: str = ".3f") -> str:
    if cell[key] is None:
        return "–"
    lo, hi = cell[f"{key}_ci"]
    return f"{cell[key]:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def format_table(table: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| mismatch | lag | arm | seeds | final reward [95% CI] | best reward [95% CI] | collapsed | "
        "dbar_pi (last quarter) | SAT gate rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in table:
        collapsed, judged = c["collapsed"]
        lines.append(
            f"| {c['tag'] or '-'} | {c['lag']} | {c['arm']} | {c['seeds']} | {_ci(c, 'final_reward')} | "
            f"{_ci(c, 'best_reward')} | {collapsed}/{judged} | {_ci(c, 'dbar_pi_final', '.4f')} | "
            f"{_ci(c, 'gate_rate')} |"
        )
    return lines


def summarize(out: Path, specs: Sequence[Spec], title: str) -> list[dict[str, Any]]:
    """study.md, study.json and the figures from the run directories under ``out/runs``."""
    paths = {s.name: out / "runs" / s.name / METRICS_FILE for s in specs}
    runs = {name: read_metrics(path) for name, path in paths.items() if path.is_file()}
    stats = [run_stats(s, runs[s.name]) for s in specs if s.name in runs]
    table = cells(stats)
    regime = ", ".join(f"{k}={v}" for k, v in sorted(dict(specs[0].settings).items())) if specs else ""
    sentinel = cpu_sentinel_config()
    differences = paired_differences(stats)
    text = [f"# {title}", "", f"Settings: {regime}.", "", *format_table(table), ""]
    if differences:
        text += ["Per-seed differences (seed k of both arms):", "", *format_differences(differences), ""]
    text += [
        "final reward: mean `critic/score/mean` over the last 25% of optimizer steps; best: its maximum.",
        "[95% CI]: percentile bootstrap of the mean over seeds. collapsed: seeds in which the CPU default's "
        f"collapse sentinel (window {sentinel.window}, warm-up {sentinel.warmup}, patience {sentinel.patience}), "
        "replayed on the logged metrics, alarmed / seeds.",
        "dbar_pi: mean |log pi - log mu| over the last quarter; gate rate: mean `actor/sat_gate_rate` (SAT arms).",
    ]
    (out / "study.md").write_text("\n".join(text) + "\n")
    results = {"runs": stats, "cells": table, "differences": differences}
    (out / "study.json").write_text(json.dumps(results, indent=2, default=str))
    by_name = {s.name: s for s in specs}
    for key, label, name in (
        (REWARD_KEY, "reward (mean over the step's samples)", "reward.png"),
        (DBAR_PI_KEY, "dbar_pi = mean |log pi - log mu|", "dbar_pi.png"),
        (GATE_RATE_KEY, "SAT gate rate", "gate_rate.png"),
    ):
        plot(out / name, {n: rows for n, rows in runs.items()}, by_name, key, label)
    return table


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(path: Path, runs: dict[str, list[dict]], specs: dict[str, Spec], key: str, label: str) -> Path | None:
    """One panel per (mismatch, lag), one line per arm: seed mean of a 10-step moving average, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(specs[n].tag, specs[n].lag) for n in runs}, key=lambda p: (p[0], -p[1]))
    if not panels or not any(key in r for rows in runs.values() for r in rows):
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {arm: (colors[i % len(colors)], "-" if i < len(colors) else "--") for i, arm in enumerate(ARMS)}
    for ax, (tag, lag) in zip(axes[0], panels, strict=True):
        for arm in ARMS:
            curves = [
                smooth([r.get(key, math.nan) for r in rows], 10)
                for n, rows in runs.items()
                if specs[n].arm == arm and specs[n].lag == lag and specs[n].tag == tag
            ]
            if not curves or all(math.isnan(v) for v in curves[0]):
                continue
            length = min(len(c) for c in curves)
            steps = list(range(1, length + 1))
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(length)]
            color, style = styles[arm]
            ax.plot(steps, mean, style, color=color, label=f"{arm} ({len(curves)})")
            lo = [min(c[i] for c in curves) for i in range(length)]
            hi = [max(c[i] for c in curves) for i in range(length)]
            ax.fill_between(steps, lo, hi, color=color, alpha=0.12)
        ax.set_title(f"lag {lag}" + (f", mismatch {tag}" if tag else ""))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="one seed, fewer arms and steps (<= 10 min)")
    mode.add_argument("--search", action="store_true", help="baselines only, over lags and mismatches")
    mode.add_argument("--summarize-only", type=Path, metavar="DIR", help="rebuild table and figures from DIR")
    parser.add_argument("--out", type=Path, default=Path("runs/study"))
    parser.add_argument("--seeds", type=int, nargs="+", help="override the mode's seeds")
    parser.add_argument("--steps", type=int, help="override the regime's optimizer steps per run")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (2 cores: 2)")
    parser.add_argument("--assets", type=Path, help="the default's assets (default: verl-sat's cache, built if absent)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
    return parser


def specs_from_args(args: argparse.Namespace) -> tuple[list[Spec], str]:
    settings = dict(REGIME)
    if args.quick:
        settings["steps"] = QUICK["steps"]
    if args.steps:
        settings["steps"] = args.steps
    if args.search:
        specs = search_plan(args.seeds or SEARCH["seeds"])
        if args.steps:
            specs = [replace(s, settings=_with(s.settings, steps=args.steps)) for s in specs]
        return specs, "Regime search: the baselines alone"
    mode = QUICK if args.quick else FULL
    title = "Staleness study (quick)" if args.quick else "Staleness study"
    return plan(mode["arms"], args.seeds or mode["seeds"], settings), title


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = (args.summarize_only or args.out).resolve()
    if args.summarize_only:
        specs = [Spec(**_spec_fields(json.loads(p.read_text()))) for p in sorted(out.glob("runs/*/study_spec.json"))]
        table = summarize(out, specs, "Staleness study")
        print("\n".join(format_table(table)))
        return 0
    specs, title = specs_from_args(args)
    print(f"[study] {title}: {len(specs)} runs x {specs[0].config().steps} optimizer steps", flush=True)
    if args.dry_run:
        for spec in specs:
            print(spec.name, asdict(spec.config()))
        return 0
    assets = args.assets or _default_assets()
    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        run_dir = out / "runs" / spec.name
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "study_spec.json").write_text(json.dumps(asdict(spec), default=list))
    print(f"[study] load average {os.getloadavg()[0]:.1f}; assets {assets}", flush=True)
    start = time.perf_counter()
    timings = run_all(specs, out, assets, args.jobs)
    wall = time.perf_counter() - start
    table = summarize(out, specs, title)
    print("\n".join(format_table(table)))
    if timings:
        per_run = sorted(t["startup_s"] for t in timings)
        print(
            f"[study] {wall / 60:.1f} min wall for {len(timings)} runs; per-run start-up median "
            f"{per_run[len(per_run) // 2]:.2f} s (verl's trainer: ~65 s); {out / 'study.md'}",
            flush=True,
        )
    return 0


def _with(settings: tuple[tuple[str, Any], ...], **changes: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted({**dict(settings), **changes}.items()))


def _spec_fields(raw: dict[str, Any]) -> dict[str, Any]:
    raw["settings"] = tuple(tuple(kv) for kv in raw["settings"])
    return raw


def _default_assets() -> Path:
    from verl_sat.main import build_assets_once, default_assets_dir

    assets = default_assets_dir()
    build_assets_once(assets)
    return assets


if __name__ == "__main__":
    sys.exit(main())
