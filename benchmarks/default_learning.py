"""Does the default run visibly learn? Three seeds of ``verl-sat``, each timed end to end.

    python benchmarks/default_learning.py [--seeds 1 2 3] [--out runs/bench_learning] [-- overrides...]

Each seed is one run of the main job (``python -m verl_sat.main``, the embedded default with
cached assets: build them first with one plain ``verl-sat``), one after another. The seed goes
to verl's data shuffling (``data.seed``), the actor's data loader
(``actor_rollout_ref.actor.data_loader_seed``), FSDP's init (``actor_rollout_ref.actor.fsdp_config.seed``)
and the rollout's sampling generator (``actor_rollout_ref.rollout.seed``). Printed per seed: the
wall time of the whole command (start-up included), the mean reward of the first and the last
quarter of the global steps, the split of a step's time (verl_sat.trainer.progress), and pass/fail
against two criteria: at most ``--max-wall`` seconds and a last-quarter reward at least
``--min-gain`` above the first quarter's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from verl_sat.files import METRICS_FILE, read_metrics
from verl_sat.trainer import progress as job_summary


def seed_overrides(seed: int) -> list[str]:
    """The Hydra overrides that seed one run."""
    return [
        f"data.seed={seed}",
        f"actor_rollout_ref.actor.data_loader_seed={seed}",
        f"actor_rollout_ref.actor.fsdp_config.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
    ]


def run_seed(out: Path, seed: int, extra: list[str]) -> dict[str, float]:
    run_dir = out / f"seed{seed}"
    cmd = [sys.executable, "-m", "verl_sat.main", f"sat.run_dir={run_dir}", *seed_overrides(seed), *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_FILE_LOGGER")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    (out / f"seed{seed}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed} failed (rc {proc.returncode}); see {out / f'seed{seed}.log'}")
    rows = read_metrics(run_dir / METRICS_FILE)
    first, last = job_summary.quarter_means(rows) or (float("nan"), float("nan"))
    split = job_summary.timing_split(rows)
    return {"wall": wall, "steps": len(rows), "first": first, "last": last, "split": split}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_learning"))
    parser.add_argument("--max-wall", type=float, default=300.0, help="seconds per run, start-up included")
    parser.add_argument("--min-gain", type=float, default=0.25, help="last-quarter minus first-quarter reward")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()[0]:.1f} (2-core timings under load are pessimistic)", flush=True)
    failures = 0
    for seed in args.seeds:
        result = run_seed(out, seed, args.overrides)
        gain = result["last"] - result["first"]
        ok = result["wall"] <= args.max_wall and gain >= args.min_gain
        failures += not ok
        print(
            f"seed {seed}: {result['wall']:.0f} s wall, {result['steps']} steps | reward first-quarter "
            f"{result['first']:.3f} -> last-quarter {result['last']:.3f} (gain {gain:+.3f}) | "
            f"{job_summary.format_split(result['split'], 2)} | load {os.getloadavg()[0]:.1f} | "
            f"{'PASS' if ok else 'FAIL'}",
            flush=True,
        )
    print(f"{len(args.seeds) - failures}/{len(args.seeds)} seeds pass", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
