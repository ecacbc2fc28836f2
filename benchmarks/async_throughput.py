"""Optimizer steps/s and generated tokens/s: sync vs separate_async at lag 1, 2, 8 (CPU default).

    python benchmarks/async_throughput.py [--steps 8] [--out runs/bench_async]

Each configuration is one run of the main job (``python -m verl_sat.main``, the embedded
default: SAT-GSPO on the tiny MoE), one after another in this one invocation, on the same
machine and the same cached assets. The first global step (start-up, warm-up batches) is
dropped. Throughput is read from each run's own metrics.jsonl:

    optimizer steps/s = optimizer steps in the kept global steps / their summed wall time
    tokens/s          = generated response tokens in those steps / the same time

and printed with the ratio to sync. One global step holds ``lag`` optimizer steps of
``ppo_mini_batch_size`` prompts (verl_sat.trainer.recipe), so every configuration trains on the same
number of prompts per optimizer step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROMPTS_PER_OPT_STEP = 8  # actor.ppo_mini_batch_size of sat_gspo_cpu
SAMPLES = 4  # rollout.n
CONFIGS: list[tuple[str, int, list[str]]] = [
    ("sync", 1, ["trainer.v1.trainer_mode=sync", "sat.lag=1"]),
    ("separate_async", 1, ["sat.lag=1"]),
    ("separate_async", 2, ["sat.lag=2"]),
    ("separate_async", 8, ["sat.lag=8"]),
]


def run(out: Path, name: str, lag: int, overrides: list[str], global_steps: int) -> dict[str, float]:
    run_dir = out / f"{name}-lag{lag}"
    cmd = [
        sys.executable,
        "-m",
        "verl_sat.main",
        f"sat.run_dir={run_dir}",
        f"trainer.total_training_steps={global_steps}",
        *overrides,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = rows[1:] or rows
    seconds = sum(r["timing_s/step"] for r in kept)
    opt_steps = lag * len(kept)
    responses = opt_steps * PROMPTS_PER_OPT_STEP * SAMPLES
    tokens = sum(r["response_length/mean"] * lag * PROMPTS_PER_OPT_STEP * SAMPLES for r in kept)
    return {"opt_steps_per_s": opt_steps / seconds, "tokens_per_s": tokens / seconds, "responses": responses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per configuration (after start-up)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_async"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, lag, overrides in CONFIGS:
        global_steps = 1 + max(1, args.steps // lag)  # +1: the dropped start-up step
        results.append((name, lag, run(args.out, name, lag, overrides, global_steps)))
        print(f"done: {name} lag {lag}", flush=True)
    base = results[0][2]
    print(f"\n{'mode':>15} {'lag':>4} {'opt steps/s':>12} {'tokens/s':>10} {'steps ratio':>12} {'tokens ratio':>13}")
    for name, lag, r in results:
        print(
            f"{name:>15} {lag:>4} {r['opt_steps_per_s']:12.3f} {r['tokens_per_s']:10.1f} "
            f"{r['opt_steps_per_s'] / base['opt_steps_per_s']:12.2f} {r['tokens_per_s'] / base['tokens_per_s']:13.2f}"
        )


if __name__ == "__main__":
    main()
