"""sat.lag=auto through the real trainer on CPU, beside fixed lags: broadcasts, staleness and throughput.

    python benchmarks/auto_lag_trainer.py [--steps 24] [--lags 1 4] [--out runs/bench_auto_lag] [-- overrides...]

Each arm is one run of the main job (``python -m verl_sat.main``, the embedded default with cached
assets), one after another, all over the same number of optimizer steps: fixed lag n runs
``steps / n`` global steps of n optimizer steps, ``auto`` runs ``steps`` global steps of one.
Printed per arm, measured in this one invocation: broadcasts, max staleness, seconds per
optimizer step over training (verl's ``timing_s/step``, first global step left out), seconds in
weight sync (``timing_s/update_weights``), the last-quarter reward, and each arm's ratios to lag 1.
Writes ``auto_lag_trainer.png``: auto's lag at each step with its broadcasts, and dbar_pi per arm.
On 2 CPU cores a sync of the tiny model costs little, so the throughput column shows the
mechanism's overhead, not the saving on a 30B MoE (docs/async.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from verl_sat.files import METRICS_FILE, read_metrics
from verl_sat.trainer import progress as job_summary
from verl_sat.trainer.auto_lag import BROADCAST_KEY, LAG_KEY

STEP, SYNC, STALENESS = "timing_s/step", "timing_s/update_weights", "training/sat/staleness_steps/max"


def run_arm(out: Path, name: str, overrides: list[str]) -> tuple[list[dict[str, Any]], float]:
    run_dir = out / name
    cmd = [sys.executable, "-m", "verl_sat.main", f"sat.run_dir={run_dir}", *overrides]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_FILE_LOGGER")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (rc {proc.returncode}); see {out / f'{name}.log'}")
    return read_metrics(run_dir / METRICS_FILE), wall


def arm_stats(rows: list[dict[str, Any]], per_global: int, wall: float) -> dict[str, float]:
    """Broadcasts, staleness, s/optimizer step (first global step left out), sync seconds, reward."""
    timed = rows[1:] or rows
    broadcasts = sum(r.get(BROADCAST_KEY, 1.0) for r in rows)  # a fixed lag broadcasts every global step
    quarters = job_summary.quarter_means(rows) or (float("nan"), float("nan"))
    return {
        "optimizer_steps": len(rows) * per_global,
        "broadcasts": broadcasts,
        "max_staleness": max(r.get(STALENESS, 0.0) for r in rows),
        "s_per_opt_step": sum(r.get(STEP, 0.0) for r in timed) / (len(timed) * per_global),
        "sync_s": sum(r.get(SYNC, 0.0) for r in rows),
        "reward_last_quarter": quarters[1],
        "wall": wall,
    }


def plot(path: Path, arms: dict[str, list[dict[str, Any]]], per_global: dict[str, int]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    auto = arms.get("auto", [])
    left.plot([r["step"] for r in auto], [r.get(LAG_KEY, 0) for r in auto], marker=".", label="steps since broadcast")
    hits = [r for r in auto if r.get(BROADCAST_KEY)]
    left.scatter([r["step"] for r in hits], [r[LAG_KEY] for r in hits], color="tab:red", zorder=3, label="broadcast")
    left.set_xlabel("optimizer step")
    left.set_ylabel("auto: lag")
    left.legend(fontsize=8)
    for name, rows in arms.items():
        n = per_global[name]
        right.plot([r["step"] * n for r in rows], [r.get("actor/mismatch_abs_mean", 0) for r in rows], label=name)
    right.set_xlabel("optimizer step")
    right.set_ylabel("dbar_pi")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per arm (a multiple of every lag)")
    parser.add_argument("--lags", type=int, nargs="+", default=[1, 4], help="the fixed lags beside auto")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_auto_lag"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every arm")
    args = parser.parse_args(argv)
    if 1 not in args.lags or any(args.steps % n for n in args.lags):
        parser.error(f"--lags must include 1 and divide --steps={args.steps}: got {args.lags}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    arms, per_global, stats = {}, {}, {}
    plan = [(f"lag{n}", n, [f"sat.lag={n}", f"trainer.total_training_steps={args.steps // n}"]) for n in args.lags]
    plan.append(("auto", 1, ["sat.lag=auto", f"trainer.total_training_steps={args.steps}"]))
    for name, n, overrides in plan:
        rows, wall = run_arm(out, name, [*overrides, *args.overrides])
        arms[name], per_global[name] = rows, n
        stats[name] = arm_stats(rows, n, wall)
        print(f"{name}: done in {wall:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    ref = stats["lag1"]
    print(
        "| arm | optimizer steps | broadcasts | max staleness | s/optimizer step | sync s | last-quarter reward "
        "| broadcasts / lag 1 | s per step / lag 1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in stats.items():
        print(
            f"| {name} | {s['optimizer_steps']} | {s['broadcasts']:.0f} | {s['max_staleness']:.0f} | "
            f"{s['s_per_opt_step']:.2f} | {s['sync_s']:.1f} | {s['reward_last_quarter']:.3f} | "
            f"{s['broadcasts'] / ref['broadcasts']:.2f} | {s['s_per_opt_step'] / ref['s_per_opt_step']:.2f} |"
        )
    print(f"figure: {plot(out / 'auto_lag_trainer.png', arms, per_global)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
